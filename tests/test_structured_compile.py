"""Compiling constraints: an invalid one fails only its own request, with a short message;
once known bad it is refused at submission; malformed constraint parameters raise when the
SamplingParams is made; and the same schema, as a dict or as JSON text, compiles once.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from backend.core import Engine, SamplingParams
from structured_cases import SCHEMAS, _compilations, _engine, _finish_checks, _generate, _ok


@pytest.fixture(scope="module")
def engine() -> Engine:
    """An engine of its own: these tests compile constraints that the big batch has too,
    and the big batch counts its compilations on an engine that has not seen them
    (test_structured_outputs.py::test_each_distinct_constraint_compiles_once)."""
    return _engine(enable_jump_forward=True)


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
