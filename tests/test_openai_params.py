"""The OpenAI layer's translations, without a server: requests -> engine parameters and
prompts, tool choices -> constraints, answers -> tool calls, logprobs and usage."""
from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from radixlm.chat_template import ChatTemplate
from radixlm.openai import params, tools
from radixlm.openai.engine import ModelInfo
from radixlm.openai.errors import OpenAIError, _field_path
from radixlm.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixlm.openai.responses import (PromptUsage, Sample, chat_logprobs, completion_logprobs,
                                    usage)
from radixlm.results import Chunk

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}}}
CHATML = ModelInfo(ChatTemplate.chatml(), "<|im_end|>", True)


def chat(messages=None, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="llm", messages=messages or [{"role": "user", "content": "Hi"}],
                                 **fields)


def test_sampling_knobs_map_to_the_engines_wire_keys():
    request = chat(max_completion_tokens=9, max_tokens=50, temperature=1, top_p=0.5, seed=3,
                   stop="END", n=2, presence_penalty=0.5, top_k=4, ignore_eos=True)
    wire = params.chat_params(request, tools.plan(request), default_max_tokens=None)
    assert wire == {"max_tokens": 9, "temperature": 1.0, "top_p": 0.5, "seed": 3, "stop": ["END"],
                    "n": 2, "presence_penalty": 0.5, "top_k": 4, "ignore_eos": True}
    assert params.completion_params(CompletionRequest(model="llm", prompt="x"), 77)["max_tokens"] == 77


@pytest.mark.parametrize("want,top,engine", [(False, None, None), (True, None, 0), (True, 0, 0),
                                             (True, 1, 1), (True, 5, 5)])
def test_logprobs_ask_the_engine_for_the_chosen_token_and_the_top_alternatives(want, top, engine):
    assert params.engine_logprobs(want, top) == engine


def test_an_echo_with_logprobs_asks_for_the_prompts_too_and_max_tokens_zero_for_one_token():
    def completion(**fields):
        return params.completion_params(CompletionRequest(model="llm", prompt=[1, 2], **fields),
                                        None)
    assert "prompt_logprobs" not in completion(logprobs=2)
    assert "prompt_logprobs" not in completion(echo=True)
    wire = completion(echo=True, logprobs=2, max_tokens=0)
    assert (wire["prompt_logprobs"], wire["logprobs"], wire["max_tokens"]) == (2, 2, 1)
    with pytest.raises(OpenAIError, match="max_tokens 0 needs echo"):
        completion(max_tokens=0)


def test_vllm_extensions_and_logit_bias_pass_to_the_engines_keys():
    request = chat(min_tokens=4, logit_bias={"17": -100, "5": 2.5}, stop_token_ids=[3],
                   include_stop_str_in_output=True, allowed_token_ids=[1, 2, 3],
                   bad_words=["no"], truncate_prompt_tokens=10, logprobs=True)
    wire = params.chat_params(request, tools.plan(request), default_max_tokens=None)
    assert wire == {"min_tokens": 4, "logit_bias": {"17": -100, "5": 2.5}, "stop_token_ids": [3],
                    "include_stop_str_in_output": True, "allowed_token_ids": [1, 2, 3],
                    "bad_words": ["no"], "truncate_prompt_tokens": 10, "n": 1, "logprobs": 0}
    completion = CompletionRequest(model="llm", prompt="x", best_of=3, n=2, logprobs=2)
    sent = params.completion_params(completion, None)
    assert (sent["best_of"], sent["n"], sent["logprobs"]) == (3, 2, 2)
    with pytest.raises(ValidationError):
        chat(logit_bias={"17": 101})


@pytest.mark.parametrize("fields,param", [
    ({"temperature": 3}, "temperature"), ({"n": 0}, "n"), ({"max_tokens": "5"}, "max_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"stop": [1]}, "stop"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role")])
def test_bad_types_and_ranges_are_refused_naming_the_field(fields, param):
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest(**{"model": "llm", "messages": [{"role": "user", "content": "x"}],
                                 **fields})
    assert _field_path(raised.value.errors()[0]["loc"]) == param


def test_response_format_becomes_the_engines_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    wire = params.chat_params(request, tools.plan(request), None)
    assert wire["response_format"] == {"type": "json_schema", "json_schema": {"schema": schema}}
    request = chat(response_format={"type": "json_object"})
    assert params.chat_params(request, tools.plan(request), None)["response_format"] == {"type": "json_object"}


def test_a_named_tool_choice_constrains_the_output_to_its_parameters():
    request = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    plan = tools.plan(request)
    assert json.loads(params.chat_params(request, plan, None)["json_schema"]) == TIME["function"]["parameters"]
    content, calls = tools.read_calls(plan, '{"zone": "UTC"}')
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def test_required_tool_choice_accepts_exactly_a_call_of_one_of_the_tools():
    plan = tools.plan(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, plan.schema)
    for bad in ({"name": "get_weather", "arguments": {"zone": "UTC"}}, {"name": "other", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, plan.schema)
    parallel = tools.plan(chat(tools=[WEATHER, TIME], tool_choice="required"))
    answer = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    jsonschema.validate(json.loads(answer), parallel.schema)
    _, calls = tools.read_calls(parallel, answer)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome"}


def test_auto_reads_hermes_tool_calls_and_leaves_plain_text_alone():
    plan = tools.plan(chat(tools=[WEATHER]))
    assert plan.mode == "auto" and plan.schema is None
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tools.read_calls(plan, text)
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_weather"
    assert tools.read_calls(plan, "It is sunny.") == ("It is sunny.", [])


def test_tool_choice_must_name_a_given_tool():
    with pytest.raises(OpenAIError) as raised:
        tools.plan(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert raised.value.status == 400 and raised.value.param == "tool_choice"


def test_templates_without_tool_support_get_tools_and_calls_written_into_the_text():
    request = chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    prompt = params.chat_prompt(request, CHATML)
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather"' in prompt and "<|im_start|>tool\nsunny<|im_end|>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_usage_counts_the_prompt_once_and_every_samples_tokens():
    prompt = PromptUsage()
    samples = [Sample(), Sample()]
    for index, cached, out in ((0, 0, 3), (1, 40, 5)):
        chunk = Chunk(text="x", index=index, num_input_tokens=41, num_output_tokens=out,
                      num_cached_tokens=cached, finish_reason="length")
        prompt.add(chunk)
        samples[index].add(chunk)
    assert usage([prompt], samples) == {"prompt_tokens": 41, "completion_tokens": 8, "total_tokens": 49,
                                        "prompt_tokens_details": {"cached_tokens": 0}}


def test_usage_sums_the_counts_of_a_samples_streamed_responses():
    sample = Sample()
    for text, count in (("a", 1), ("", 1), ("bc", 2)):  # the second: a token without text
        sample.add(Chunk(text=text, num_output_tokens=count))
    assert sample.num_output_tokens == 4 and "".join(sample.text) == "abc"


def _position(*alternatives):
    return {str(t): {"logprob": lp, "rank": r, "decoded_token": text}
            for t, lp, r, text in alternatives}


def test_chat_logprobs_list_the_best_alternatives_first():
    # the chosen token (7) first, then the engine's best two, as the engine sends them
    items = [_position((7, -1.5, 2, "a"), (9, -0.5, 1, "b"), (3, -2.0, 3, "é"))]
    out = chat_logprobs(items, [7], top=2)
    (entry,) = out["content"]
    assert (entry["token"], entry["logprob"], entry["bytes"]) == ("a", -1.5, [97])
    assert [t["token"] for t in entry["top_logprobs"]] == ["b", "a"]


def test_completion_logprobs_keep_the_best_k_when_the_chosen_token_is_not_among_them():
    items = [_position((5, -3.0, 4, "x"), (9, -0.5, 1, "b"), (2, -1.0, 2, "cd")),
             _position((2, -0.2, 1, "cd"))]
    out = completion_logprobs(items, [5, 2], top=2, offset=3)
    assert out == {"tokens": ["x", "cd"], "token_logprobs": [-3.0, -0.2],
                   "top_logprobs": [{"b": -0.5, "cd": -1.0}, {"cd": -0.2}],
                   "text_offset": [3, 4]}
