"""radixlm-openai against a real tritonserver, through the official openai client.

The default model has random weights: nothing here depends on what text it writes, only on
the shape of the answers, on constraints being kept, and on counts agreeing with the
engine's.
"""
from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import openai
import pytest
import radixlm
import requests

from conftest import server_stats
from openai_helpers import official_client, start_openai_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "llm"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


@pytest.fixture(scope="module")
def openai_server(triton_server, tmp_path_factory):
    server = start_openai_server(triton_server.grpc_url,
                                 tmp_path_factory.mktemp("openai") / "openai.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(openai_server):
    return official_client(openai_server)


@pytest.fixture(scope="module")
def engine(triton_server):
    with radixlm.TritonClient(triton_server.grpc_url) as direct:
        yield direct


def test_models_and_health(client, openai_server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(openai_server.url + "/health", timeout=10).json() == {"status": "ok"}
    # started without --tokenizer: no tokenizer routes, so clients use their own
    assert requests.post(openai_server.url + "/tokenize", json={"prompt": "a"},
                         timeout=10).status_code == 404


def test_completion_usage_equals_the_engines_counts(client, engine):
    prompt = "The capital of France is"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
    direct = engine.generate(prompt, max_tokens=7, temperature=0)
    assert answer.object == "text_completion" and len(answer.choices) == 1
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens == direct.num_input_tokens
    assert answer.usage.completion_tokens == direct.num_output_tokens
    assert answer.usage.total_tokens == direct.num_input_tokens + direct.num_output_tokens


def test_chat_prompt_is_the_models_template_and_usage_counts_it(client, engine):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a color."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            temperature=0)
    rendered = engine.chat_template().render_jinja(messages, add_generation_prompt=True)
    direct = engine.generate(rendered, max_tokens=6, temperature=0)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert answer.usage.prompt_tokens == direct.num_input_tokens
    assert answer.usage.completion_tokens == direct.num_output_tokens


def test_async_streaming_chat_ends_with_usage_and_counts_every_token(openai_server):
    async def run():
        client = openai.AsyncOpenAI(base_url=openai_server.url + "/v1", api_key="unused",
                                    max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=9,
            temperature=0, stream=True, stream_options={"include_usage": True},
            logprobs=True, extra_body={"ignore_eos": True})
        events = [event async for event in stream]
        await client.close()
        return events

    events = asyncio.run(run())
    choices = [e.choices[0] for e in events if e.choices]
    assert choices[0].delta.role == "assistant"
    assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
    streamed_tokens = [t for c in choices if c.logprobs for t in c.logprobs.content]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 9
    assert len(streamed_tokens) == 9
    assert "".join(c.delta.content or "" for c in choices)


def test_n_samples_and_top_logprobs(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=3,
        temperature=1.0, seed=7, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        tokens = choice.logprobs.content
        assert len(tokens) == 4
        for token in tokens:
            assert len(token.top_logprobs) == 3
            assert token.top_logprobs[0].logprob >= token.logprob - 1e-4
            assert bytes(token.bytes).decode("utf-8", errors="replace") == token.token
    assert answer.usage.completion_tokens == 12


def test_min_tokens_stop_token_ids_and_logit_bias_reach_the_engine(client, engine):
    first = engine.generate("Count:", max_tokens=1, temperature=0).output_ids[0]
    stopped = client.completions.create(model=MODEL, prompt="Count:", max_tokens=12,
                                        temperature=0, extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt="Count:", max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [first], "min_tokens": 6})
    assert held.usage.completion_tokens >= 6
    biased = client.completions.create(model=MODEL, prompt="Count:", max_tokens=4, temperature=0,
                                       logit_bias={"1000": 100}, logprobs=0,
                                       extra_body={"ignore_eos": True})
    tokens = biased.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1  # token 1000, four times
    assert biased.choices[0].text == tokens[0] * 4


def test_json_schema_output_parses_and_validates(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person, as JSON."}],
        max_tokens=80, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_call_arguments_validate_against_the_tools_schema(client, choice):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False,
        max_tokens=80, temperature=0.7, seed=2)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_streamed_tool_calls_assemble_into_arguments_that_validate(client, choice):
    events = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False, max_tokens=80,
        temperature=0.7, seed=3, stream=True)
    names, arguments, reasons = [], [], []
    for event in events:
        choice_ = event.choices[0]
        for call in choice_.delta.tool_calls or ():
            names += [call.function.name] if call.function.name else []
            arguments.append(call.function.arguments or "")
        reasons += [choice_.finish_reason] if choice_.finish_reason else []
    assert names == ["get_weather"] and reasons == ["tool_calls"]
    jsonschema.validate(json.loads("".join(arguments)), WEATHER["function"]["parameters"])


def test_repeated_long_system_prompt_is_served_from_the_radix_cache(client):
    system = "You are the support assistant of a bakery. " * 40
    counts = []
    for question in ("Opening hours?", "Do you sell rye bread?"):
        answer = client.chat.completions.create(
            model=MODEL, max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
        counts.append(answer.usage.prompt_tokens_details.cached_tokens)
    assert counts[1] > 300 and counts[1] > counts[0]


BAD_REQUESTS = [
    ("unknown model", dict(model="no-such-model"), openai.NotFoundError, 404, "model"),
    ("bad types", dict(max_tokens="many"), openai.BadRequestError, 400, "max_tokens"),
    ("bad range", dict(temperature=5), openai.BadRequestError, 400, "temperature"),
    ("bad schema", dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), openai.BadRequestError, 400, None),
    ("too-long prompt", dict(messages=[{"role": "user", "content": "word " * 20000}]),
     openai.BadRequestError, 400, None),
]


@pytest.mark.parametrize("name,change,error,status,param", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_malformed_requests_get_openai_errors_and_the_next_request_is_served(
        client, name, change, error, status, param):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    with pytest.raises(error) as raised:
        client.chat.completions.create(**{**request, **change})
    body = raised.value.body
    assert raised.value.status_code == status
    assert set(body) >= {"message", "type", "param", "code"} and body["message"]
    assert body["type"] == "invalid_request_error" and body["param"] == param
    good = client.chat.completions.create(**request)
    assert good.choices[0].finish_reason in ("stop", "length")


def _wait_idle(triton_server, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server_stats(triton_server)
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and stats["kv_tokens_in_use_by_requests"] == 0) or time.monotonic() > deadline:
            return stats


LONG = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me a long story."}]}


def test_a_streaming_client_that_disconnects_cancels_its_request(openai_server, triton_server):
    before = server_stats(triton_server)["generated_tokens"]
    with requests.post(openai_server.url + "/v1/chat/completions", json={**LONG, "stream": True},
                       stream=True, timeout=30) as response:
        lines = response.iter_lines(decode_unicode=True)
        assert next(line for line in lines if line.startswith("data:"))
        assert server_stats(triton_server)["num_running"] == 1
    stats = _wait_idle(triton_server)
    assert stats["num_running"] == 0 and stats["kv_tokens_in_use_by_requests"] == 0
    assert stats["generated_tokens"] - before < LONG["max_tokens"] // 2  # cut short


def test_a_waiting_client_that_disconnects_cancels_its_request(openai_server, triton_server):
    before = server_stats(triton_server)["generated_tokens"]
    with pytest.raises(requests.ReadTimeout):
        requests.post(openai_server.url + "/v1/chat/completions", json=LONG, timeout=1.5)
    stats = _wait_idle(triton_server)
    assert stats["num_running"] == 0 and stats["kv_tokens_in_use_by_requests"] == 0
    assert stats["generated_tokens"] - before < LONG["max_tokens"] // 2  # cut short
