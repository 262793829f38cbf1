"""Jump-forward: the text a grammar forces is added in one extend step instead of one
token a step. Checked against the same engine with it off, against an independent
reference decoder (transformers' forward pass + the grammar matcher), for the step
contract of what it streams, for step savings, and for ``max_new_tokens`` / stop strings
over jumped text.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from backend.core import Engine, SamplingParams
from model_factory import random_qwen2_dir
from structured_cases import SCHEMA_PROMPTS, SCHEMAS, _engine, _finish_checks, _generate, _ok

# Long fixed keys: most of the output is forced text.
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 9},
        "preferred_notification_channel": {"enum": ["email", "sms"]},
        "subscription_is_currently_active": {"type": "boolean"},
    },
    "required": ["customer_account_identifier", "preferred_notification_channel",
                 "subscription_is_currently_active"],
    "additionalProperties": False}


# The jump-forward engine and the big batch it ran are shared by test_structured_outputs.py
# and test_structured_jump_forward.py: conftest.py makes them once a session, as the batch
# takes over a minute on CPU. These names are what the tests below ask for.
@pytest.fixture(scope="module")
def engine(structured_engine):
    return structured_engine


@pytest.fixture(scope="module")
def big_batch(structured_big_batch):
    return structured_big_batch


@pytest.fixture(scope="module")
def engine_no_jf() -> Engine:
    return _engine(enable_jump_forward=False)


def _stream(engine: Engine, prompt, params: SamplingParams) -> dict:
    """One request alone, step by step: its StepOutputs and the number of steps."""
    rid = engine.add_request(prompt, params)
    outs, steps = [], 0
    while not (outs and outs[-1].finished):
        steps += 1
        assert steps < 1000, "no progress"
        outs += [o for o in engine.step() if o.request_id == rid]
    _finish_checks(engine)
    return {"outputs": outs, "steps": steps, "text": "".join(o.new_text for o in outs),
            "num_tokens": outs[-1].num_output_tokens, "finish_reason": outs[-1].finish_reason}


@pytest.fixture(scope="module")
def no_jf_greedy(engine_no_jf):
    requests = {name: (SCHEMA_PROMPTS[name], SamplingParams(
        json_schema=schema, temperature=0.0, max_new_tokens=120)) for name, schema in SCHEMAS.items()}
    outs, _ = _generate(engine_no_jf, list(requests.values()))
    return dict(zip(requests, outs))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_jump_forward_off_outputs_validate(no_jf_greedy, name):
    out = no_jf_greedy[name]
    _ok(out)
    jsonschema.validate(json.loads(out.text, strict=False), SCHEMAS[name])


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_greedy_with_jump_forward_equals_without(big_batch, no_jf_greedy, engine, name):
    """Token ids and text: forced text becomes the same tokens either
    way; jump-forward only computes them in one extend step instead of one step each."""
    on, off = big_batch["outputs"][f"schema-{name}-greedy"], no_jf_greedy[name]
    if on.token_ids != off.token_ids:
        tok = engine.tokenizer
        i = next((k for k, (a, b) in enumerate(zip(on.token_ids, off.token_ids)) if a != b),
                 min(len(on.token_ids), len(off.token_ids)))
        pieces = lambda ids: [tok.decode([t]) for t in ids[max(i - 2, 0):i + 4]]  # noqa: E731
        pytest.fail(f"token {i} differs: with jump-forward {pieces(on.token_ids)} "
                    f"-> {on.text!r}; without {pieces(off.token_ids)} -> {off.text!r}")
    assert on.text == off.text


def _reference_greedy_jump(model, grammar, eos: set[int], prompt_ids, schema, max_new):
    """Greedy decoding with jump-forward, written independently of the engine's batching
    and KV cache: every step recomputes the whole sequence with transformers. Order: sample
    a token, accept it, then jump over the forced text, never past max_new_tokens. Only the
    token just sampled may be re-tokenized together with the forced text: everything before
    it has been streamed, and streamed ids are never taken back (see the stream contract
    test below). Returns (ids, jumps, dropped tokens)."""
    state = grammar.create_state(grammar.submit("json_schema", json.dumps(schema)).result())
    bitmask = grammar.allocate_bitmask(1)
    out: list[int] = []
    jumps = dropped = 0
    while len(out) < max_new:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + out]), logits_to_keep=1).logits[:, -1].float()
        state.fill_bitmask(bitmask, 0)
        grammar.apply_bitmask(logits, bitmask)
        token = int(logits.argmax())
        assert state.accept(token)
        out.append(token)
        if token in eos or state.is_terminated():
            break
        drop, new = grammar.jump_forward(state, out, lookback=1, max_added=max_new - len(out))
        out = out[:len(out) - drop] + new
        jumps, dropped = jumps + bool(new), dropped + drop
    return out, jumps, dropped


@pytest.fixture(scope="module")
def reference(engine, big_batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_qwen2_dir(), dtype=torch.float32).eval()
    return {name: _reference_greedy_jump(model, engine.grammar.get(), engine.eos_token_ids,
                                         engine.tokenizer.encode(SCHEMA_PROMPTS[name]), schema, 120)
            for name, schema in SCHEMAS.items()}


def test_reference_decoder_jumps_and_retokenizes(reference):
    """The cases below exercise what they claim: jumps, and jumps that replace tokens."""
    counts = {name: (jumps, dropped) for name, (_, jumps, dropped) in reference.items()}
    assert all(jumps >= 1 for jumps, _ in counts.values()), counts
    assert sum(dropped for _, dropped in counts.values()) >= 1, counts


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_jump_forward_matches_reference_decoder(big_batch, engine, reference, name):
    """The engine's jumped tokens get the KV a full recomputation gives them (and a
    replaced token's KV is gone): greedy output equals the reference's, token for token."""
    out = big_batch["outputs"][f"schema-{name}-greedy"]
    ref = reference[name][0]
    assert out.token_ids == ref, (engine.tokenizer.decode(out.token_ids), engine.tokenizer.decode(ref))


@pytest.fixture(scope="module")
def retokenized_stream(engine, big_batch, reference):
    """A greedy case whose jumps replace the sampled token, streamed alone."""
    name = next(name for name, (_, _, dropped) in reference.items() if dropped)
    stream = _stream(engine, SCHEMA_PROMPTS[name], SamplingParams(
        json_schema=SCHEMAS[name], temperature=0.0, max_new_tokens=120))
    return stream, big_batch["outputs"][f"schema-{name}-greedy"]


def test_jump_forward_stream_text_is_never_retracted(retokenized_stream):
    r, want = retokenized_stream
    assert r["text"] == want.text
    assert r["num_tokens"] == len(want.token_ids)
    assert r["finish_reason"] == "stop"


def test_jump_forward_stream_ids_follow_the_step_output_contract(engine, retokenized_stream):
    """StepOutput: new_token_ids are the step's new output ids (their concatenation is the
    output, as serving.py accumulates them), and context_token_ids + new_token_ids decode
    statelessly to new_text (the Triton postprocessing contract). So a jump may re-tokenize
    only ids not streamed yet."""
    from backend.core.detokenizer import decode_window

    r, want = retokenized_stream
    tok = engine.tokenizer
    stateless = []
    for o in r["outputs"]:
        context = list(o.context_token_ids)
        stateless.append(decode_window(tok, context + list(o.new_token_ids), 0, len(context),
                                       final=o.finished)[0])
    streamed_ids = [t for o in r["outputs"] for t in o.new_token_ids]
    assert "".join(stateless) == want.text, (
        f"stateless decoding of the stream gives {''.join(stateless)!r}, not {want.text!r}")
    assert streamed_ids == want.token_ids, (
        f"{len(streamed_ids)} streamed ids for {len(want.token_ids)} output tokens: "
        f"{tok.decode(streamed_ids)!r}")


def test_jump_forward_saves_steps_on_long_keys(engine, engine_no_jf):
    results = {}
    for jf, eng in (("on", engine), ("off", engine_no_jf)):
        # compile first, so that every counted step is a forward pass
        _generate(eng, [("warm up", SamplingParams(json_schema=LONG_KEYS, max_new_tokens=1))])
        results[jf] = _stream(eng, "Account settings:", SamplingParams(
            json_schema=LONG_KEYS, temperature=0.0, max_new_tokens=100))
    on, off = results["on"], results["off"]
    for r in (on, off):
        assert r["finish_reason"] == "stop"
        jsonschema.validate(json.loads(r["text"]), LONG_KEYS)
    # without jump-forward: one step per output token (the stop token included); the
    # forced tokens are streamed when the grammar forces them, then computed one a step
    assert off["steps"] == off["num_tokens"]
    assert on["text"] == off["text"]
    # with it: one step per sampled token, the forced text arriving with them
    assert on["steps"] == len(on["outputs"])
    assert on["num_tokens"] > on["steps"]
    # the keys alone are > 20 tokens; what the model chooses is ~ a handful
    assert on["steps"] * 3 <= off["steps"], (on["steps"], off["steps"])


def test_jumps_respect_max_new_tokens_and_stop_strings(engine):
    # The first token is sampled, then the grammar forces '"customer_account_identifier": '
    for limit in (2, 5):
        r = _stream(engine, "Account settings:", SamplingParams(
            json_schema=LONG_KEYS, temperature=0.0, max_new_tokens=limit))
        assert r["finish_reason"] == "length"
        assert r["num_tokens"] == limit  # a jump fills up to the limit, never past it
        assert '{"customer_account_identifier": '.startswith(r["text"]), r["text"]
    r = _stream(engine, "Account settings:", SamplingParams(
        json_schema=LONG_KEYS, temperature=0.0, max_new_tokens=100, stop=["notification"]))
    assert r["finish_reason"] == "stop"
    assert r["text"].endswith('"preferred_'), r["text"]
    assert "notification" not in r["text"]
    assert r["text"].startswith('{"customer_account_identifier": ')
