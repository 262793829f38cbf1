"""Structured decoding through the engine, on a small random-weight model with the real
Qwen2 tokenizer (``model_factory.random_qwen2_dir``: the grammar works on the tokenizer,
and 4 layers keep the many steps cheap), float32 on CPU.

Every constrained output must parse and conform: JSON schemas (checked with ``jsonschema``),
regexes (``re.fullmatch``), choices (exactly one), an EBNF grammar (our own
recursive-descent parser) and ``response_format``. Jump-forward is checked against the
same engine with it off, against an independent reference decoder (transformers' forward
pass + the grammar matcher), for step savings, and for ``max_new_tokens`` / stop strings
over jumped text. Mixed batches must equal running each request alone; bad constraints
fail only their own request; compilation is cached.

Cost: the expensive part of a step is the 151936-wide LM head per sampled token, so the
cases share a few batches (module-scoped) instead of running one by one.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from backend.core import Engine, EngineConfig, SamplingParams
from model_factory import random_qwen2_dir

# ----------------------------------------------------------------------------- cases
# Bounded so that a random-weight model terminates: every string has maxLength, a pattern
# or an enum, every array maxItems, every number a range.
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "address": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Hanoi", "Bangkok"]},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "age", "address"], "additionalProperties": False},
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                     "minItems": 1, "maxItems": 3},
            "grid": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": {"type": "array", "minItems": 2, "maxItems": 2,
                               "items": {"type": "integer", "minimum": -5, "maximum": 5}}},
        },
        "required": ["tags", "grid"], "additionalProperties": False},
    "numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "temp": {"type": "number", "minimum": -50.5, "maximum": 50.5},
            "count": {"type": "integer", "minimum": 100, "maximum": 200},
        },
        "required": ["ratio", "temp", "count"], "additionalProperties": False},
    "strings": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,3}$"},
            "word": {"type": "string", "minLength": 2, "maxLength": 5},
            "flag": {"type": "boolean"},
        },
        "required": ["code", "word", "flag"], "additionalProperties": False},
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "note": {"type": "string", "maxLength": 6},
            "level": {"enum": ["low", "mid", "high"]},
            "done": {"type": "boolean"},
        },
        "required": ["id"], "additionalProperties": False},
    "items": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object",
                  "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["sku", "qty"], "additionalProperties": False}},
}
SCHEMA_PROMPTS = {
    "nested": "Describe a person as JSON:",
    "arrays": "Tags and a grid, in JSON:",
    "numbers": "Some measurements:",
    "strings": "A product code:",
    "optional": "A task record:",
    "items": "The order lines:",
}
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

REGEXES = {
    "date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)",
    "pets": r"(cat|dog|bird)s? [1-9][0-9]?",
}
CHOICES = ["yes", "no", "maybe", "yesterday", 'say "hi"', "naïve café"]
# S-expressions nested at most two deep: recursive rules, bounded output.
EBNF = r'''root ::= "(" op " " arg " " arg ")"
arg ::= num | "(" op " " arg2 " " arg2 ")"
arg2 ::= num | "x"
op ::= "add" | "mul" | "sub"
num ::= [0-9] | [1-9] [0-9]'''

TEMPERATURES = [(0.0, None), (1.0, 11)]  # (temperature, seed)


def _temp_id(temp, seed):
    return "greedy" if temp == 0 else f"t{temp:g}-seed{seed}"


# ----------------------------------------------------------------------------- engines
def _engine(**overrides) -> Engine:
    settings = dict(model_path=str(random_qwen2_dir()), device="cpu", dtype="float32",
                    max_total_tokens=8192, max_running_requests=64, max_prefill_tokens=4096)
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return _engine(enable_jump_forward=True)


@pytest.fixture(scope="module")
def engine_no_jf() -> Engine:
    return _engine(enable_jump_forward=False)


def _compilations(engine: Engine) -> int:
    backend = engine.grammar.backend
    return backend.num_compilations if backend is not None else 0


def _finish_checks(engine: Engine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def _generate(engine: Engine, requests: list[tuple]) -> tuple[list, int]:
    """engine.generate over (prompt, params) pairs; also returns how many steps it took."""
    steps = 0
    real_step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return real_step()

    engine.step = counted_step  # instance attribute: generate() calls self.step()
    try:
        outs = engine.generate([p for p, _ in requests], [sp for _, sp in requests])
    finally:
        del engine.step
    _finish_checks(engine)
    return outs, steps


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


# ----------------------------------------------------------------------------- checkers
def parse_sexpr(text: str) -> None:
    """Recursive-descent parser for the EBNF above; raises ValueError where it fails."""
    pos = 0

    def expect(s):
        nonlocal pos
        if not text.startswith(s, pos):
            raise ValueError(f"expected {s!r} at {pos} in {text!r}")
        pos += len(s)

    def num():
        nonlocal pos
        m = re.compile(r"[1-9][0-9]|[0-9]").match(text, pos)
        if not m:
            raise ValueError(f"expected a number at {pos} in {text!r}")
        pos = m.end()

    def op():
        for name in ("add", "mul", "sub"):
            if text.startswith(name, pos):
                return expect(name)
        raise ValueError(f"expected an operator at {pos} in {text!r}")

    def arg(depth):
        if text.startswith("(", pos) and depth == 1:
            expect("(")
            op()
            expect(" ")
            arg(2)
            expect(" ")
            arg(2)
            expect(")")
        elif depth == 2 and text.startswith("x", pos):
            expect("x")
        else:
            num()

    expect("(")
    op()
    expect(" ")
    arg(1)
    expect(" ")
    arg(1)
    expect(")")
    if pos != len(text):
        raise ValueError(f"trailing text {text[pos:]!r}")


_LITERALS = ("true", "false", "null")


def is_json_prefix(text: str) -> bool:
    """Whether ``text`` is a prefix of some JSON document: json.loads accepts it once the
    open token is finished (a filler) and the open string and containers are closed."""
    stack, in_string, escape = [], False, False
    for ch in text:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}":
            if not stack or stack.pop() != ch:
                return False
    closers = "".join(reversed(stack))
    if in_string:
        unicode_escape = re.search(r"\\u[0-9a-fA-F]{0,3}$", text)
        end = "n" if escape else "0" * (6 - len(unicode_escape.group())) if unicode_escape else ""
        fillers = [end + '"', end + '": 0']  # a value, or a key waiting for its value
    else:
        fillers = ["", "0", ": 0", '"": 0']  # complete; number/value; after a key; after ","
        head = text.rstrip()
        fillers += [lit[k:] for lit in _LITERALS for k in range(1, len(lit)) if head.endswith(lit[:k])]
    for filler in fillers:
        try:
            json.loads(text + filler + closers)
            return True
        except json.JSONDecodeError:
            continue
    return False


def test_json_prefix_checker_itself():
    good = ['{', '{"a', '{"a": [1, 2', '[1.', '{"a": tr', '[-', '{"k": "x\\', '["a", {"b"',
            '{"a": 1,', '[[], {}', '{"a": "b"}', '["\\u00', ' [1e', '{"a": nul', '\t{\n "a']
    bad = ['}', 'hello', '{"a": 1]', '[1 2', '{1: 2', '"x" "y"', '{"a": 1}}']
    assert [t for t in good if not is_json_prefix(t)] == []
    assert [t for t in bad if is_json_prefix(t)] == []


def test_sexpr_parser_itself():
    parse_sexpr("(add 4 (mul 7 x))")
    parse_sexpr("(sub 10 99)")
    for bad in ("(add 4 x)", "(add 4 (mul (add 1 2) 3))", "(div 1 2)", "(add 1 2) ", "(add 01 2)"):
        with pytest.raises(ValueError):
            parse_sexpr(bad)


# ----------------------------------------------------------------------------- the big batch
def _big_batch_requests() -> dict[str, tuple]:
    reqs: dict[str, tuple] = {}
    for name, schema in SCHEMAS.items():
        for temp, seed in TEMPERATURES:
            reqs[f"schema-{name}-{_temp_id(temp, seed)}"] = (SCHEMA_PROMPTS[name], SamplingParams(
                json_schema=schema, temperature=temp, seed=seed, max_new_tokens=120))
    for name, pattern in REGEXES.items():
        for temp, seed in TEMPERATURES:
            reqs[f"regex-{name}-{_temp_id(temp, seed)}"] = ("Text:", SamplingParams(
                regex=pattern, temperature=temp, seed=seed, max_new_tokens=40))
    for temp, seed in TEMPERATURES + [(1.0, 5), (1.5, 6)]:
        reqs[f"choices-{_temp_id(temp, seed)}"] = ("Answer:", SamplingParams(
            choices=CHOICES, temperature=temp, seed=seed, max_new_tokens=40))
        reqs[f"ebnf-{_temp_id(temp, seed)}"] = ("Expression:", SamplingParams(
            ebnf=EBNF, temperature=temp, seed=seed, max_new_tokens=60))
    # json_object: any JSON, which a random model never closes (strings go on): bounded by
    # max_new_tokens, so the output is a JSON prefix; the schema form must close.
    for temp, seed in TEMPERATURES:
        reqs[f"json_object-{_temp_id(temp, seed)}"] = ("Return JSON:", SamplingParams(
            response_format={"type": "json_object"}, temperature=temp, seed=seed,
            max_new_tokens=16))
    reqs["response_format-json_schema"] = (SCHEMA_PROMPTS["nested"], SamplingParams(
        response_format={"type": "json_schema",
                         "json_schema": {"name": "nested", "schema": SCHEMAS["nested"]}},
        temperature=0.0, max_new_tokens=120))
    # unconstrained requests in the same batch
    reqs["plain-greedy"] = ("The capital of France is", SamplingParams(
        temperature=0.0, max_new_tokens=12, ignore_eos=True))
    reqs["plain-seeded"] = ("Once upon a time", SamplingParams(
        temperature=1.0, seed=3, max_new_tokens=12, ignore_eos=True))
    return reqs


def _distinct_constraints(requests) -> int:
    return len({sp.constraint for _, sp in requests if sp.constraint is not None})


@pytest.fixture(scope="module")
def big_batch(engine):
    requests = _big_batch_requests()
    before = _compilations(engine)
    outs, steps = _generate(engine, list(requests.values()))
    return {"outputs": dict(zip(requests, outs)), "steps": steps,
            "compilations": _compilations(engine) - before,
            "distinct": _distinct_constraints(requests.values())}


def _ok(out) -> None:
    assert out.error is None, out.error
    assert out.finish_reason == "stop", (out.finish_reason, out.text)


@pytest.mark.parametrize("temp,seed", TEMPERATURES, ids=[_temp_id(*t) for t in TEMPERATURES])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(big_batch, engine, name, temp, seed):
    out = big_batch["outputs"][f"schema-{name}-{_temp_id(temp, seed)}"]
    _ok(out)
    # strict=False: xgrammar lets a maxLength string hold raw control characters
    jsonschema.validate(json.loads(out.text, strict=False), SCHEMAS[name])
    assert out.token_ids[-1] in engine.eos_token_ids  # ended by the grammar's stop token


@pytest.mark.parametrize("temp,seed", TEMPERATURES, ids=[_temp_id(*t) for t in TEMPERATURES])
@pytest.mark.parametrize("name", list(REGEXES))
def test_regex_outputs_fullmatch(big_batch, name, temp, seed):
    out = big_batch["outputs"][f"regex-{name}-{_temp_id(temp, seed)}"]
    _ok(out)
    assert re.fullmatch(REGEXES[name], out.text), out.text


@pytest.mark.parametrize("temp,seed", TEMPERATURES + [(1.0, 5), (1.5, 6)],
                         ids=[_temp_id(*t) for t in TEMPERATURES + [(1.0, 5), (1.5, 6)]])
def test_choices_output_is_exactly_one_choice(big_batch, temp, seed):
    out = big_batch["outputs"][f"choices-{_temp_id(temp, seed)}"]
    _ok(out)
    assert out.text in CHOICES, out.text


@pytest.mark.parametrize("temp,seed", TEMPERATURES + [(1.0, 5), (1.5, 6)],
                         ids=[_temp_id(*t) for t in TEMPERATURES + [(1.0, 5), (1.5, 6)]])
def test_ebnf_output_parses(big_batch, temp, seed):
    out = big_batch["outputs"][f"ebnf-{_temp_id(temp, seed)}"]
    _ok(out)
    parse_sexpr(out.text)


@pytest.mark.parametrize("temp,seed", TEMPERATURES, ids=[_temp_id(*t) for t in TEMPERATURES])
def test_response_format_json_object_is_json(big_batch, temp, seed):
    out = big_batch["outputs"][f"json_object-{_temp_id(temp, seed)}"]
    assert out.error is None, out.error
    assert out.text.lstrip()[:1] in ("{", "["), out.text
    if out.finish_reason == "stop":
        json.loads(out.text)
    else:  # a random model never closes its strings: cut at max_new_tokens
        assert out.finish_reason == "length" and len(out.token_ids) == 16
        assert is_json_prefix(out.text), out.text


def test_response_format_json_schema_validates(big_batch):
    out = big_batch["outputs"]["response_format-json_schema"]
    _ok(out)
    jsonschema.validate(json.loads(out.text, strict=False), SCHEMAS["nested"])
    # the same constraint as json_schema=...: same greedy output
    assert out.token_ids == big_batch["outputs"]["schema-nested-greedy"].token_ids


def test_temperature_one_really_samples(big_batch):
    """Seeded sampling explores: most sampled outputs differ from the greedy ones."""
    outs = big_batch["outputs"]
    differ = [(name, seed) for name in SCHEMAS for temp, seed in TEMPERATURES if temp > 0
              if outs[f"schema-{name}-t1-seed{seed}"].text != outs[f"schema-{name}-greedy"].text]
    assert len(differ) > len(SCHEMAS) // 2, differ


def test_each_distinct_constraint_compiles_once(big_batch):
    assert big_batch["compilations"] == big_batch["distinct"]


# ----------------------------------------------------------------------------- jump-forward
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


# ----------------------------------------------------------------------------- mixed batches
ALONE = ["schema-nested-greedy", "schema-items-greedy", "regex-date-greedy", "ebnf-greedy",
         "plain-greedy"]


def test_mixed_batch_equals_each_alone(engine, big_batch):
    """The big batch mixes constrained and unconstrained requests (greedy and sampled):
    its greedy members, constrained or not, equal the same request run alone."""
    requests = _big_batch_requests()
    for name in ALONE:
        out = big_batch["outputs"][name]
        alone = _generate(engine, [requests[name]])[0][0]
        assert (out.token_ids, out.text) == (alone.token_ids, alone.text), name
    plain = big_batch["outputs"]["plain-greedy"]
    assert plain.finish_reason == "length" and len(plain.token_ids) == 12
    seeded = big_batch["outputs"]["plain-seeded"]
    assert seeded.finish_reason == "length" and len(seeded.token_ids) == 12


# ----------------------------------------------------------------------------- errors
BAD = {
    "regex": dict(regex="a(b"),
    "json_schema-not-json": dict(json_schema="{nope"),
    "json_schema-bad-type": dict(json_schema={"type": "foo"}),
    "ebnf": dict(ebnf="root ::= missing"),
}


def test_invalid_constraints_fail_only_their_request(engine):
    good = {
        "schema": engine.add_request("A product code:", SamplingParams(
            json_schema=SCHEMAS["strings"], temperature=0.0, max_new_tokens=60)),
        "plain": engine.add_request("hello", SamplingParams(temperature=0.0, max_new_tokens=6,
                                                            ignore_eos=True)),
    }
    errors: dict[str, str] = {}
    bad_ids: dict[str, str] = {}
    for name, kwargs in BAD.items():
        try:
            bad_ids[engine.add_request("x", SamplingParams(max_new_tokens=8, **kwargs))] = name
        except ValueError as exc:  # allowed: rejected at submission
            errors[name] = str(exc)
    finished: dict[str, object] = {}
    texts = {rid: "" for rid in good.values()}
    for _ in range(400):
        for o in engine.step():
            if o.request_id in texts:
                texts[o.request_id] += o.new_text
            if o.finished:
                finished[o.request_id] = o
        if len(finished) == len(good) + len(bad_ids):
            break
    _finish_checks(engine)
    for rid, name in bad_ids.items():
        o = finished[rid]
        assert o.finish_reason == "abort" and o.error, (name, o)
        assert o.new_token_ids == [] and o.num_output_tokens == 0
        errors[name] = o.error
    for name, message in errors.items():
        kind = name.split("-")[0]
        assert message.startswith(f"invalid {kind} constraint: "), message
        assert "/project/" not in message and len(message) < 400, message  # no C++ log noise
    assert "not valid JSON" in errors["json_schema-not-json"]
    assert "foo" in errors["json_schema-bad-type"]
    schema_out = finished[good["schema"]]
    assert schema_out.finish_reason == "stop" and schema_out.error is None
    jsonschema.validate(json.loads(texts[good["schema"]], strict=False), SCHEMAS["strings"])
    plain_out = finished[good["plain"]]
    assert plain_out.finish_reason == "length" and plain_out.num_output_tokens == 6


def test_known_bad_constraint_is_rejected_at_submission(engine):
    """After a failure the cached error answers at once, for that request only."""
    with pytest.raises(ValueError, match=r"invalid regex constraint"):
        for _ in range(2):  # the first may fail asynchronously; by the second it is known
            rid = engine.add_request("x", SamplingParams(regex="a(b", max_new_tokens=4))
            for _ in range(200):
                done = [o for o in engine.step() if o.request_id == rid and o.finished]
                if done:
                    assert done[0].finish_reason == "abort" and "invalid regex" in done[0].error
                    break
            else:
                pytest.fail("the request with a bad regex never finished")
    out = engine.generate("ok", SamplingParams(regex="[a-c]{2}", temperature=0.0, max_new_tokens=8))[0]
    assert re.fullmatch("[a-c]{2}", out.text)


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="a", choices=["a"]), "at most one of"),
    (dict(response_format={"type": "xml"}), "response_format.type must be"),
    (dict(choices=[]), "choices must be a non-empty list"),
    (dict(choices=["a", ""]), "choices must be a non-empty list"),
])
def test_malformed_constraint_parameters_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_same_schema_twice_compiles_once(engine):
    schema = {"type": "object", "properties": {"unique_key_for_cache_test": {"enum": ["a", "b"]}},
              "required": ["unique_key_for_cache_test"], "additionalProperties": False}
    before = _compilations(engine)
    outs, _ = _generate(engine, [
        ("one", SamplingParams(json_schema=schema, temperature=0.0, max_new_tokens=30)),
        ("two", SamplingParams(json_schema=json.dumps(schema), temperature=1.0, seed=1,
                               max_new_tokens=30)),
    ])
    assert _compilations(engine) == before + 1
    outs += _generate(engine, [("three", SamplingParams(json_schema=schema, max_new_tokens=30))])[0]
    assert _compilations(engine) == before + 1
    for out in outs:
        _ok(out)
        assert json.loads(out.text)["unique_key_for_cache_test"] in ("a", "b")
