"""End to end: a real tritonserver (started through radixlm-serve) serving the
default model, spoken to with tritonclient gRPC streaming and Triton's HTTP generate."""
from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend.core import SamplingParams
from conftest import Stream, generate_body, grpc_inputs, http_generate, joined, response_dict, \
    server_stats

pytestmark = [pytest.mark.server, pytest.mark.slow]

GREEDY = {"temperature": 0, "max_tokens": 8}
PROMPTS = {
    "en": "The quick brown fox jumps over the lazy dog because",
    "vi": "Hà Nội là thủ đô của Việt Nam, nổi tiếng với phở và",
    "th": "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย และมี",
    "zh": "北京是中国的首都，也是一座历史悠久的城市，",
}


def reference(engine, prompts: list[str], params: dict) -> list:
    return engine.generate(prompts, SamplingParams.from_dict(params))


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
                       "max_tokens must be >= 1"),
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
    assert "n must be >= 1" in stream.next_error()
    ids = grpcclient.InferInput("input_ids", [2], "INT32")  # token ids are INT64
    ids.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
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
