"""The batch programs of SGLang's benchmarks (``benchmark/*/bench_sglang.py``: MMLU,
HellaSwag, GSM8K, JSON decoding, JSON schema, multi-turn chat), written as its users write
them, with a few inline examples instead of the datasets, against a real tritonserver: the
benchmark command line, ``run_batch(..., progress_bar=True)``, constraints, meta info."""
from __future__ import annotations

import argparse
import json
import re
import sys

import jsonschema
import pytest

from sglang_ports import CappedBackend, capped, http_endpoint, sgl  # noqa: F401

pytestmark = pytest.mark.server


@pytest.fixture
def bench_args(triton_server, monkeypatch):
    """A benchmark's parsed command line, pointing at the test server's HTTP port."""
    from radixlm.test.test_utils import add_common_sglang_args_and_parse

    host, port = triton_server.http_url.split(":")
    monkeypatch.setattr(sys, "argv", ["bench_sglang.py", "--host", f"http://{host}",
                                      "--port", port, "--parallel", "8"])
    return add_common_sglang_args_and_parse(argparse.ArgumentParser())


def test_mmlu_one_token_answers_through_the_benchmark_command_line(bench_args):
    from radixlm.test.test_utils import select_sglang_backend

    examples = "Q: 2+2=?\nA. 3\nB. 4\nAnswer: B\n\n"
    questions = ["Q: 3+3=?\nA. 6\nB. 5\nAnswer:", "Q: 1+1=?\nA. 1\nB. 2\nAnswer:"]

    @sgl.function
    def few_shot_mmlu(s, examples, question):
        s += examples + question + sgl.gen("answer")

    backend = CappedBackend(select_sglang_backend(bench_args))
    states = few_shot_mmlu.run_batch([{"examples": examples, "question": q} for q in questions],
                                     temperature=0, max_new_tokens=1, backend=backend,
                                     num_threads=bench_args.parallel, progress_bar=True)
    preds = [s["answer"].strip()[0] if s["answer"].strip() else "" for s in states]
    assert len(preds) == 2 and backend.asked == [1, 1]
    assert all(s.get_meta_info("answer")["completion_tokens"] == 1 for s in states)


def test_gsm8k_counts_output_tokens_from_the_meta_info(capped):
    few_shot = "Question: Tom has 2 apples and buys 3 more. How many?\nAnswer: 5\n\n"
    questions = ["Question: 4 cats and 1 dog. How many pets?\nAnswer:",
                 "Question: 10 minus 7?\nAnswer:"]

    @sgl.function
    def few_shot_gsm8k(s, question):
        s += few_shot + question
        s += sgl.gen("answer", max_tokens=512, stop=["Question", "Assistant:", "<|separator|>"])

    states = few_shot_gsm8k.run_batch([{"question": q} for q in questions], temperature=0,
                                      num_threads=64, progress_bar=True)
    for s in states:
        assert not any(stop in s["answer"] for stop in ("Question", "Assistant:"))
    tokens = sum(s.get_meta_info("answer")["completion_tokens"] for s in states)
    assert 0 < tokens <= 2 * capped.max_tokens


def test_json_decode_regex_reads_its_var_scope_inside_the_program(capped, tmp_path, capsys):
    from radixlm.lang.ir import REGEX_FLOAT, REGEX_INT, REGEX_STR
    from radixlm.utils import dump_state_text, read_jsonl

    regex_list = r"\[(" + REGEX_STR + ", )*" + REGEX_STR + r"\]"

    @sgl.function
    def json_decode(s, document):
        s += "Extract the city from this page.\nPage begin.\n" + document + "Page end.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen("name", max_tokens=8, regex=REGEX_STR + ",") + "\n"
            s += '  "latitude": ' + sgl.gen("latitude", max_tokens=8, regex=REGEX_FLOAT + ",") + "\n"
            s += '  "population": ' + sgl.gen("population", max_tokens=8, regex=REGEX_INT + ",") + "\n"
            s += '  "landmarks": ' + sgl.gen("landmarks", max_tokens=24, regex=regex_list) + "\n"
            s += "}\n"
        print(f"warm-up result:\n{s['json_output']}")

    data = tmp_path / "questions.jsonl"
    data.write_text("\n".join(json.dumps({"document": d}) for d in
                              ("Oslo is the capital of Norway.", "Quito lies near the equator.")))
    arguments = [{"document": line["document"]} for line in read_jsonl(str(data))]
    json_decode.run(**arguments[0]).sync()
    assert "warm-up result:\n{\n" in capsys.readouterr().out
    states = json_decode.run_batch(arguments, temperature=0, num_threads=8, progress_bar=True)
    for s in states:
        assert s["json_output"] == "".join([
            "{\n", '  "name": ', s["name"], "\n", '  "latitude": ', s["latitude"], "\n",
            '  "population": ', s["population"], "\n", '  "landmarks": ', s["landmarks"],
            "\n", "}\n"])
    dump_state_text(str(tmp_path / "out.txt"), states)
    assert states[1]["json_output"] in (tmp_path / "out.txt").read_text()


def test_json_jump_forward_regex_output_matches_the_whole_regex(http_endpoint):
    character_regex = (r"""\{\n    "name": "[\w\d\s]{1,16}",\n"""
                       r"""    "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)",\n"""
                       r"""    "wand": \{\n        "length": [0-9]{1,2}\.[0-9]{0,2}\n    \},\n"""
                       r"""    "alive": "(Alive|Deceased)"\n\}""")

    @sgl.function
    def character_gen(s, name):
        s += name + " is a character in a wizard story. Fill in this character's details.\n"
        s += sgl.gen("json_output", max_tokens=256, regex=character_regex)

    sgl.set_default_backend(http_endpoint)
    try:
        states = character_gen.run_batch([{"name": "Harriet"}, {"name": "Ronald"}],
                                         temperature=0, num_threads=8, progress_bar=True)
    finally:
        sgl.set_default_backend(None)
    for s in states:
        assert re.fullmatch(character_regex, s["json_output"]), s["json_output"]


def test_json_schema_outputs_validate_against_their_schemas(http_endpoint):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "pet"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "pet": {"enum": ["cat", "dog"]}}}

    @sgl.function
    def schema_gen(s, message, json_schema, max_tokens):
        system, user = message
        s += sgl.system(system)
        s += sgl.user(user)
        s += sgl.assistant(sgl.gen("json_output", temperature=0, max_tokens=max_tokens,
                                   json_schema=json_schema))

    arguments = [{"message": ("Answer in JSON.", question), "json_schema": json.dumps(schema),
                  "max_tokens": 64} for question in ("Describe Ann.", "Describe Bo.")]
    states = schema_gen.run_batch(arguments, temperature=0, num_threads=8, progress_bar=True,
                                  backend=http_endpoint)
    for s in states:
        assert s.get_meta_info("json_output")["finish_reason"] == {"type": "stop"}
        jsonschema.validate(json.loads(s["json_output"]), schema)


def test_multi_turn_chat_turns_generate_exactly_their_budgets(capped):
    @sgl.function
    def multi_turns(s, qas):
        for qa in qas:
            s += qa["prompt"]
            s += sgl.gen(max_tokens=qa["new_tokens"], ignore_eos=True)

    multi_qas = [{"qas": [{"prompt": f"Turn {t} of chat {c}: say something.\n", "new_tokens": 2 + t}
                          for t in range(3)]} for c in range(2)]
    multi_turns.run_batch(multi_qas, temperature=0, backend=capped, num_threads=8,
                          progress_bar=True)
    assert sorted(r.num_output_tokens for _, r in capped.results) == [2, 2, 3, 3, 4, 4]


def test_hellaswag_sets_the_default_backend_through_the_api_module(bench_args):
    from radixlm.api import set_default_backend
    from radixlm.test.test_utils import select_sglang_backend

    set_default_backend(select_sglang_backend(bench_args))
    few_shot_examples = "Baking: She mixes flour and water and kneads the dough.\n\n"
    lines = [("Cooking: He boils water and", [" adds pasta.", " paints it.", " runs off."]),
             ("Sports: The player kicks the ball and", [" scores.", " eats it.", " sleeps."])]

    @sgl.function
    def few_shot_hellaswag(s, question, choices):
        s += few_shot_examples + question
        s += sgl.select("answer", choices=choices)

    try:
        rets = few_shot_hellaswag.run_batch([{"question": q, "choices": c} for q, c in lines],
                                            temperature=0, num_threads=8, progress_bar=True)
    finally:
        set_default_backend(None)
    preds = [lines[i][1].index(rets[i]["answer"]) for i in range(len(rets))]
    assert all(0 <= p < 3 for p in preds)
