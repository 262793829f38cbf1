"""The client's wire contract (clients/radixlm/wire.py) agrees with the server's (backend/wire.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    import radixlm
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm

from radixlm import wire as client_wire
from backend import model_config
from backend import wire as server_wire
from backend import wire_outputs
from backend.core import ChoiceScore
from backend.core.outputs import TokenLogprob
from backend.core.sampling_keys import REQUEST_KEYS
from backend.wire_outputs import SampleOutput

TRITON_TYPES = {"BYTES": "TYPE_STRING", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
                "BOOL": "TYPE_BOOL", "UINT32": "TYPE_UINT32", "FP32": "TYPE_FP32"}
EVERY_OUTPUT = frozenset(server_wire.OPTIONAL_OUTPUTS)


def test_every_client_input_is_a_server_input_with_the_same_type_and_shape():
    server = {spec["name"]: spec for spec in server_wire.INPUT_SPECS}
    for name, (datatype, shape) in client_wire.INPUTS.items():
        assert server[name]["data_type"] == TRITON_TYPES[datatype], name
        assert server[name]["dims"] == shape, name


def test_every_output_the_client_reads_is_a_server_output_with_the_same_type():
    server = {spec["name"]: spec["data_type"] for spec in server_wire.OUTPUT_SPECS}
    for name, datatype in client_wire.OUTPUTS.items():
        assert server[name] == TRITON_TYPES[datatype], name


def test_the_client_accepts_exactly_the_sampling_keys_the_server_accepts():
    assert client_wire.SAMPLING_KEYS == REQUEST_KEYS
    assert set(client_wire.RETURN_FLAGS) <= set(server_wire.RETURN_FLAGS)
    assert set(model_config.MODEL_INFO_PARAMETERS) == {
        client_wire.CHAT_TEMPLATE_PARAM, client_wire.EOS_TOKEN_PARAM, client_wire.BOS_TOKEN_PARAM}


def as_inputs(tensors):
    return {name: array for name, _, array in tensors}


def test_a_client_generation_request_parses_on_the_server_as_sent():
    params = {"max_tokens": 7, "temperature": 0.0, "stop": "\n", "regex": "[a-z]+", "seed": 3}
    job = server_wire.parse_request(
        as_inputs(client_wire.encode_request("Hello", params, stream=True)), {})
    assert isinstance(job, server_wire.GenerateJob)
    assert (job.prompt, job.stream, job.prepend_input) == ("Hello", True, False)
    assert (job.params.max_new_tokens, job.params.temperature, job.params.stop,
            job.params.regex, job.params.seed) == (7, 0.0, ["\n"], "[a-z]+", 3)
    # the outputs the client reads are the ones it asks for
    assert job.outputs == frozenset(client_wire.ALWAYS_RETURNED)


def test_a_stream_that_asks_for_the_prompts_text_gets_it_in_input_text():
    job = server_wire.parse_request(
        as_inputs(client_wire.encode_request([5, 6, 7], {}, stream=True, prompt_text=True)), {})
    assert (job.prompt, job.stream, job.prepend_input) == ([5, 6, 7], True, True)
    assert server_wire.INPUT_TEXT in job.outputs
    first = wire_outputs.generation_outputs(
        [SampleOutput(0, " b", [6], None, 1, 0)], outputs=job.outputs, num_input_tokens=3,
        context_ids=[], input_text="x y z")
    later = wire_outputs.generation_outputs(
        [SampleOutput(0, " c", [7], "length", 1, 0)], outputs=job.outputs, num_input_tokens=3,
        context_ids=[], input_text="")
    assert [c.prompt_text for c in client_wire.decode_chunks(first.get)] == ["x y z"]
    assert [c.prompt_text for c in client_wire.decode_chunks(later.get)] == [None]


def test_a_samples_entry_that_only_says_it_is_still_running_is_not_passed_on():
    outputs = wire_outputs.generation_outputs(
        [SampleOutput(0, "", [], None, 0, 0), SampleOutput(1, " b", [6], None, 1, 0)],
        outputs=frozenset(client_wire.ALWAYS_RETURNED), num_input_tokens=3, context_ids=[])
    running, new = client_wire.decode_chunks(outputs.get)
    assert not running.says_something and new.says_something
    assert client_wire.decode_chunks(wire_outputs.generation_outputs(
        [SampleOutput(0, "", [], "stop", 0, 0)], outputs=frozenset(client_wire.ALWAYS_RETURNED),
        num_input_tokens=3, context_ids=[]).get)[0].says_something  # its end


def test_a_client_token_id_request_and_a_scoring_request_parse_on_the_server():
    job = server_wire.parse_request(as_inputs(client_wire.encode_request([5, 6, 7])), {})
    assert job.prompt == [5, 6, 7]
    job = server_wire.parse_request(
        as_inputs(client_wire.encode_request("Q:", {}, choices=[" yes", " no"])), {})
    assert isinstance(job, server_wire.ScoreJob)
    assert (job.prompt, job.choices) == ("Q:", [" yes", " no"])


def test_server_generation_outputs_decode_on_the_client():
    outputs = wire_outputs.generation_outputs(
        [SampleOutput(1, "héllo", [11, 12], "length", 2, 4)], outputs=EVERY_OUTPUT,
        num_input_tokens=5, context_ids=[9])
    chunk = client_wire.decode_chunk(outputs.get)
    assert chunk == radixlm.Chunk(text="héllo", index=1, output_ids=(11, 12),
                                  finish_reason="length", num_input_tokens=5,
                                  num_output_tokens=2, num_cached_tokens=4, logprobs=None)


def test_a_running_sample_and_its_logprobs_decode_on_the_client():
    entry = TokenLogprob(11, -0.25, {11: -0.25, 7: -2.0}, 1, "a", {11: "a", 7: "b"})
    outputs = wire_outputs.generation_outputs(
        [SampleOutput(0, "a", [11], None, 1, 0, [entry], -0.25)], outputs=EVERY_OUTPUT,
        num_input_tokens=5, context_ids=[9],
        prompt_logprobs=[TokenLogprob(3, None, text="x"), TokenLogprob(4, -1.0, {4: -1.0}, 1,
                                                                       "y", {4: "y"})])
    chunk = client_wire.decode_chunk(outputs.get)
    assert chunk.finish_reason == ""  # "None" on the wire while the sample runs
    assert chunk.logprobs == [{"11": {"logprob": -0.25, "rank": 1, "decoded_token": "a"},
                               "7": {"logprob": -2.0, "rank": 2, "decoded_token": "b"}}]
    parsed = radixlm.logprobs.parse(chunk.logprobs, chunk.output_ids, 2, True, "output")
    assert parsed.tokens == [radixlm.logprobs.TokenLogprob(-0.25, 11, "a")]
    prompt = radixlm.logprobs.parse(chunk.prompt_logprobs, [], 1, True, "input_token_logprobs")
    assert prompt.tokens == [radixlm.logprobs.TokenLogprob(None, 3, "x"),
                             radixlm.logprobs.TokenLogprob(-1.0, 4, "y")]
    assert prompt.top[1] == [radixlm.logprobs.TokenLogprob(-1.0, 4, "y")]


def test_server_score_outputs_decode_on_the_client():
    outputs = wire_outputs.score_outputs(
        [ChoiceScore(" yes", -1.5, 3, [-0.5, -0.5, -0.5], [5, 6, 7]),
         ChoiceScore(" no", -0.4, 1, [-0.4], [8])],
        num_input_tokens=6, num_cached_tokens=5)
    scores = client_wire.decode_choice_scores(outputs.get)
    assert [(s.choice, s.num_tokens, s.normalized_logprob) for s in scores] == [
        (" yes", 3, pytest.approx(-0.5)), (" no", 1, pytest.approx(-0.4))]
    assert scores[0].token_logprobs == (-0.5, -0.5, -0.5)
    assert scores[0].token_ids == (5, 6, 7)


def test_unknown_sampling_keys_fail_on_the_client_before_sending():
    with pytest.raises(ValueError, match="max_lenght"):
        client_wire.encode_request("x", {"max_lenght": 3})
    encoded = client_wire.encode_request("x", {"json_schema": {"type": "object"}})
    sent = json.loads(as_inputs(encoded)["sampling_parameters"][0])
    assert sent == {"json_schema": {"type": "object"}}
    assert as_inputs(encoded)["exclude_input_in_output"].dtype == np.bool_


def test_min_tokens_and_stop_regex_reach_the_engine():
    job = server_wire.parse_request(as_inputs(client_wire.encode_request(
        "x", {"min_tokens": 3, "stop_regex": ["a+b"], "max_tokens": 9})), {})
    assert (job.params.min_new_tokens, job.params.stop_regex) == (3, ["a+b"])


def test_a_response_holding_every_sample_decodes_into_one_chunk_per_sample():
    outputs = wire_outputs.generation_outputs(
        [SampleOutput(0, "ab", [1, 2], "length", 2, 1), SampleOutput(1, "c", [3], "stop", 1, 1)],
        outputs=EVERY_OUTPUT, num_input_tokens=3, context_ids=[9])
    chunks = client_wire.decode_chunks(outputs.get)
    assert [(c.index, c.text, c.output_ids, c.finish_reason, c.num_output_tokens)
            for c in chunks] == [(0, "ab", (1, 2), "length", 2), (1, "c", (3,), "stop", 1)]
    merged = radixlm.results.merge_chunks(chunks)
    assert [s.text for s in merged.samples] == ["ab", "c"]
