"""Tree-of-thought search: branch into several plans, expand each into solutions, let the
model vote on each leaf with ``select``, and keep the best. Every branch shares its parent's
prefix, which the fork prefills once.

    python clients/examples/tree_of_thought.py --url localhost:8001
"""
from __future__ import annotations

import argparse

import radixlm
from radixlm import assistant, gen, select, user

QUESTION = ("A farmer has 17 sheep. All but 9 run away. He then buys twice as many sheep as "
            "he has left. How many sheep does he have now?")
VERDICTS = ["correct", "wrong"]


@radixlm.function
def tree_of_thought(s, question, num_plans=2, num_solutions=2):
    s += user(question)
    plans = s.fork(num_plans)
    for plan in plans:
        plan += assistant("Plan: " + gen("plan", max_tokens=48, stop="\n", temperature=0.8))
    leaves = []
    for plan in plans:
        solutions = plan.fork(num_solutions)
        for solution in solutions:
            solution += user("Follow the plan and give the final answer.")
            solution += assistant(gen("solution", max_tokens=64, temperature=0.8))
            solution += user("Is that answer correct?")
            solution += assistant(select("verdict", choices=VERDICTS))
        leaves.extend((plan, solution) for solution in solutions)
    scored = [(leaf.get_meta_info("verdict")["normalized_logprobs"][0], plan["plan"],
               leaf["solution"]) for plan, leaf in leaves]
    confidence, best_plan, best_solution = max(scored)
    s.set_var("confidence", confidence)
    s += assistant(f"Plan: {best_plan}\nAnswer: {best_solution}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--plans", type=int, default=2)
    parser.add_argument("--solutions", type=int, default=2)
    args = parser.parse_args(argv)
    radixlm.set_default_backend(radixlm.Triton(args.url, model=args.model))
    state = tree_of_thought.run(question=QUESTION, num_plans=args.plans,
                                num_solutions=args.solutions)
    print(state.messages()[-1]["content"])
    print(f"(log-probability of 'correct' per token: {state['confidence']:.3f})")


if __name__ == "__main__":
    main()
