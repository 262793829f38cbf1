"""What evaluation harnesses ask of radixlm-openai: completions that echo and score their
prompt (a prompt of token ids, ``echo``, ``logprobs``, one or no new token) and the
tokenizer routes; also streamed samples that end once each. Against a real tritonserver
serving the default model, radixlm-openai started with ``--tokenizer`` (its folder)."""
from __future__ import annotations

import math

import openai
import pytest
import requests
from tokenizers import Tokenizer

from conftest import DEFAULT_MODEL, ensure_default_model
from openai_helpers import official_client, start_openai_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "llm"
CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " Paris"


@pytest.fixture(scope="module")
def server(triton_server, tmp_path_factory):
    ensure_default_model()
    server = start_openai_server(triton_server.grpc_url,
                                 tmp_path_factory.mktemp("openai-scoring") / "openai.log",
                                 "--tokenizer", str(DEFAULT_MODEL))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return official_client(server)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(ensure_default_model() / "tokenizer.json"))


def test_echo_with_logprobs_scores_each_prompt_token_from_the_second_on(client, tokenizer):
    context = tokenizer.encode(CONTEXT, add_special_tokens=False).ids
    whole = tokenizer.encode(CONTEXT + CONTINUATION, add_special_tokens=False).ids
    assert whole[:len(context)] == context  # the continuation starts a token
    answer = client.completions.create(model=MODEL, prompt=[whole, context], echo=True,
                                       logprobs=1, max_tokens=1, temperature=0, seed=1234)
    full, short = sorted(answer.choices, key=lambda c: c.index)
    lp = full.logprobs
    assert len(lp.tokens) == len(whole) + 1 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert full.text.startswith(CONTEXT + CONTINUATION) and "".join(lp.tokens) == full.text
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value <= 0 and len(top) == 1 and value <= max(top.values()) + 1e-5
    # The first continuation position, scored in the prompt, is the position the short
    # prompt's greedy token was decoded at: the same best logprob (one position off, and
    # it would be another distribution's).
    (best_lp,) = full.logprobs.top_logprobs[len(context)].values()
    (greedy_lp,) = short.logprobs.top_logprobs[-1].values()
    assert math.isclose(best_lp, greedy_lp, abs_tol=2e-3)
    assert math.isclose(short.logprobs.token_logprobs[-1], greedy_lp, abs_tol=1e-6)
    assert answer.usage.prompt_tokens == len(whole) + len(context)
    assert answer.usage.completion_tokens == 2


def test_max_tokens_zero_answers_with_the_prompt_alone(client):
    answer = client.completions.create(model=MODEL, prompt=CONTEXT, echo=True, logprobs=0,
                                       max_tokens=0)
    choice = answer.choices[0]
    assert choice.text == CONTEXT and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == CONTEXT
    assert answer.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == answer.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=0)


def test_a_streamed_echo_leads_each_sample_and_each_sample_ends_once(client, tokenizer):
    ids = tokenizer.encode(CONTEXT, add_special_tokens=False).ids
    events = list(client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=3, n=2, temperature=1.0,
        seed=5, stream=True, extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [e.choices[0] for e in events if e.choices and e.choices[0].index == index]
        assert mine[0].text == CONTEXT and mine[0].logprobs.token_logprobs[0] is None
        assert len(mine[0].logprobs.tokens) == len(ids)
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        generated = [t for c in mine[1:] for t in c.logprobs.tokens]
        assert len(generated) == 3 and "".join(c.text for c in mine[1:]) == "".join(generated)


def test_streamed_chat_samples_end_once_each(client):
    events = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=3,
        temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True}))
    reasons = sorted((e.choices[0].index, e.choices[0].finish_reason)
                     for e in events if e.choices and e.choices[0].finish_reason)
    assert reasons == [(0, "length"), (1, "length"), (2, "length")]


def post(server, route: str, body: dict) -> requests.Response:
    return requests.post(server.url + route, json=body, timeout=30)


def test_tokenize_counts_a_prompt_and_a_chat_as_the_engine_does(server, client, tokenizer):
    counted = post(server, "/tokenize", {"model": MODEL, "prompt": CONTEXT}).json()
    answer = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=1)
    assert counted["tokens"] == tokenizer.encode(CONTEXT, add_special_tokens=True).ids
    assert counted["count"] == len(counted["tokens"]) == answer.usage.prompt_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens
    assert post(server, "/detokenize", {"tokens": counted["tokens"]}).json() == {"prompt": CONTEXT}


def test_tokenizer_info_names_the_eos_token_a_harness_encodes_to_one_id(server):
    info = requests.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] and "{%" in info["chat_template"]
    eos = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert len(eos.json()["tokens"]) == 1


@pytest.mark.parametrize("route, body, status, message", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400,
     "either 'prompt' or 'messages'"),
    ("/tokenize", {}, 400, "either 'prompt' or 'messages'"),
    ("/detokenize", {"tokens": [10**9]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "does not exist"),
])
def test_bad_tokenizer_requests_get_openai_errors(server, route, body, status, message):
    response = post(server, route, body)
    assert response.status_code == status and message in response.json()["error"]["message"]
