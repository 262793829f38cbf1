"""Issue 3, end to end: a real tritonserver (started through radixlm-serve) serving the
default model, spoken to with tritonclient gRPC streaming and Triton's HTTP generate."""
from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from backend.core import SamplingParams
from backend.wire import read_model_info

pytestmark = [pytest.mark.server, pytest.mark.slow]

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "default"
GREEDY = {"temperature": 0, "max_tokens": 8}
PROMPTS = {
    "en": "The quick brown fox jumps over the lazy dog because",
    "vi": "Hà Nội là thủ đô của Việt Nam, nổi tiếng với phở và",
    "th": "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย และมี",
    "zh": "北京是中国的首都，也是一座历史悠久的城市，",
}


# ---- clients --------------------------------------------------------------------------

def grpc_inputs(prompt: str, params: dict, stream: bool = True, **extra) -> list:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    tensors = [
        tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([stream]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_),
               "BYTES"),
        tensor("exclude_input_in_output", np.array([True]), "BOOL"),
    ]
    return tensors + [tensor(name, array, dtype) for name, (array, dtype) in extra.items()]


def response_dict(result) -> dict:
    response = result.get_response()
    out = {"id": response.id, "final": response.parameters["triton_final_response"].bool_param}
    names = {o.name for o in response.outputs}
    for name in ("text_output", "finish_reason", "logprobs"):
        if name in names:
            out[name] = result.as_numpy(name)[0].decode("utf-8")
    for name in ("output_ids", "context_ids"):
        if name in names:
            out[name] = [int(i) for i in result.as_numpy(name)]
    for name in ("num_input_tokens", "num_output_tokens", "num_cached_tokens", "index"):
        if name in names:
            out[name] = int(result.as_numpy(name)[0])
    return out


class Stream:
    """One gRPC bidirectional stream; responses are grouped by request id."""

    def __init__(self, server) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result=None, error=None:
                                 self.events.put((result, error)))
        self.model = server.model

    def send(self, request_id: str, inputs: list) -> None:
        self.client.async_stream_infer(self.model, inputs, request_id=request_id,
                                       enable_empty_final_response=True)

    def collect(self, request_ids, timeout_s: float = 120.0) -> dict[str, list[dict]]:
        pending, responses = set(request_ids), {rid: [] for rid in request_ids}
        deadline = time.monotonic() + timeout_s
        while pending:
            result, error = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert error is None, f"stream error: {error}"
            item = response_dict(result)
            responses[item["id"]].append(item)
            if item["final"]:
                pending.discard(item["id"])
        return responses

    def next_error(self, timeout_s: float = 60.0) -> str:
        result, error = self.events.get(timeout=timeout_s)
        assert error is not None, f"expected an error, got {response_dict(result)}"
        return str(error)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture
def stream(triton_server):
    s = Stream(triton_server)
    yield s
    s.close()


class Generated(dict):
    """HTTP generate's JSON; Triton writes one-element arrays as scalars, so list-valued
    outputs are read back as lists."""

    def __init__(self, response: requests.Response) -> None:
        super().__init__(response.json())
        self.status_code = response.status_code
        for name in ("output_ids", "context_ids"):
            if name in self and not isinstance(self[name], list):
                self[name] = [self[name]]


def http_generate(server, body: dict, timeout_s: float = 120.0) -> Generated:
    return Generated(requests.post(
        f"http://{server.http_url}/v2/models/{server.model}/generate", json=body,
        timeout=timeout_s))


def generate_body(prompt: str, params: dict) -> dict:
    return {"text_input": prompt, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params)}


def server_stats(server) -> dict:
    response = http_generate(server, {"parameters": {"debug": "stats"}})
    assert response.status_code == 200, response
    return json.loads(response["stats"])


def joined(pieces: list[dict]) -> tuple[str, list[int]]:
    return "".join(p["text_output"] for p in pieces), [i for p in pieces for i in p["output_ids"]]


def reference(engine, prompts: list[str], params: dict) -> list:
    return engine.generate(prompts, SamplingParams.from_dict(params))


# ---- issue 3 checks ---------------------------------------------------------------------

def test_greedy_grpc_stream_and_http_generate_equal_engine_generate(
        triton_server, stream, reference_engine):
    prompts = [PROMPTS["en"], "Once upon a time, in a small village,", "1, 2, 3, 4,"]
    expected = reference(reference_engine, prompts, GREEDY)
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        rid = f"greedy-{i}"
        stream.send(rid, grpc_inputs(prompt, GREEDY))
        pieces = stream.collect([rid])[rid]
        assert joined(pieces) == (want.text, want.token_ids)
        assert pieces[-1]["final"] and pieces[-1]["finish_reason"] == want.finish_reason
        assert sum(not p["final"] for p in pieces) == len(pieces) - 1

        body = http_generate(triton_server, generate_body(prompt, GREEDY))
        assert body.status_code == 200, body
        assert body["text_output"] == want.text
        assert body["output_ids"] == want.token_ids
        assert body["num_output_tokens"] == len(want.token_ids)
        assert body["num_input_tokens"] == want.num_prompt_tokens


@pytest.mark.parametrize("language", sorted(PROMPTS))
def test_streamed_pieces_concatenate_to_the_non_streamed_text(
        triton_server, stream, reference_engine, language):
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    rid = f"concat-{language}"
    stream.send(rid, grpc_inputs(PROMPTS[language], params))
    pieces = stream.collect([rid])[rid]
    whole = http_generate(triton_server, generate_body(PROMPTS[language], params))
    assert joined(pieces) == (whole["text_output"], whole["output_ids"])
    assert len(whole["output_ids"]) == 12 and len(pieces) >= 2
    # each piece's context_ids are the ids right before its output_ids
    seen = reference_engine.tokenizer.encode(PROMPTS[language])
    for piece in pieces:
        context = piece["context_ids"]
        assert seen[len(seen) - len(context):] == context
        seen = seen + piece["output_ids"]


def test_64_concurrent_streams_complete_with_correct_outputs(stream, reference_engine):
    params = {"temperature": 0, "max_tokens": 6}
    prompts = [f"Request number {i} asks about the colour of" for i in range(64)]
    expected = reference(reference_engine, prompts, params)
    for i, prompt in enumerate(prompts):
        stream.send(f"many-{i}", grpc_inputs(prompt, params))
    responses = stream.collect([f"many-{i}" for i in range(64)], timeout_s=150)
    for i, want in enumerate(expected):
        pieces = responses[f"many-{i}"]
        assert joined(pieces) == (want.text, want.token_ids), f"request {i}"
        assert [p["final"] for p in pieces].count(True) == 1


def test_cancel_mid_stream_aborts_the_request_and_frees_its_memory(triton_server):
    before = server_stats(triton_server)
    max_tokens = 400
    s = Stream(triton_server)
    s.send("to-cancel", grpc_inputs(PROMPTS["en"], {"temperature": 0, "max_tokens": max_tokens,
                                                     "ignore_eos": True}))
    for _ in range(3):  # it is generating
        result, error = s.events.get(timeout=60)
        assert error is None and not response_dict(result)["final"]
    s.close(cancel=True)
    deadline = time.monotonic() + 30
    while True:
        stats = server_stats(triton_server)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 \
                and stats["num_pending_requests"] == 0:
            break
        assert time.monotonic() < deadline, f"request still running after cancel: {stats}"
        time.sleep(0.2)
    assert stats["integrity_ok"], stats["integrity_error"]
    assert stats["kv_tokens_in_use_by_requests"] == 0
    assert stats["generated_tokens"] - before["generated_tokens"] < max_tokens


BAD_HTTP_REQUESTS = {
    "missing text_input": ({"sampling_parameters": "{}"}, "missing input 'text_input'"),
    "empty text_input": ({"text_input": ""}, "'text_input' is empty"),
    "malformed JSON": ({"text_input": "hi", "sampling_parameters": "{max_tokens: 2"},
                       "'sampling_parameters' is not valid JSON"),
    "unknown key": ({"text_input": "hi", "sampling_parameters": '{"max_tokenz": 2}'},
                    "unknown sampling parameter(s): max_tokenz"),
    "max_tokens < 1": ({"text_input": "hi", "parameters": {"max_tokens": 0}},
                       "max_new_tokens must be >= 1"),
    "prompt too long": ({"text_input": "hello " * 50_000}, "the context length is"),
    "wrong shape": ({"text_input": ["a", "b"]}, "text_input"),
    "wrong dtype": ({"text_input": "hi", "stream": "yes"}, "boolean"),
}


@pytest.mark.parametrize("case", sorted(BAD_HTTP_REQUESTS))
def test_bad_input_gets_a_clear_error_and_the_next_request_succeeds(triton_server, case):
    body, message = BAD_HTTP_REQUESTS[case]
    response = http_generate(triton_server, body)
    assert response.status_code in (400, 500), response
    assert message in response["error"]
    good = http_generate(triton_server, generate_body("hi", {"temperature": 0, "max_tokens": 2}))
    assert good.status_code == 200 and len(good["output_ids"]) == 2


def test_bad_input_over_grpc_stream_errors_that_request_only(stream):
    stream.send("bad", grpc_inputs("hi", {"temperature": 0, "max_tokens": 2, "n": 0}))
    assert "n must be in [1, 64]" in stream.next_error()
    ids = grpcclient.InferInput("input_ids", [2], "INT64")
    ids.set_data_from_numpy(np.array([1, 2], dtype=np.int64))
    stream.send("bad-dtype", [ids])
    assert "input_ids" in stream.next_error()
    stream.send("good", grpc_inputs("hi", GREEDY))
    assert stream.collect(["good"])["good"][-1]["final"]


def test_shared_prefix_second_request_reports_cached_tokens(triton_server):
    prefix = ("System: you are a careful assistant for the harbour office of Hải Phòng. "
              "Answer in one short sentence. Question: ") * 2
    params = {"temperature": 0, "max_tokens": 2}
    first = http_generate(triton_server, generate_body(prefix + "when does the ferry leave?", params))
    second = http_generate(triton_server, generate_body(prefix + "where is the fish market?", params))
    assert first.status_code == second.status_code == 200
    assert second["num_cached_tokens"] > 0
    assert second["num_cached_tokens"] < second["num_input_tokens"]


# ---- the rest of the contract -------------------------------------------------------------

def test_non_streamed_answer_includes_the_prompt_by_default(triton_server):
    body = {"text_input": "Hello there", "sampling_parameters": json.dumps(GREEDY)}
    text = http_generate(triton_server, body)["text_output"]
    assert text.startswith("Hello there") and len(text) > len("Hello there")


def test_n_samples_stream_with_an_index(stream):
    params = {"temperature": 1.0, "seed": 7, "max_tokens": 3, "n": 2, "ignore_eos": True}
    stream.send("two", grpc_inputs("Pick a number:", params))
    pieces = stream.collect(["two"])["two"]
    by_index = {i: [p for p in pieces if p["index"] == i] for i in (0, 1)}
    assert all(sum(len(p["output_ids"]) for p in by_index[i]) == 3 for i in (0, 1))
    assert [p["final"] for p in pieces].count(True) == 1 and pieces[-1]["final"]


def test_choices_are_scored_in_one_response(stream):
    choices = grpcclient.InferInput("choices", [1], "BYTES")
    choices.set_data_from_numpy(np.array([b'["Paris", "a banana"]'], dtype=np.object_))
    stream.send("score", grpc_inputs("The capital of France is", {}, stream=False) + [choices])
    result, error = stream.events.get(timeout=60)
    assert error is None
    scores = json.loads(result.as_numpy("choice_scores")[0])
    assert [s["choice"] for s in scores] == ["Paris", "a banana"]
    assert all(s["num_tokens"] == len(s["token_logprobs"]) >= 1 for s in scores)
    assert all(s["logprob_sum"] < 0 for s in scores)


def test_logprobs_are_returned_when_asked(triton_server):
    body = generate_body("Hello", {"temperature": 0, "max_tokens": 3, "logprobs": 2})
    out = http_generate(triton_server, body)
    logprobs = json.loads(out["logprobs"])
    assert [lp["token_id"] for lp in logprobs] == out["output_ids"]
    assert all(lp["logprob"] <= 0 and len(lp["top_logprobs"]) == 2 for lp in logprobs)


def test_model_config_gives_clients_the_served_models_chat_template(triton_server):
    config = requests.get(f"http://{triton_server.http_url}/v2/models/{triton_server.model}"
                          "/config", timeout=30).json()
    published = {k: v["string_value"] for k, v in config["parameters"].items()}
    from_tokenizer = read_model_info({"model_path": str(DEFAULT_MODEL)}, [])
    assert from_tokenizer["eos_token"] == "<|im_end|>"
    assert published["eos_token"] == from_tokenizer["eos_token"]
    assert published["chat_template"] == from_tokenizer["chat_template"]


def test_sigterm_ends_in_flight_streams_with_a_final_response_and_exits(tmp_path):
    """SIGTERM to the server's process group (what Ctrl-C or `kill -TERM -<pgid>` does):
    the backend aborts the in-flight request with a final response, and the server
    unloads the model (finalize runs) and exits well within Triton's exit timeout."""
    import os
    import signal

    from conftest import _stop, start_server

    server = start_server(tmp_path / "server.log")
    try:
        s = Stream(server)
        s.send("in-flight", grpc_inputs(PROMPTS["en"], {"temperature": 0, "max_tokens": 3000,
                                                         "ignore_eos": True}))
        result, error = s.events.get(timeout=60)
        assert error is None and not response_dict(result)["final"]
        started = time.monotonic()
        os.killpg(server.process.pid, signal.SIGTERM)
        while True:  # the stream ends with a final response, not an error
            result, error = s.events.get(timeout=30)
            assert error is None, error
            item = response_dict(result)
            if item["final"]:
                break
        assert item["finish_reason"] == "abort" and item["num_output_tokens"] < 3000
        s.close()
        server.process.wait(timeout=30)
        assert time.monotonic() - started < 30
        log = server.log_path.read_text()
        assert "radixlm: engine loop stopped" in log and "successfully unloaded 'llm'" in log
    finally:
        _stop(server.process)
