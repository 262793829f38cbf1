"""Constrained outputs parse and conform: JSON schemas (checked with ``jsonschema``),
regexes (``re.fullmatch``), choices (exactly one), an EBNF grammar (our own
recursive-descent parser, checked first) and ``response_format``, greedy and sampled. A
batch that mixes them with unconstrained requests equals running each request alone, and
each distinct constraint compiles once.

All of it reads the one big batch of structured_cases.py (see there for the model).
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from structured_cases import (CHOICES, REGEXES, SCHEMAS, TEMPERATURES, _big_batch_requests,
                              _generate, _ok, _temp_id)


# The jump-forward engine and the big batch it ran are shared by test_structured_outputs.py
# and test_structured_jump_forward.py: conftest.py makes them once a session, as the batch
# takes over a minute on CPU. These names are what the tests below ask for.
@pytest.fixture(scope="module")
def engine(structured_engine):
    return structured_engine


@pytest.fixture(scope="module")
def big_batch(structured_big_batch):
    return structured_big_batch


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
