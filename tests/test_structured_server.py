"""Structured decoding through the real tritonserver: constraints arrive in the
``sampling_parameters`` JSON of HTTP generate and gRPC streaming requests. Short on
purpose: the server is the session fixture shared with the other server modules."""
from __future__ import annotations

import json
import queue
import re

import jsonschema
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from backend.core import SamplingParams

pytestmark = [pytest.mark.server, pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Hanoi", "Bangkok"]},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "address", "tags"], "additionalProperties": False}
PROMPT = "Describe a person as JSON:"
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["yes", "no", "maybe", "yesterday"]


def generate(server, prompt: str, params: dict) -> tuple[int, dict]:
    response = requests.post(
        f"http://{server.http_url}/v2/models/{server.model}/generate",
        json={"text_input": prompt, "exclude_input_in_output": True,
              "sampling_parameters": json.dumps(params), "return_finish_reason": True,
              "return_output_ids": True, "return_num_output_tokens": True}, timeout=120)
    body = response.json()
    if "output_ids" in body and not isinstance(body["output_ids"], list):
        body["output_ids"] = [body["output_ids"]]  # Triton writes one-element arrays as scalars
    return response.status_code, body


class Stream:
    def __init__(self, server) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result=None, error=None:
                                 self.events.put((result, error)))
        self.model = server.model

    def send(self, rid: str, prompt: str, params: dict) -> None:
        def tensor(name, array, dtype):
            t = grpcclient.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            return t

        inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                  tensor("stream", np.array([True]), "BOOL"),
                  tensor("sampling_parameters",
                         np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
                  tensor("exclude_input_in_output", np.array([True]), "BOOL"),
                  tensor("return_finish_reason", np.array([True]), "BOOL"),
                  tensor("return_output_ids", np.array([True]), "BOOL")]
        self.client.async_stream_infer(self.model, inputs, request_id=rid,
                                       enable_empty_final_response=True)

    def next(self, timeout_s: float = 120.0):
        return self.events.get(timeout=timeout_s)

    def collect(self, rids, timeout_s: float = 120.0) -> dict[str, dict]:
        """Streamed pieces joined per request: text, ids, finish reason."""
        out = {rid: {"text": "", "ids": [], "finish_reason": None, "pieces": 0} for rid in rids}
        pending = set(rids)
        while pending:
            result, error = self.next(timeout_s)
            assert error is None, f"stream error: {error}"
            rid = result.get_response().id
            names = {o.name for o in result.get_response().outputs}
            entry = out[rid]
            if "text_output" in names:
                entry["text"] += result.as_numpy("text_output")[0].decode()
                entry["ids"] += [int(i) for i in result.as_numpy("output_ids")]
                entry["pieces"] += 1
            if "finish_reason" in names:
                entry["finish_reason"] = result.as_numpy("finish_reason")[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                pending.discard(rid)
        return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@pytest.fixture
def stream(triton_server):
    s = Stream(triton_server)
    yield s
    s.close()


def test_json_schema_as_object_and_as_string(triton_server, reference_engine):
    greedy = {"temperature": 0, "max_tokens": 120}
    want = reference_engine.generate(PROMPT, SamplingParams(json_schema=SCHEMA, **{
        "temperature": 0.0, "max_new_tokens": 120}))[0]
    jsonschema.validate(json.loads(want.text, strict=False), SCHEMA)
    bodies = {}
    for form, schema in (("object", SCHEMA), ("string", json.dumps(SCHEMA))):
        status, body = generate(triton_server, PROMPT, {**greedy, "json_schema": schema})
        assert status == 200, body
        assert body["finish_reason"] == "stop"
        # strict=False: xgrammar lets a maxLength string hold raw control characters
        jsonschema.validate(json.loads(body["text_output"], strict=False), SCHEMA)
        bodies[form] = body
    assert bodies["object"]["text_output"] == bodies["string"]["text_output"] == want.text
    for body in bodies.values():  # the response's ids are the output's ids
        assert body["num_output_tokens"] == len(want.token_ids)
        assert body["output_ids"] == want.token_ids, (
            f"{len(body['output_ids'])} ids for {body['num_output_tokens']} output tokens: "
            f"{reference_engine.tokenizer.decode(body['output_ids'])!r}")


def test_sampled_json_schema_conforms(triton_server):
    for seed in (1, 2):
        status, body = generate(triton_server, "A person:", {
            "temperature": 1.0, "seed": seed, "max_tokens": 120, "json_schema": SCHEMA})
        assert status == 200, body
        assert body["finish_reason"] == "stop"
        jsonschema.validate(json.loads(body["text_output"], strict=False), SCHEMA)


def test_regex_and_choices_over_a_grpc_stream(stream):
    stream.send("date", "Today is", {"temperature": 0, "max_tokens": 30, "regex": DATE})
    stream.send("date-sampled", "Today is", {"temperature": 1, "seed": 4, "max_tokens": 30,
                                             "regex": DATE})
    stream.send("choice", "Answer:", {"temperature": 1, "seed": 9, "max_tokens": 30,
                                      "choices": CHOICES})
    got = stream.collect(["date", "date-sampled", "choice"])
    for rid in ("date", "date-sampled"):
        assert re.fullmatch(DATE, got[rid]["text"]), got[rid]
        assert got[rid]["finish_reason"] == "stop" and got[rid]["pieces"] >= 2
    assert got["choice"]["text"] in CHOICES and got["choice"]["finish_reason"] == "stop"


def test_bad_regex_errors_clearly_and_the_next_request_succeeds(triton_server, stream):
    status, body = generate(triton_server, "x", {"max_tokens": 4, "regex": "a(b"})
    assert status in (400, 500), body
    assert "invalid regex constraint" in body["error"], body
    status, body = generate(triton_server, "x", {"temperature": 0, "max_tokens": 8,
                                                 "regex": "[a-c]{3}"})
    assert status == 200 and re.fullmatch("[a-c]{3}", body["text_output"]), body
    # the same over a stream: an error for that request, the stream goes on
    stream.send("bad", "x", {"max_tokens": 4, "json_schema": "{not json"})
    result, error = stream.next()
    assert error is not None and "invalid json_schema constraint" in str(error), (result, error)
    stream.send("good", "x", {"temperature": 0, "max_tokens": 8, "choices": CHOICES})
    assert stream.collect(["good"])["good"]["text"] in CHOICES
