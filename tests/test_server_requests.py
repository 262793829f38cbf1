"""Requests as their senders write them, on the session's real tritonserver: vLLM's
sampling keys and value types, prompt logprobs, scoring after an empty prompt, the
prefix-cache flush, Triton's HTTP generate "id", and every malformed input refused with
an error that names it (HTTP 400, never 500), the server serving on."""
from __future__ import annotations

import json

import pytest

try:
    import radixlm
except ImportError:  # not pip-installed: use the source tree
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm

from conftest import ADMIN_TOKEN, generate_body, http_generate, server_stats

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_sampling_values_sent_as_strings_are_read_as_the_vllm_backend_reads_them(
        triton_server, reference_engine):
    out = http_generate(triton_server, {
        "text_input": "Hello", "exclude_input_in_output": True, "return_output_ids": True,
        "parameters": {"temperature": "0", "max_tokens": "5", "ignore_eos": "true"}})
    want = reference_engine.generate(["Hello"], {"temperature": 0, "max_tokens": 5,
                                                 "ignore_eos": True})[0]
    assert out.status_code == 200 and out["output_ids"] == want.token_ids


def test_min_tokens_stop_regex_and_logit_bias_reach_the_engine(triton_server,
                                                               reference_engine):
    base = reference_engine.generate(["Count:"], {"temperature": 0, "max_tokens": 12,
                                                  "ignore_eos": True})[0]
    regex = json.dumps({"temperature": 0, "max_tokens": 12, "ignore_eos": True,
                        "stop_regex": [base.text[4:6].replace("\\", "\\\\")]})
    out = http_generate(triton_server, {**generate_body("Count:", {}),
                                        "sampling_parameters": regex})
    assert out["finish_reason"] == "stop" and base.text.startswith(out["text_output"])
    stop_at_first = {"temperature": 0, "max_tokens": 12, "stop_token_ids": [base.token_ids[0]]}
    assert http_generate(triton_server, generate_body("Count:", stop_at_first))[
        "output_ids"] == base.token_ids[:1]
    held = http_generate(triton_server, generate_body("Count:", {**stop_at_first,
                                                                 "min_tokens": 6}))
    assert len(held["output_ids"]) >= 6
    biased = http_generate(triton_server, generate_body("Count:", {
        "temperature": 0, "max_tokens": 4, "ignore_eos": True, "logit_bias": {"1000": 100}}))
    assert biased["output_ids"] == [1000] * 4


def test_structured_outputs_and_guided_decoding_constrain_like_our_keys(triton_server):
    for key in ("structured_outputs", "guided_decoding"):
        out = http_generate(triton_server, generate_body("Pick:", {
            "temperature": 0, "max_tokens": 8, key: json.dumps({"choice": ["yes", "no"]})}))
        assert out.status_code == 200 and out["text_output"] in ("yes", "no")
    obj = http_generate(triton_server, generate_body("JSON:", {
        "temperature": 0, "max_tokens": 24, "response_format": {"type": "json_object"}}))
    assert obj["text_output"].lstrip()[:1] == "{"  # an object, not any JSON value


def test_prompt_logprobs_come_with_the_first_response_from_logprob_start_len(triton_server):
    body = generate_body("The capital of France is", {
        "temperature": 0, "max_tokens": 2, "prompt_logprobs": 1, "logprob_start_len": 2})
    out = http_generate(triton_server, body)
    entries = json.loads(out["prompt_logprobs"])
    assert out["num_input_tokens"] == len(entries) + 2
    assert entries[0]["logprob"] is None and all(e["logprob"] <= 0 for e in entries[1:])
    assert all(isinstance(e["text"], str) and len(e["top_logprobs"]) == 1 for e in entries[1:])


def test_scoring_after_an_empty_prompt_gives_each_choices_token_ids(triton_server):
    client = radixlm.HttpTritonClient(f"http://{triton_server.http_url}")
    scores = client.score("", ["Paris is big", "a banana"])
    assert [s.choice for s in scores.scores] == ["Paris is big", "a banana"]
    assert all(len(s.token_ids) == s.num_tokens == len(s.token_logprobs) >= 1
               for s in scores.scores)


def test_flush_cache_empties_the_prefix_cache_over_grpc_and_http(triton_server, monkeypatch):
    # a flush is administrative: the clients present the admin token from the environment
    monkeypatch.delenv("RADIXLM_ADMIN_TOKEN", raising=False)
    assert radixlm.TritonClient(triton_server.grpc_url).flush_cache() is False
    monkeypatch.setenv("RADIXLM_ADMIN_TOKEN", ADMIN_TOKEN)
    http_generate(triton_server, generate_body("A prompt worth caching " * 4, {"max_tokens": 2}))
    assert server_stats(triton_server)["radix_cache_tokens"] > 0
    assert radixlm.TritonClient(triton_server.grpc_url).flush_cache() is True
    assert server_stats(triton_server)["radix_cache_tokens"] == 0
    backend = radixlm.RuntimeEndpoint(f"http://{triton_server.http_url}")
    assert radixlm.flush_cache(backend) is True


def test_the_http_generate_id_is_not_taken_for_a_sampling_key(triton_server):
    out = http_generate(triton_server, {**generate_body("Hi", {"max_tokens": 2}), "id": "42"})
    assert out.status_code == 200 and out["id"] == "42"


BAD = {
    "response_format as a string": ({"response_format": "json_object"},
                                    "response_format must be a JSON object"),
    "regex that is a number": ({"regex": 5}, "regex must be a string"),
    "seed beyond 64 bits": ({"seed": 2 ** 64}, "seed must be in"),
    "stop_token_ids of strings": ({"stop_token_ids": ["a"]},
                                  "stop_token_ids must be a list of integer token ids"),
    "stop_token_ids outside the vocabulary": ({"stop_token_ids": [10 ** 7]},
                                              "stop_token_ids entries must be token ids"),
    "top_k beyond the vocabulary": ({"top_k": 10 ** 12}, "top_k must be at most"),
    "infinite temperature": ({"temperature": float("inf")}, "temperature must be a finite"),
    "infinite repetition_penalty": ({"repetition_penalty": float("inf")},
                                    "repetition_penalty must be a finite"),
    "a string that is no number": ({"temperature": "warm"}, "temperature must be a number"),
    "an internal field": ({"prompt_logprobs_start": 0}, "unknown sampling parameter"),
    "10,000 stop strings": ({"stop": [f"s{i}" for i in range(10_000)]},
                            "the number of stop entries is 10000; this server allows at most"),
    "lora": ({"lora_name": "alpaca"}, "LoRA feature is not enabled"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_sampling_value_is_a_400_naming_it(triton_server, case):
    params, message = BAD[case]
    out = http_generate(triton_server, generate_body("hi", params))
    assert out.status_code == 400, out
    assert message in out["error"]


def test_bad_prompts_and_choices_are_400s_naming_them(triton_server):
    # Triton's HTTP frontend parses the JSON into tensors before the model sees it: a
    # number for a string input is its error (a 500 naming the JSON), not the model's.
    numeric = http_generate(triton_server, {"text_input": 5})
    assert numeric.status_code != 200 and "JSON" in numeric["error"]
    huge_id = http_generate(triton_server, {"input_ids": [5, 2 ** 40]})
    assert huge_id.status_code == 400 and "input_ids must be token ids" in huge_id["error"]
    choices = http_generate(triton_server, {"text_input": "Q", "choices": json.dumps(
        [f"c{i}" for i in range(3000)])})
    assert choices.status_code == 400 and "the number of choices is 3000" in choices["error"]
    good = http_generate(triton_server, generate_body("hi", {"temperature": 0, "max_tokens": 2}))
    assert good.status_code == 200 and len(good["output_ids"]) == 2
