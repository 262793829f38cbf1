"""The examples in clients/examples run as programs (against FakeBackend) and the README's
judge program and line counts match the files."""
from __future__ import annotations

import importlib
import itertools
import json
import subprocess
import sys
from pathlib import Path

import jsonschema

try:
    import radixlm  # noqa: F401  (the examples import it)
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm

from radixlm.testing import FakeBackend

CLIENTS = Path(__file__).resolve().parents[1] / "clients"
if str(CLIENTS / "examples") not in sys.path:
    sys.path.insert(0, str(CLIENTS / "examples"))
judge = importlib.import_module("judge")
few_shot_qa = importlib.import_module("few_shot_qa")
multi_turn_chat = importlib.import_module("multi_turn_chat")
tree_of_thought = importlib.import_module("tree_of_thought")
count_lines = importlib.import_module("count_lines")


def judge_backend(related: str) -> FakeBackend:
    def reply(prompt, params):
        if "json_schema" in params:
            return json.dumps({"grade": "B", "strongest": "evidence", "summary": "solid"})
        return "well argued. END trailing"

    def scorer(prompt, choice):
        return [-0.1] if choice in (related, "B") else [-2.0]

    return FakeBackend(reply=reply, scorer=scorer, delay=0.05)


def test_judge_runs_three_parallel_judgments_and_returns_a_schema_valid_verdict():
    backend = judge_backend(related="yes")
    topic, essay = judge.ESSAYS[0]
    state = judge.multi_dimensional_judge.run(topic=topic, essay=essay, backend=backend)
    assert state["related"] == "yes"
    assert state["judgment"] == ["well argued. "] * 3  # cut at the stop string "END"
    assert state["summary"] == "well argued"
    assert state["grade"] == "B"
    verdict = json.loads(state["verdict"])
    jsonschema.validate(verdict, judge.VERDICT_SCHEMA)
    assert backend.max_concurrent == 3
    prefill = [c for c in backend.calls if c[2] == {"max_tokens": 1, "temperature": 0.0}]
    assert len(prefill) == 1
    branches = [c for c in backend.calls if c[2].get("stop") == ["END"]]
    assert len(branches) == 3 and all(c[1].startswith(prefill[0][1]) for c in branches)
    assert [m["role"] for m in state.messages()][-2:] == ["user", "assistant"]


def test_judge_stops_after_the_relevance_check_when_the_essay_is_off_topic():
    backend = judge_backend(related="no")
    topic, essay = judge.ESSAYS[1]
    state = judge.multi_dimensional_judge.run(topic=topic, essay=essay, backend=backend)
    assert state["related"] == "no"
    assert [c[0] for c in backend.calls] == ["score"]


def test_few_shot_batch_answers_every_question_and_reuses_the_shared_examples():
    backend = FakeBackend(reply=lambda prompt, params: " " + prompt.split("Question: ")[-1][:10])
    states = few_shot_qa.few_shot_qa.run_batch(
        [{"question": q} for q in few_shot_qa.QUESTIONS], backend=backend, num_threads=4)
    assert [s["answer"] for s in states] == [" " + q[:10] for q in few_shot_qa.QUESTIONS]
    shared = len(states[0].text().split("Question: What is the capital of Italy")[0])
    cached = sorted(s.get_meta_info("answer")["num_cached_tokens"] for s in states)
    assert cached[0] == 0 and all(c >= shared for c in cached[1:])


def test_multi_turn_chat_streams_each_answer_and_each_turn_hits_the_cache():
    backend = FakeBackend(reply=lambda prompt, params: f"answer #{prompt.count('<|im_start|>')}")
    state = multi_turn_chat.chat.run(turns=multi_turn_chat.TURNS, stream=True, backend=backend)
    for i in range(len(multi_turn_chat.TURNS)):
        assert "".join(state.text_iter(f"answer_{i}")) == f"answer #{2 * i + 3}"
    metas = [state.get_meta_info(f"answer_{i}") for i in range(len(multi_turn_chat.TURNS))]
    for previous, meta in zip(metas, metas[1:]):
        # the whole previous prompt and its answer are a prefix of the next prompt
        assert meta["num_cached_tokens"] >= previous["num_input_tokens"] + len("answer #3")
    assert len(state.messages()) == 1 + 2 * len(multi_turn_chat.TURNS)


def test_tree_of_thought_keeps_the_leaf_the_model_finds_most_correct():
    plans, solutions = itertools.count(1), itertools.count(1)

    def reply(prompt, params):  # distinct text per branch, as sampling would give
        if params.get("max_tokens") == 1:
            return "-"  # a fork's prefix prefill
        return f"idea {next(plans)}" if params.get("stop") else f"solution {next(solutions)}"

    def scorer(prompt, choice):  # only the leaf holding "solution 3" is judged "correct"
        return [-0.2 if "solution 3" in prompt else -1.0] if choice == "correct" else [-0.5]

    state = tree_of_thought.tree_of_thought.run(question=tree_of_thought.QUESTION,
                                                backend=FakeBackend(reply=reply, scorer=scorer))
    assert state["confidence"] == -0.2
    final = state.messages()[-1]["content"]
    assert final.startswith("Plan: idea ") and final.endswith("\nAnswer: solution 3")
    assert (next(plans), next(solutions)) == (3, 5)  # 2 plans, 2 x 2 solutions


def test_the_readme_shows_the_judge_program_and_its_current_line_counts():
    readme = (CLIENTS / "README.md").read_text()
    source = (CLIENTS / "examples" / "judge.py").read_text()
    program = source[source.index("@radixlm.function"): source.index("\n\n\ndef main")]
    assert program in readme
    dsl = sum(count_lines.body_lines(CLIENTS / "examples" / "judge.py",
                                     {"multi_dimensional_judge"}).values())
    raw = count_lines.body_lines(CLIENTS / "examples" / "judge_raw.py")
    raw.pop("main")
    total = sum(raw.values())
    assert f"| radixlm language (`judge.py`) | {dsl} |" in readme
    assert f"| raw tritonclient (`judge_raw.py`, with the helpers it needs) | {total} |" in readme
    assert f"**{total / dsl:.1f}x**" in readme
    assert f"| {raw['multi_dimensional_judge']} ({raw['multi_dimensional_judge'] / dsl:.1f}x) |" \
        in readme
    printed = subprocess.run([sys.executable, str(CLIENTS / "examples" / "count_lines.py")],
                             capture_output=True, text=True, check=True).stdout
    assert f"judge.py):  {dsl} lines" in printed and f"{total / dsl:.1f}x" in printed
