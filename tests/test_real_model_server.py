"""The default model (SmolLM2-135M-Instruct) through a real tritonserver gives real answers:
the README's streamed example, a JSON-schema record whose fields make sense, a chat
through the ensemble's ``messages`` and through the client language's roles, each
answering in role and ending its turn with the model's end-of-turn token."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import requests

from conftest import generate_body, http_generate

try:
    import radixlm
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm

pytestmark = [pytest.mark.server, pytest.mark.slow]

RECORD = {"type": "object", "additionalProperties": False,
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "country": {"type": "string", "maxLength": 24},
                         "is_capital": {"type": "boolean"}},
          "required": ["city", "country", "is_capital"]}


def test_the_capital_of_france_streams_paris(triton_server):
    """What `make serve` shows: Triton's generate_stream endpoint, server-sent events."""
    body = {"text_input": "The capital of France is", "stream": True,
            "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0})}
    with requests.post(f"http://{triton_server.http_url}/v2/models/llm/generate_stream",
                       json=body, stream=True, timeout=120) as response:
        events = [json.loads(line[len(b"data:"):]) for line in response.iter_lines()
                  if line.startswith(b"data:")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events).startswith(" Paris")


def test_a_json_schema_request_gives_a_sensible_record(triton_server, reference_engine):
    chat = reference_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give the capital of France as JSON with the fields "
                                     "city, country and is_capital."}],
        tokenize=False, add_generation_prompt=True)
    got = http_generate(triton_server, generate_body(chat, {
        "max_tokens": 64, "temperature": 0, "json_schema": RECORD}))
    assert got.status_code == 200 and got["finish_reason"] == "stop", got
    record = json.loads(got["text_output"])
    assert record["city"] == "Paris" and record["country"].lower() == "france"
    assert record["is_capital"] is True


def test_chat_messages_through_the_ensemble_answer_in_role(triton_server):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    body = {"messages": json.dumps(messages), "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 32, "temperature": 0})}
    got = requests.post(f"http://{triton_server.http_url}/v2/models/ensemble/generate",
                        json=body, timeout=120).json()
    assert got["finish_reason"] == "stop"  # the model ended its turn (<|im_end|>)
    assert "Paris" in got["text_output"] and "<|im_" not in got["text_output"]


def test_the_client_languages_roles_answer_in_role(triton_server):
    backend = radixlm.Triton(triton_server.grpc_url, model="llm")
    try:
        template = backend.chat_template()
        assert template.suffix("assistant") == "<|im_end|>\n"  # from the model config

        @radixlm.function
        def ask(s, question):
            s += radixlm.system("You are a helpful geography assistant.")
            s += radixlm.user(question)
            s += radixlm.assistant(radixlm.gen("answer", max_tokens=32, temperature=0.0))

        state = ask.run(question="What is the capital of France?", backend=backend)
        assert "Paris" in state["answer"]
        assert state.messages()[-1] == {"role": "assistant", "content": state["answer"]}
        assert state.text().endswith(state["answer"] + "<|im_end|>\n")
    finally:
        backend.close()
