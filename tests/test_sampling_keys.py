"""The sampling keys clients send: converted to each field's type as Triton's vLLM backend
does, vLLM's structured-output keys mapped onto the engine's constraints, every rejected
value named with the reason, internal fields out of reach, and the server-side limits."""
from __future__ import annotations

import json

import pytest

from backend.core.limits import RequestLimits
from backend.core.sampling_keys import REQUEST_KEYS, from_request
from backend.core.sampling_params import JSON_OBJECT_SCHEMA, SamplingParams


def test_strings_convert_to_the_fields_type_as_the_vllm_backend_converts_them():
    params = from_request({"temperature": "0", "top_p": "1", "max_tokens": "100",
                           "ignore_eos": "true", "skip_special_tokens": "False",
                           "n": "2", "seed": "7", "repetition_penalty": "1.5"})
    assert (params.temperature, params.top_p, params.max_new_tokens, params.ignore_eos,
            params.skip_special_tokens, params.n, params.seed,
            params.repetition_penalty) == (0.0, 1.0, 100, True, False, 2, 7, 1.5)
    assert isinstance(params.temperature, float) and isinstance(params.max_new_tokens, int)


def test_defaults_are_vllms():
    params = from_request({})
    assert (params.max_new_tokens, params.n, params.logprobs, params.min_new_tokens) == \
        (16, 1, None, 0)


@pytest.mark.parametrize("data, message", [
    ({"temperature": "warm"}, "temperature must be a number, got 'warm'"),
    ({"max_tokens": "1.5"}, "max_tokens must be an integer, got '1.5'"),
    ({"max_tokens": True}, "max_tokens must be an integer, got True"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false, got 'yes'"),
    ({"seed": 2 ** 64}, "seed must be in"),
    ({"regex": 5}, "regex must be a string, got 5"),
    ({"response_format": "json_object"}, "response_format must be a JSON object"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of integer token ids"),
    ({"stop": [1]}, "stop must be a list of non-empty strings"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"temperature": "Infinity"}, "temperature must be a finite number"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"min_tokens": 9, "max_tokens": 4}, r"min_tokens \(9\) must be <= max_tokens \(4\)"),
    ({"n": 3, "best_of": 2}, r"best_of \(2\) must be >= n \(3\)"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
    ({"logit_bias": {"5": 101}}, r"logit_bias values must be numbers in \[-100, 100\]"),
    ({"logit_bias": {"five": 1}}, "logit_bias keys must be token ids, got 'five'"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"stop_regex": ["("]}, "stop_regex '\\(' is not a valid regular expression"),
    ({"stop_regex": ["a*"]}, "matches the empty string"),
    ({"bogus": 1}, r"unknown sampling parameter\(s\): bogus"),
])
def test_a_bad_value_is_refused_naming_the_key_and_why(data, message):
    with pytest.raises(ValueError, match=message):
        from_request(data)


def test_fields_only_the_server_sets_cannot_be_reached_by_clients():
    for key in ("prompt_logprobs_start", "cumulative_logprob", "max_new_tokens"):
        assert key not in REQUEST_KEYS
        with pytest.raises(ValueError, match="unknown sampling parameter"):
            from_request({key: 1})


def test_lora_is_refused_as_the_vllm_backend_refuses_it_when_lora_is_off():
    with pytest.raises(ValueError, match="LoRA feature is not enabled"):
        from_request({"lora_name": "sql-lora"})
    assert from_request({"lora_name": None}).n == 1


@pytest.mark.parametrize("key", ["structured_outputs", "guided_decoding"])
def test_vllm_structured_output_keys_map_onto_the_engines_constraints(key):
    def constraint(spec, as_json):
        return from_request({key: json.dumps(spec) if as_json else spec}).constraint

    for as_json in (False, True):
        assert constraint({"choice": ["Positive", "Negative"]}, as_json) == \
            ("choices", '["Positive", "Negative"]')
        assert constraint({"regex": "[0-9]+"}, as_json) == ("regex", "[0-9]+")
        assert constraint({"json": {"type": "integer"}}, as_json) == \
            ("json_schema", '{"type": "integer"}')
        assert constraint({"grammar": 'root ::= "a"'}, as_json) == ("ebnf", 'root ::= "a"')
        assert constraint({"json_object": True, "backend": "xgrammar"}, as_json) == \
            ("json_schema", JSON_OBJECT_SCHEMA)


def test_structured_outputs_refuse_what_they_cannot_honour():
    with pytest.raises(ValueError, match="structured_outputs must hold one constraint"):
        from_request({"structured_outputs": {"regex": "a", "choice": ["a"]}})
    with pytest.raises(ValueError, match="structured_outputs.backend must be one of"):
        from_request({"structured_outputs": {"regex": "a", "backend": "outlines"}})
    with pytest.raises(ValueError, match="structured_outputs.whitespace_pattern is not"):
        from_request({"structured_outputs": {"json": {}, "whitespace_pattern": " "}})
    with pytest.raises(ValueError, match="both set a constraint"):
        from_request({"guided_decoding": {"regex": "a"}, "regex": "b"})


def test_json_object_means_an_object():
    assert from_request({"response_format": {"type": "json_object"}}).constraint == \
        ("json_schema", JSON_OBJECT_SCHEMA)
    assert json.loads(JSON_OBJECT_SCHEMA) == {"type": "object"}


def test_openai_chat_logprobs_flag_and_string_keyed_logit_bias():
    assert from_request({"logprobs": True}).logprobs == 1
    assert from_request({"logprobs": False}).logprobs is None
    assert from_request({"logit_bias": '{"5": -100, "7": 3}'}).logit_bias == {5: -100, 7: 3}


def test_internal_fields_cross_a_process_boundary_by_name():
    params = SamplingParams(max_new_tokens=5, prompt_logprobs_start=3, cumulative_logprob=True,
                            logit_bias={4: 1.0})
    again = SamplingParams.from_dict(json.loads(json.dumps(params.to_dict())))
    assert again == params


@pytest.mark.parametrize("data, message", [
    ({"max_tokens": 101}, "max_tokens is 101; this server allows at most 100 "
                          r"\(model config max_tokens_limit\)"),
    ({"n": 5}, r"n is 5; this server allows at most 4 \(model config max_n\)"),
    ({"best_of": 5}, r"best_of is 5.*max_n"),
    ({"stop": ["a"] * 4}, r"the number of stop entries is 4.*max_stop_strings"),
    ({"stop_regex": ["x" * 11]}, r"the length of a stop_regex entry is 11.*"
                                 "max_stop_string_chars"),
    ({"bad_words": ["a", "b", "c", "d"]}, "the number of bad_words entries is 4"),
])
def test_limits_refuse_what_exceeds_them_naming_the_config_key(data, message):
    limits = RequestLimits(max_tokens=100, max_n=4, max_stop_strings=3,
                           max_stop_string_chars=10)
    with pytest.raises(ValueError, match=message):
        limits.check(from_request(data))


def test_limits_bound_choices_prompt_length_and_prompt_logprob_positions():
    limits = RequestLimits(max_choices=2, max_prompt_tokens=50, max_prompt_logprobs_tokens=10)
    with pytest.raises(ValueError, match="the number of choices is 3.*max_choices"):
        limits.check_choices(["a", "b", "c"])
    with pytest.raises(ValueError, match="prompt's length in tokens is 51.*max_prompt_tokens"):
        limits.check_prompt(51)
    asks = from_request({"prompt_logprobs": 0})
    with pytest.raises(ValueError, match="prompt_logprobs asks for 40 prompt positions"):
        limits.check_prompt(40, asks)
    limits.check_prompt(40, from_request({"prompt_logprobs": 0, "logprob_start_len": 30}))
