"""Few-shot question answering over a batch: every program shares the examples, so after the
first request their KV comes from the radix cache.

    python clients/examples/few_shot_qa.py --url localhost:8001
"""
from __future__ import annotations

import argparse

import radixlm
from radixlm import gen

EXAMPLES = [
    ("What is the capital of Japan?", "Tokyo"),
    ("How many legs does a spider have?", "Eight"),
    ("Which planet is closest to the sun?", "Mercury"),
    ("What gas do plants take in from the air?", "Carbon dioxide"),
]
QUESTIONS = [
    "What is the capital of Italy?",
    "How many days are in a leap year?",
    "Which ocean is the largest?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the chemical symbol for gold?",
    "How many continents are there?",
    "What is the tallest mountain on Earth?",
]


@radixlm.function
def few_shot_qa(s, question):
    s += "Answer each question in a few words.\n\n"
    for q, a in EXAMPLES:
        s += f"Question: {q}\nAnswer: {a}\n\n"
    s += f"Question: {question}\nAnswer:" + gen("answer", max_tokens=16, stop="\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--num-threads", type=int, default=8)
    args = parser.parse_args(argv)
    radixlm.set_default_backend(radixlm.Triton(args.url, model=args.model))
    states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS],
                                   num_threads=args.num_threads, temperature=0.0)
    for question, state in zip(QUESTIONS, states):
        meta = state.get_meta_info("answer")
        print(f"{question} -> {state['answer'].strip()!r} "
              f"(cached {meta['num_cached_tokens']}/{meta['num_input_tokens']} prompt tokens)")


if __name__ == "__main__":
    main()
