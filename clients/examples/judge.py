"""The SGLang paper's multi-dimensional essay judge (text only), written in the radixlm language.

    python clients/examples/judge.py --url localhost:8001
"""
from __future__ import annotations

import argparse
import json

import radixlm
from radixlm import assistant, gen, select, system, user

DIMENSIONS = ["Clarity", "Originality", "Evidence"]
GRADES = ["A", "B", "C", "D", "F"]
VERDICT_SCHEMA = {
    "type": "object",
    "properties": {
        "grade": {"type": "string", "enum": GRADES},
        "strongest": {"type": "string", "enum": [d.lower() for d in DIMENSIONS]},
        "summary": {"type": "string", "maxLength": 40},
    },
    "required": ["grade", "strongest", "summary"],
    "additionalProperties": False,
}
ESSAYS = [
    ("Why cities should plant more trees",
     "Street trees cool neighbourhoods by several degrees in summer, soak up storm water "
     "and make people walk more. A study of Toronto blocks found residents with ten more "
     "trees reported health like people seven years younger. Planting is cheap compared "
     "with the air conditioning and drainage it saves."),
    ("Why cities should plant more trees",
     "My favourite food is pizza, especially with mushrooms. I eat it every Friday with "
     "my family and we watch a film afterwards."),
]


@radixlm.function
def multi_dimensional_judge(s, topic, essay):
    s += system("You are a strict teacher who grades student essays.")
    s += user(f"Essay topic: {topic}\n\nEssay:\n{essay}")
    s += assistant("I have read the essay.")
    s += user("Is the essay about its topic? Answer yes or no.")
    s += assistant(select("related", choices=["yes", "no"]))
    if s["related"] == "no":
        return
    forks = s.fork(len(DIMENSIONS))
    for f, dimension in zip(forks, DIMENSIONS):
        f += user(f"Judge only the essay's {dimension.lower()}. End your judgment with END.")
        f += assistant("Judgment: " + gen("judgment", max_tokens=48, stop="END"))
    forks.join()  # the parent's "judgment" becomes the list of the three branches' judgments
    judgments = "\n".join(f"{d}: {j.strip()}" for d, j in zip(DIMENSIONS, s["judgment"]))
    s += user("Merge the three judgments, summarize them, and give a letter grade.")
    s += assistant(judgments + "\nIn summary, " + gen("summary", max_tokens=48, stop=".")
                   + ".\nGrade: " + select("grade", choices=GRADES))
    s += user("Return the verdict as JSON.")
    s += assistant(gen("verdict", max_tokens=128, json_schema=VERDICT_SCHEMA))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="llm")
    args = parser.parse_args(argv)
    radixlm.set_default_backend(radixlm.Triton(args.url, model=args.model))
    states = multi_dimensional_judge.run_batch(
        [{"topic": topic, "essay": essay} for topic, essay in ESSAYS], temperature=0.0)
    for (topic, essay), state in zip(ESSAYS, states):
        print(f"=== {essay[:50]}...")
        print("related:", state["related"])
        if state["related"] == "no":
            continue
        for dimension, judgment in zip(DIMENSIONS, state["judgment"]):
            print(f"{dimension}: {judgment.strip()!r}")
        print("summary:", repr(state["summary"]), "| grade:", state["grade"])
        print("verdict:", json.loads(state["verdict"]))


if __name__ == "__main__":
    main()
