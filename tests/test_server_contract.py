"""The rest of the served contract: prompt echo, n samples, scoring, logprobs, the model
config clients read, and shutdown with requests in flight."""
from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from backend.model_config import read_model_info
from conftest import DEFAULT_MODEL, Stream, _stop, generate_body, grpc_inputs, http_generate, \
    response_dict, sigterm_mid_stream, start_server
from test_engine_process import wait_gone

pytestmark = [pytest.mark.server, pytest.mark.slow]

GREEDY = {"temperature": 0, "max_tokens": 8}


def test_non_streamed_answer_includes_the_prompt_by_default(triton_server):
    body = {"text_input": "Hello there", "sampling_parameters": json.dumps(GREEDY)}
    text = http_generate(triton_server, body)["text_output"]
    assert text.startswith("Hello there") and len(text) > len("Hello there")


def test_n_samples_stream_an_entry_for_each_in_every_response(stream):
    params = {"temperature": 1.0, "seed": 7, "max_tokens": 3, "n": 2, "ignore_eos": True}
    stream.send("two", grpc_inputs("Pick a number:", params))
    pieces = stream.collect(["two"])["two"]
    assert all(sorted(p["samples"]) == [0, 1] for p in pieces)
    assert all(sum(len(p["samples"][i]) for p in pieces) == 3 for i in (0, 1))
    assert [p["final"] for p in pieces].count(True) == 1 and pieces[-1]["final"]


def test_n_samples_without_streaming_come_in_one_response(stream, reference_engine):
    params = {"temperature": 1.0, "seed": 7, "max_tokens": 4, "n": 3, "ignore_eos": True}
    stream.send("three", grpc_inputs("Pick a number:", params, stream=False))
    result, error = stream.events.get(timeout=60)
    assert error is None
    assert result.get_response().parameters["triton_final_response"].bool_param
    texts = [t.decode() for t in result.as_numpy("text_output")]
    ids = [int(i) for i in result.as_numpy("output_ids")]
    counts = [int(n) for n in result.as_numpy("num_output_tokens")]
    assert [int(i) for i in result.as_numpy("index")] == [0, 1, 2]
    assert counts == [4, 4, 4] and len(ids) == 12
    assert [f.decode() for f in result.as_numpy("finish_reason")] == ["length"] * 3
    # the same samples as the engine draws in-process for the same seed
    want = reference_engine.generate(["Pick a number:"], params)[0].samples
    assert [ids[4 * i:4 * i + 4] for i in range(3)] == [s.token_ids for s in want]
    assert texts == [s.text for s in want]


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


def test_logprobs_are_returned_when_asked_in_the_vllm_backends_shape(triton_server):
    body = generate_body("Hello", {"temperature": 0, "max_tokens": 3, "logprobs": 2})
    out = http_generate(triton_server, body)
    positions = json.loads(out["logprobs"])
    assert len(positions) == len(out["output_ids"]) == 3
    for position, token in zip(positions, out["output_ids"]):
        chosen = position[str(token)]  # the sampled token, then its alternatives
        assert chosen["rank"] == 1 and chosen["logprob"] <= 0  # greedy: the likeliest
        assert 1 <= len(position) <= 3
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in position.values())


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
    server = start_server(tmp_path / "server.log")
    try:
        s = Stream(server)
        params = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}
        s.send("in-flight", grpc_inputs("Tell me a long story.", params))
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


def test_the_engine_in_its_own_process_serves_the_same_tokens_and_stops_cleanly(
        tmp_path, reference_engine):
    """engine_process=true (the default on GPUs) behind a real tritonserver: greedy
    streams carry the in-process engine's tokens, a bad prompt fails alone, and SIGTERM to
    the process group ends an in-flight stream with a final response, stops the engine
    process and exits."""
    import shutil

    from backend.core import SamplingParams
    from conftest import MODEL_REPOSITORY, joined

    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "llm", repo / "llm")
    config = repo / "llm" / "config.pbtxt"
    config.write_text(config.read_text() +
                      '\nparameters: { key: "engine_process" value: { string_value: "true" } }\n')
    server = start_server(tmp_path / "server.log", (f"--model-repository={repo}",))
    try:
        log = server.log_path.read_text()
        assert "the engine runs in process" in log
        child = int(log.split("the engine runs in process ")[1].split()[0])
        s = Stream(server)
        prompts = ["The capital of France is", "Un deux trois", "def f(x):"]
        for i, p in enumerate(prompts):
            s.send(f"p{i}", grpc_inputs(p, GREEDY))
        s.send("too-long", grpc_inputs("hello " * 9000, GREEDY))  # refused by the engine process
        # the refusal and the other streams' tokens arrive in either order
        got, errors = {f"p{i}": [] for i in range(len(prompts))}, []
        pending, deadline = set(got), time.monotonic() + 120
        while pending or not errors:
            result, error = s.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if error is not None:
                errors.append(str(error))
                continue
            item = response_dict(result)
            got[item["id"]].append(item)
            if item["final"]:
                pending.discard(item["id"])
        assert len(errors) == 1 and "context length" in errors[0], errors
        want = reference_engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
        for i, w in enumerate(want):
            assert joined(got[f"p{i}"])[1] == w.token_ids
        assert sigterm_mid_stream(server, s)["finish_reason"] == "abort"
        s.close()
        server.process.wait(timeout=30)
        wait_gone(child, "the server", timeout_s=10)
    finally:
        _stop(server.process)
