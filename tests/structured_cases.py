"""The structured-decoding cases and the engine they run on, shared by
test_structured_outputs.py, test_structured_jump_forward.py and test_structured_compile.py.

The model is small and random-weight with the real Qwen2 tokenizer
(``model_factory.random_qwen2_dir``: the grammar works on the tokenizer, and 4 layers keep
the many steps cheap), float32 on CPU. The expensive part of a step is the 151936-wide LM
head per sampled token, so the cases run together in one big batch (``run_big_batch``;
conftest.py runs it once a session) instead of one by one.
"""
from __future__ import annotations

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


def run_big_batch(engine: Engine) -> dict:
    """Every case of ``_big_batch_requests`` in one engine.generate: the outputs by case
    name, the steps it took, and how many constraints it compiled (``distinct`` of them
    are different, so a fresh engine compiles that many)."""
    requests = _big_batch_requests()
    before = _compilations(engine)
    outs, steps = _generate(engine, list(requests.values()))
    return {"outputs": dict(zip(requests, outs)), "steps": steps,
            "compilations": _compilations(engine) - before,
            "distinct": _distinct_constraints(requests.values())}


def _ok(out) -> None:
    assert out.error is None, out.error
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
