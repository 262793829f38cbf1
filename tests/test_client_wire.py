"""The client's wire contract (clients/radixlm/wire.py) agrees with the server's (backend/wire.py)."""
from __future__ import annotations

import dataclasses
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
from backend.core import ChoiceScore, SamplingParams

TRITON_TYPES = {"BYTES": "TYPE_STRING", "INT32": "TYPE_INT32", "BOOL": "TYPE_BOOL"}


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
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"max_new_tokens"}
    assert client_wire.SAMPLING_KEYS == fields | {"max_tokens"}
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


def test_a_client_token_id_request_and_a_scoring_request_parse_on_the_server():
    job = server_wire.parse_request(as_inputs(client_wire.encode_request([5, 6, 7])), {})
    assert job.prompt == [5, 6, 7]
    job = server_wire.parse_request(
        as_inputs(client_wire.encode_request("Q:", {}, choices=[" yes", " no"])), {})
    assert isinstance(job, server_wire.ScoreJob)
    assert (job.prompt, job.choices) == ("Q:", [" yes", " no"])


def test_server_generation_outputs_decode_on_the_client():
    outputs = server_wire.generation_outputs(
        text="héllo", token_ids=[11, 12], context_ids=[9], finish_reason="length",
        num_input_tokens=5, num_output_tokens=2, num_cached_tokens=4, index=1, logprobs=None)
    chunk = client_wire.decode_chunk(outputs.get)
    assert chunk == radixlm.Chunk(text="héllo", index=1, output_ids=(11, 12),
                                  finish_reason="length", num_input_tokens=5,
                                  num_output_tokens=2, num_cached_tokens=4, logprobs=None)


def test_server_score_outputs_decode_on_the_client():
    outputs = server_wire.score_outputs(
        [ChoiceScore(" yes", -1.5, 3, [-0.5, -0.5, -0.5]), ChoiceScore(" no", -0.4, 1, [-0.4])],
        num_input_tokens=6, num_cached_tokens=5)
    scores = client_wire.decode_choice_scores(outputs.get)
    assert [(s.choice, s.num_tokens, s.normalized_logprob) for s in scores] == [
        (" yes", 3, pytest.approx(-0.5)), (" no", 1, pytest.approx(-0.4))]
    assert scores[0].token_logprobs == (-0.5, -0.5, -0.5)


def test_unknown_sampling_keys_fail_on_the_client_before_sending():
    with pytest.raises(ValueError, match="max_lenght"):
        client_wire.encode_request("x", {"max_lenght": 3})
    encoded = client_wire.encode_request("x", {"json_schema": {"type": "object"}})
    sent = json.loads(as_inputs(encoded)["sampling_parameters"][0])
    assert sent == {"json_schema": {"type": "object"}}
    assert as_inputs(encoded)["exclude_input_in_output"].dtype == np.bool_


def test_keys_and_outputs_the_client_uses_ahead_of_the_server_are_not_declared_there_yet():
    # When the server adds one of these, move it into SAMPLING_KEYS / OUTPUTS.
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert not client_wire.NEWER_SAMPLING_KEYS & fields
    assert not set(client_wire.NEWER_OUTPUTS) & {s["name"] for s in server_wire.OUTPUT_SPECS}
    sent = json.loads(client_wire.sampling_json({"min_tokens": 3, "stop_regex": ["a+"]}))
    assert sent == {"min_tokens": 3, "stop_regex": ["a+"]}


def test_a_response_holding_every_sample_decodes_into_one_chunk_per_sample():
    payloads = [server_wire.generation_outputs(
        text=text, token_ids=ids, context_ids=[9], finish_reason=reason, num_input_tokens=3,
        num_output_tokens=len(ids), num_cached_tokens=1, index=i,
        logprobs=[]) for i, (text, ids, reason) in enumerate(
            [("ab", [1, 2], "length"), ("c", [3], "stop")])]
    chunks = client_wire.decode_chunks(server_wire.merge_samples(payloads).get)
    assert [(c.index, c.text, c.output_ids, c.finish_reason, c.num_output_tokens)
            for c in chunks] == [(0, "ab", (1, 2), "length", 2), (1, "c", (3,), "stop", 1)]
    merged = radixlm.results.merge_chunks(chunks)
    assert [s.text for s in merged.samples] == ["ab", "c"]
