"""The frontend language against a real tritonserver serving the default model.

Uses the ``triton_server`` (``.grpc_url``) and ``reference_engine`` fixtures of conftest.py;
the reference engine is configured like the served one, so its scores and greedy outputs
are what the server computes.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

try:
    import radixlm
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm

from radixlm import assistant, gen, select, system, user

pytestmark = [pytest.mark.server, pytest.mark.slow]

SHARED_PREFIX = ("You are reviewing short product descriptions. For each one, say what the "
                 "product is, who would buy it, and one thing that could be improved. "
                 "Keep every answer under twenty words and do not repeat the description.\n"
                 "Description: a steel water bottle that keeps drinks cold for a day.\n")


@pytest.fixture(scope="module")
def backend(triton_server):
    backend = radixlm.Triton(triton_server.grpc_url, model="llm")
    yield backend
    backend.close()


def engine_scores(engine, prompt: str, choices: list[str]):
    """The engine's own scores for ``choices`` after ``prompt`` (one score request)."""
    gid = engine.add_score_request(prompt, choices)
    for _ in range(10_000):
        for out in engine.step():
            if out.request_id == gid and out.finished:
                assert out.choice_scores is not None, out.error
                return out.choice_scores
    raise AssertionError("the engine never answered the score request")


@pytest.mark.parametrize("prompt, choices", [
    ("The capital of France is", [" Paris", " a banana", " London", " the"]),
    ("Question: is the sky green?\nAnswer:", [" yes", " no", " maybe not"]),
    ("Pick a colour:", [" red", " green", " blue", " dark purple"]),
])
def test_select_returns_the_choice_the_engine_ranks_first(backend, reference_engine, prompt,
                                                          choices):
    @radixlm.function
    def pick(s):
        s += prompt
        s += select("choice", choices=choices)

    state = pick.run(backend=backend)
    expected = engine_scores(reference_engine, prompt, choices)
    best = max(expected, key=lambda s: s.normalized_logprob)
    assert state["choice"] == best.choice
    got = state.get_meta_info("choice")["normalized_logprobs"]
    assert got == pytest.approx([s.normalized_logprob for s in expected], abs=1e-3)


def test_select_inside_an_assistant_turn_scores_the_rendered_chat(backend, reference_engine):
    choices = ["positive", "negative", "mixed"]

    @radixlm.function
    def sentiment(s):
        s += system("Classify the sentiment of the review.")
        s += user("The battery lasts forever but the screen scratches easily.")
        s += assistant(select("label", choices=choices))

    state = sentiment.run(backend=backend)
    template = backend.chat_template()
    prompt = template.render(state.messages()[:-1], add_generation_prompt=True)
    assert state.text() == prompt + state["label"] + template.suffix("assistant")
    expected = engine_scores(reference_engine, prompt, choices)
    assert state["label"] == max(expected, key=lambda s: s.normalized_logprob).choice


def test_fork_branches_report_cached_prompt_tokens_covering_the_shared_prefix(backend):
    @radixlm.function
    def review(s):
        s += SHARED_PREFIX
        forks = s.fork(3)
        for f, aspect in zip(forks, ["What is it?", "Who buys it?", "Improve:"]):
            f += aspect + gen("answer", max_tokens=6, temperature=0.0)
        forks.join()
        review.forks = forks

    review.run(backend=backend)
    prefix_tokens = review.forks.prefix_result.num_input_tokens
    assert prefix_tokens > 40
    for branch in review.forks:
        meta = branch.get_meta_info("answer")
        # the branch prompt extends the prefix; at most the prefix's last token can be
        # tokenized differently where the branch text joins it
        assert prefix_tokens - 1 <= meta["num_cached_tokens"] < meta["num_input_tokens"]


def test_regex_and_json_schema_constrained_gens_conform(backend):
    schema = {
        "type": "object",
        "properties": {"grade": {"type": "string", "enum": ["A", "B", "C"]},
                       "passed": {"type": "boolean"}},
        "required": ["grade", "passed"],
        "additionalProperties": False,
    }

    @radixlm.function
    def structured(s):
        s += "Phone number: " + gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=16)
        s += "\nVerdict as JSON: " + gen("verdict", json_schema=schema, max_tokens=64)

    state = structured.run(backend=backend, temperature=0.0)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", state["phone"])
    jsonschema.validate(json.loads(state["verdict"]), schema)
    assert state.get_meta_info("phone")["finish_reason"] == {"type": "stop"}


def test_run_batch_of_32_programs_matches_the_engine(backend, reference_engine):
    from backend.core import SamplingParams

    @radixlm.function
    def item(s, i):
        s += f"Item number {i} is called"
        s += gen("name", max_tokens=6)
        s += ". Its code is " + gen("code", regex=r"[A-Z][0-9]{2}", max_tokens=8)

    states = item.run_batch([{"i": i} for i in range(32)], backend=backend, num_threads=16,
                            temperature=0.0)
    prompts = [f"Item number {i} is called" for i in range(32)]
    expected = reference_engine.generate(prompts, SamplingParams(max_new_tokens=6,
                                                                 temperature=0.0))
    assert [s["name"] for s in states] == [e.text for e in expected]
    for i, state in enumerate(states):
        assert re.fullmatch(r"[A-Z][0-9]{2}", state["code"])
        assert state.text() == f"{prompts[i]}{state['name']}. Its code is {state['code']}"


def test_a_bad_regex_raises_a_program_error_naming_the_variable(backend):
    @radixlm.function
    def broken(s):
        s += "Answer: " + gen("ok_before", max_tokens=2)
        s += gen("bad_pattern", regex="([a-z", max_tokens=4)

    with pytest.raises(radixlm.ProgramError) as info:
        broken.run(backend=backend)
    assert info.value.var == "bad_pattern"
    assert "bad_pattern" in str(info.value) and info.value.message
    assert isinstance(info.value.__cause__, radixlm.ServerError)
    # and the gRPC request that failed, by the id it was sent with
    assert info.value.request_id == info.value.__cause__.request_id
    assert f"(request {info.value.request_id})" in str(info.value)

    @radixlm.function
    def fine(s):
        s += "Answer: " + gen("x", max_tokens=2)

    assert fine.run(backend=backend)["x"]  # the server keeps serving


def test_streamed_pieces_concatenate_to_the_variable(backend):
    @radixlm.function
    def story(s):
        s += "Once upon a time" + gen("story", max_tokens=12, temperature=0.0)

    state = story.run(backend=backend, stream=True)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["story"]
    meta = state.get_meta_info("story")
    assert 1 <= meta["num_output_tokens"] == len(meta["output_ids"]) <= 12
