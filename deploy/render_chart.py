#!/usr/bin/env python3
"""Render the RadixLM Helm chart without a helm binary.

No helm (or kustomize) binary can be installed from the registries the project's machines
reach, yet the chart under ``deploy/helm/radixlm`` must be rendered and validated in CI. This
module is a small interpreter for the subset of Go ``text/template`` + sprig that the chart
uses, with Helm's conventions around it:

* values: ``values.yaml`` deep-merged with overrides (a ``null`` override deletes a key),
  checked against ``values.schema.json`` like ``helm template`` does, and every number turned
  into a float, because Helm decodes values through JSON (so ``{{ .Values.n }}`` prints
  ``1e+06`` for one million, exactly as Helm would: templates must pipe numbers to ``int``);
* templates: ``templates/*`` are parsed together, ``_*.tpl`` only contribute ``define``s,
  ``NOTES.txt`` is rendered (to catch errors) but is not a manifest;
* missing map keys render as empty strings (Helm's ``missingkey=zero`` + ``<no value>``
  stripping); a field looked up on nil is an error, as in Go.

Supported syntax: text with ``{{- -}}`` trimming, comments, output pipelines with ``|``,
parenthesised pipelines, variables (``$``, ``$x :=``, ``$x =``), ``if``/``else if``/``else``,
``with``/``else``, ``range`` over lists and maps (``$k, $v :=``), ``define``, ``template``,
and the functions in ``FUNCTIONS`` plus lazy ``and``/``or``. Anything else is rejected with
an error instead of being rendered wrongly. When a real ``helm`` is on PATH,
tests/test_deploy.py also compares this renderer's output with ``helm template``.

CLI: ``python deploy/render_chart.py deploy/helm/radixlm [-f my-values.yaml] [--name R]
[--namespace N]`` prints the manifests as ``helm template`` would.
"""
from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import math
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

import yaml

__all__ = [
    "TemplateError",
    "go_format_float",
    "load_values",
    "render_chart",
    "render_manifests",
    "render_template_string",
]


class TemplateError(Exception):
    """A template could not be parsed or executed (or a values check failed)."""


# --------------------------------------------------------------------------- Go values


def go_format_float(value: float) -> str:
    """Format a float64 the way Go's ``fmt`` ``%v`` does."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    digits = list(digit_tuple)
    while len(digits) > 1 and digits[-1] == 0:
        digits.pop()
        exponent += 1
    n_digits = len(digits)
    point = n_digits + exponent  # position of the decimal point from the left of the digits
    exp10 = point - 1
    text = "".join(str(d) for d in digits)
    # text/template prints with fmt's %v, i.e. strconv 'g' at the shortest precision, which
    # switches to an exponent when exp < -4 or exp >= 6: one million prints as "1e+06".
    if exp10 < -4 or exp10 >= 6:
        mantissa = text[0] + ("." + text[1:] if n_digits > 1 else "")
        out = f"{mantissa}e{'+' if exp10 >= 0 else '-'}{abs(exp10):02d}"
    elif point <= 0:
        out = "0." + "0" * (-point) + text
    elif point >= n_digits:
        out = text + "0" * (point - n_digits)
    else:
        out = text[:point] + "." + text[point:]
    return ("-" if sign else "") + out


def go_str(value: Any) -> str:
    """How ``text/template`` prints a value (after Helm strips ``<no value>``)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return go_format_float(value)
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(go_str(v) if v is not None else "<nil>" for v in value) + "]"
    if isinstance(value, dict):
        inner = " ".join(f"{k}:{go_str(value[k]) if value[k] is not None else '<nil>'}"
                         for k in sorted(value))
        return "map[" + inner + "]"
    raise TemplateError(f"cannot print a value of type {type(value).__name__}")


def truthy(value: Any) -> bool:
    """Go template truth: false, 0, nil and empty strings/lists/maps are false."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, (str, list, tuple, dict)):
        return len(value) > 0
    return True


def _floatify(value: Any) -> Any:
    """Numbers as Helm sees values: JSON-decoded, so every number is a float64."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, dict):
        return {k: _floatify(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floatify(v) for v in value]
    return value


def _json_like(value: Any) -> Any:
    """Values as sigs.k8s.io/yaml marshals them: integral floats print as integers."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return int(value)
    if isinstance(value, dict):
        return {str(k): _json_like(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_like(v) for v in value]
    return value


def to_yaml(value: Any) -> str:
    if value is None:
        return "null"
    text = yaml.safe_dump(_json_like(value), default_flow_style=False, sort_keys=True,
                          width=1 << 30, allow_unicode=True)
    if text.endswith("\n...\n"):  # a bare scalar document
        text = text[: -len("...\n")]
    return text[:-1] if text.endswith("\n") else text


# --------------------------------------------------------------------------- functions


def _basic_kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return None


def _check_comparable(a: Any, b: Any) -> None:
    """Go's eq/lt/...: basic values of different kinds (say a values float and an int
    literal) are an error, not false; maps and lists can't be compared at all."""
    if a is None or b is None:
        return
    ka, kb = _basic_kind(a), _basic_kind(b)
    if ka is None or kb is None:
        raise TemplateError(f"non-comparable types: {go_str(a)!r}, {go_str(b)!r}")
    if ka != kb:
        raise TemplateError(f"incompatible types for comparison: {ka} {go_str(a)!r} "
                            f"and {kb} {go_str(b)!r}")


def _eq(a: Any, *others: Any) -> bool:
    if not others:
        raise TemplateError("eq needs at least two arguments")
    for b in others:
        _check_comparable(a, b)
        if a == b:
            return True
    return False


def _ordered(op: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def compare(a: Any, b: Any) -> bool:
        _check_comparable(a, b)
        if a is None or b is None or isinstance(a, bool):
            raise TemplateError(f"invalid type for comparison: {go_str(a)!r}, {go_str(b)!r}")
        return op(a, b)
    return compare


def _to_int(value: Any) -> int:
    """sprig/cast ``int``: floats truncate, strings parse (base prefixes allowed), junk is 0."""
    if value is None:
        return 0
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text, 0)
        except ValueError:
            try:
                return int(float(text)) if re.fullmatch(r"[-+]?\d+\.\d*", text) else 0
            except ValueError:
                return 0
    return 0


def _to_float(value: Any) -> float:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return 0.0
    return float(_to_int(value)) if not isinstance(value, float) else value


def _go_quote(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _quote(*args: Any) -> str:
    return " ".join(_go_quote(go_str(a)) for a in args if a is not None)


def _squote(*args: Any) -> str:
    return " ".join("'" + go_str(a) + "'" for a in args if a is not None)


def _indent(spaces: Any, text: Any) -> str:
    pad = " " * _to_int(spaces)
    return pad + go_str(text).replace("\n", "\n" + pad)


def _empty(value: Any) -> bool:
    return not truthy(value)


def _default(default: Any, *given: Any) -> Any:
    if not given:
        return default
    return default if _empty(given[0]) else given[0]


def _required(message: Any, *given: Any) -> Any:
    value = given[0] if given else None
    if value is None or value == "":
        raise TemplateError(go_str(message))
    return value


def _fail(message: Any) -> Any:
    raise TemplateError(go_str(message))


def _printf(fmt: str, *args: Any) -> str:
    queue = list(args)

    def next_arg() -> Any:
        if not queue:
            return None
        return queue.pop(0)

    def repl(match: re.Match[str]) -> str:
        verb = match.group(1)
        if verb == "%":
            return "%"
        value = next_arg()
        if verb in ("s", "v"):
            return go_str(value)
        if verb == "d":
            if isinstance(value, float) or not isinstance(value, int):
                return f"%!d({type(value).__name__}={go_str(value)})"
            return str(value)
        if verb == "q":
            return _go_quote(go_str(value))
        raise TemplateError(f"printf verb %{verb} is not supported")

    return re.sub(r"%([%svdq])", repl, fmt)


def _print(*args: Any) -> str:
    # fmt.Sprint: spaces between operands when neither side is a string
    out = []
    for i, arg in enumerate(args):
        if i > 0 and not isinstance(arg, str) and not isinstance(args[i - 1], str):
            out.append(" ")
        out.append(go_str(arg))
    return "".join(out)


def _trunc(length: Any, text: Any) -> str:
    n = _to_int(length)
    s = go_str(text)
    if n < 0:
        return s[max(len(s) + n, 0):]
    return s[:n]


def _index(collection: Any, *keys: Any) -> Any:
    value = collection
    for key in keys:
        if value is None:
            return None
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, (list, tuple)):
            i = _to_int(key)
            if not 0 <= i < len(value):
                raise TemplateError(f"index out of range: {i}")
            value = value[i]
        else:
            raise TemplateError(f"can't index item of type {type(value).__name__}")
    return value


def _dict(*pairs: Any) -> dict:
    if len(pairs) % 2:
        pairs = pairs + ("",)
    return {go_str(pairs[i]): pairs[i + 1] for i in range(0, len(pairs), 2)}


def _kind_is(kind: str, value: Any) -> bool:
    kinds = {
        "string": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "float64": lambda v: isinstance(v, float),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "int64": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "map": lambda v: isinstance(v, dict),
        "slice": lambda v: isinstance(v, list),
        "invalid": lambda v: v is None,
    }
    if kind not in kinds:
        raise TemplateError(f"kindIs: unsupported kind {kind!r}")
    return kinds[kind](value)


def _length(value: Any) -> int:
    if isinstance(value, (str, list, tuple, dict)):
        return len(value)
    raise TemplateError(f"len of type {type(value).__name__}")


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "b64enc": lambda s: base64.b64encode(go_str(s).encode()).decode(),
    "contains": lambda sub, s: go_str(sub) in go_str(s),
    "default": _default,
    "dict": _dict,
    "empty": _empty,
    "eq": _eq,
    "fail": _fail,
    "float64": _to_float,
    "floor": lambda v: float(math.floor(_to_float(v))),
    "ge": _ordered(lambda a, b: a >= b),
    "gt": _ordered(lambda a, b: a > b),
    "hasKey": lambda d, k: isinstance(d, dict) and k in d,
    "hasPrefix": lambda p, s: go_str(s).startswith(go_str(p)),
    "hasSuffix": lambda p, s: go_str(s).endswith(go_str(p)),
    "indent": _indent,
    "index": _index,
    "int": _to_int,
    "int64": _to_int,
    "join": lambda sep, items: go_str(sep).join(go_str(i) for i in (items or [])),
    "kindIs": _kind_is,
    "le": _ordered(lambda a, b: a <= b),
    "len": _length,
    "list": lambda *items: list(items),
    "lower": lambda s: go_str(s).lower(),
    "lt": _ordered(lambda a, b: a < b),
    "ne": lambda a, b: not _eq(a, b),
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "not": lambda v: not truthy(v),
    "print": _print,
    "printf": _printf,
    "quote": _quote,
    "replace": lambda old, new, s: go_str(s).replace(go_str(old), go_str(new)),
    "required": _required,
    "sha256sum": lambda s: hashlib.sha256(go_str(s).encode()).hexdigest(),
    "squote": _squote,
    "ternary": lambda a, b, cond: a if truthy(cond) else b,
    "toJson": lambda v: json.dumps(_json_like(v), separators=(",", ":"), sort_keys=True),
    "toString": go_str,
    "toYaml": to_yaml,
    "trim": lambda s: go_str(s).strip(),
    "trimPrefix": lambda p, s: go_str(s)[len(go_str(p)):] if go_str(s).startswith(go_str(p))
    else go_str(s),
    "trimSuffix": lambda suf, s: go_str(s)[: -len(go_str(suf))]
    if go_str(suf) and go_str(s).endswith(go_str(suf)) else go_str(s),
    "trunc": _trunc,
    "upper": lambda s: go_str(s).upper(),
}
LAZY_FUNCTIONS = ("and", "or", "include")  # handled by the evaluator


# --------------------------------------------------------------------------- lexing


class _Action:
    __slots__ = ("body", "where")

    def __init__(self, body: str, where: str) -> None:
        self.body = body
        self.where = where


def _split(source: str, name: str) -> list[str | _Action]:
    """Split template text into text pieces and actions, applying ``{{-``/``-}}`` trimming."""
    pieces: list[str | _Action] = []
    pos = 0
    trim_next = False
    while True:
        start = source.find("{{", pos)
        if start < 0:
            text = source[pos:]
            pieces.append(text.lstrip(" \t\r\n") if trim_next else text)
            break
        text = source[pos:start]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        inner_start = start + 2
        trim_before = source[inner_start:inner_start + 2] in ("- ", "-\n", "-\t", "-\r")
        if trim_before:
            text = text.rstrip(" \t\r\n")
            inner_start += 1
        pieces.append(text)
        end = _find_action_end(source, inner_start, name)
        body = source[inner_start:end]
        trim_next = False
        if re.search(r"[ \t\r\n]-$", body):
            body = body[:-1]
            trim_next = True
        line = source.count("\n", 0, start) + 1
        pieces.append(_Action(body.strip(), f"{name}:{line}"))
        pos = end + 2
    return pieces


def _find_action_end(source: str, i: int, name: str) -> int:
    n = len(source)
    while i < n:
        if source.startswith("/*", i):
            close = source.find("*/", i + 2)
            if close < 0:
                break
            i = close + 2
            continue
        ch = source[i]
        if ch == '"':
            i += 1
            while i < n and source[i] != '"':
                i += 2 if source[i] == "\\" else 1
            i += 1
            continue
        if ch == "`":
            close = source.find("`", i + 1)
            if close < 0:
                break
            i = close + 1
            continue
        if source.startswith("}}", i):
            return i
        i += 1
    line = source.count("\n", 0, i) + 1
    raise TemplateError(f"{name}:{line}: unclosed action")


_TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<number>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
  | (?P<declare>:=)
  | (?P<assign>=)
  | (?P<pipe>\|)
  | (?P<lparen>\()
  | (?P<rparen>\))
  | (?P<comma>,)
  | (?P<variable>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    """,
    re.VERBOSE | re.DOTALL,
)


def _tokenize(body: str, where: str) -> list[tuple[str, str]]:
    tokens = []
    pos = 0
    while pos < len(body):
        match = _TOKEN_RE.match(body, pos)
        if not match:
            raise TemplateError(f"{where}: unexpected {body[pos:pos + 20]!r}")
        kind = match.lastgroup or ""
        if kind != "ws":
            tokens.append((kind, match.group()))
        pos = match.end()
    return tokens


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}


def _unquote(literal: str, where: str) -> str:
    out = []
    i = 1
    while i < len(literal) - 1:
        ch = literal[i]
        if ch == "\\":
            nxt = literal[i + 1]
            if nxt not in _ESCAPES:
                raise TemplateError(f"{where}: unsupported escape \\{nxt}")
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------- parsing

# pipeline node: ("pipeline", decl_vars, decl_op, [command...])
# command: [operand...]; operand: ("field", [names]) | ("var", name, [names]) |
#   ("const", value) | ("ident", name) | ("sub", pipeline, [names])


class _PipeParser:
    def __init__(self, tokens: list[tuple[str, str]], where: str) -> None:
        self.tokens = tokens
        self.pos = 0
        self.where = where

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def parse_pipeline(self, allow_decl: bool = True) -> tuple:
        decl: list[str] = []
        op = ""
        if allow_decl:
            save = self.pos
            names = []
            while self.peek() and self.peek()[0] == "variable" and "." not in self.peek()[1]:
                names.append(self.take()[1])
                if self.peek() and self.peek()[0] == "comma":
                    self.take()
                    continue
                break
            if names and self.peek() and self.peek()[0] in ("declare", "assign"):
                op = self.take()[0]
                decl = names
            else:
                self.pos = save
        commands = [self.parse_command()]
        while self.peek() and self.peek()[0] == "pipe":
            self.take()
            commands.append(self.parse_command())
        return ("pipeline", decl, op, commands)

    def parse_command(self) -> list:
        operands = []
        while self.peek() and self.peek()[0] not in ("pipe", "rparen"):
            operands.append(self.parse_operand())
        if not operands:
            raise TemplateError(f"{self.where}: empty command")
        return operands

    def parse_operand(self) -> tuple:
        kind, text = self.take()
        if kind == "field":
            node: tuple = ("field", [] if text == "." else text[1:].split("."))
        elif kind == "variable":
            name, *rest = text.split(".")
            node = ("var", name, rest)
        elif kind == "string":
            node = ("const", _unquote(text, self.where))
        elif kind == "raw":
            node = ("const", text[1:-1])
        elif kind == "number":
            node = ("const", float(text) if re.search(r"[.eE]", text) else int(text))
        elif kind == "ident":
            if text in ("true", "false"):
                node = ("const", text == "true")
            elif text == "nil":
                node = ("const", None)
            else:
                node = ("ident", text)
        elif kind == "lparen":
            inner = self.parse_pipeline(allow_decl=False)
            if not self.peek() or self.take()[0] != "rparen":
                raise TemplateError(f"{self.where}: unclosed parenthesis")
            names: list[str] = []
            if self.peek() and self.peek()[0] == "field" and self.peek()[1] != ".":
                names = self.take()[1][1:].split(".")
            node = ("sub", inner, names)
        else:
            raise TemplateError(f"{self.where}: unexpected {text!r}")
        return node


def _parse_pipe(text: str, where: str, allow_decl: bool = True) -> tuple:
    parser = _PipeParser(_tokenize(text, where), where)
    pipeline = parser.parse_pipeline(allow_decl)
    if parser.peek() is not None:
        raise TemplateError(f"{where}: unexpected {parser.peek()[1]!r}")
    return pipeline


class _Parser:
    """Builds a node list; control keywords open nested lists until ``end``."""

    def __init__(self, pieces: list[str | _Action], defines: dict[str, list]) -> None:
        self.pieces = pieces
        self.pos = 0
        self.defines = defines

    def parse(self, stop: tuple[str, ...] = ()) -> tuple[list, str, _Action | None]:
        nodes: list = []
        while self.pos < len(self.pieces):
            piece = self.pieces[self.pos]
            self.pos += 1
            if isinstance(piece, str):
                if piece:
                    nodes.append(("text", piece))
                continue
            body, where = piece.body, piece.where
            if body.startswith("/*"):
                if not body.endswith("*/"):
                    raise TemplateError(f"{where}: comment must close its action")
                continue
            word = body.split(None, 1)[0] if body else ""
            rest = body[len(word):].strip()
            if word in ("end", "else"):
                if word not in stop:
                    raise TemplateError(f"{where}: unexpected {{{{{word}}}}}")
                return nodes, word, piece
            if word in ("if", "with"):
                nodes.append(self._parse_branches(word, rest, where))
            elif word == "range":
                pipe = _parse_pipe(rest, where)
                body_nodes, closer, closing = self.parse(("end", "else"))
                else_nodes: list = []
                if closer == "else":
                    if closing is not None and closing.body != "else":
                        raise TemplateError(f"{closing.where}: unsupported {{{{{closing.body}}}}}")
                    else_nodes, _, _ = self._expect_end(where)
                nodes.append(("range", pipe, body_nodes, else_nodes, where))
            elif word in ("define", "block"):
                if word == "block":
                    raise TemplateError(f"{where}: block is not supported")
                name = _unquote(rest, where) if rest.startswith('"') else None
                if name is None:
                    raise TemplateError(f"{where}: define needs a quoted name")
                body_nodes, _, _ = self._expect_end(where)
                self.defines[name] = body_nodes
            elif word == "template":
                match = re.match(r'("(?:[^"\\]|\\.)*")\s*(.*)$', rest, re.S)
                if not match:
                    raise TemplateError(f"{where}: template needs a quoted name")
                pipe = _parse_pipe(match.group(2), where) if match.group(2) else None
                nodes.append(("template", _unquote(match.group(1), where), pipe, where))
            else:
                nodes.append(("action", _parse_pipe(body, where), where))
        if stop:
            raise TemplateError(f"missing {{{{end}}}} (expected one of {stop})")
        return nodes, "", None

    def _expect_end(self, where: str) -> tuple[list, str, _Action | None]:
        nodes, closer, closing = self.parse(("end",))
        if closing is not None and closing.body.strip() != "end":
            raise TemplateError(f"{closing.where}: expected {{{{end}}}}")
        return nodes, closer, closing

    def _parse_branches(self, word: str, rest: str, where: str) -> tuple:
        branches = [(_parse_pipe(rest, where), None)]
        else_nodes: list = []
        while True:
            body_nodes, closer, closing = self.parse(("end", "else"))
            branches[-1] = (branches[-1][0], body_nodes)
            if closer == "end":
                if closing is not None and closing.body != "end":
                    raise TemplateError(f"{closing.where}: expected {{{{end}}}}")
                break
            assert closing is not None
            tail = closing.body[len("else"):].strip()
            if tail.startswith(word + " ") and word == "if":
                branches.append((_parse_pipe(tail[len(word):].strip(), closing.where), None))
                continue
            if tail:
                raise TemplateError(f"{closing.where}: unsupported {{{{else {tail}}}}}")
            else_nodes, _, _ = self._expect_end(closing.where)
            break
        return (word, branches, else_nodes, where)


# --------------------------------------------------------------------------- execution


class _Scope:
    def __init__(self, root: Any) -> None:
        self.frames: list[dict[str, Any]] = [{"$": root}]

    def push(self) -> None:
        self.frames.append({})

    def pop(self) -> None:
        self.frames.pop()

    def declare(self, name: str, value: Any) -> None:
        self.frames[-1][name] = value

    def assign(self, name: str, value: Any, where: str) -> None:
        for frame in reversed(self.frames):
            if name in frame:
                frame[name] = value
                return
        raise TemplateError(f"{where}: undefined variable {name}")

    def get(self, name: str, where: str) -> Any:
        for frame in reversed(self.frames):
            if name in frame:
                return frame[name]
        raise TemplateError(f"{where}: undefined variable {name}")


class _Engine:
    def __init__(self, defines: dict[str, list], files: dict[str, list]) -> None:
        self.defines = defines
        self.files = files
        self.depth = 0

    # -- templates
    def run_named(self, name: str, dot: Any, where: str) -> str:
        nodes = self.defines.get(name)
        if nodes is None:
            nodes = self.files.get(name)
        if nodes is None:
            raise TemplateError(f"{where}: no template named {name!r}")
        self.depth += 1
        if self.depth > 100:
            raise TemplateError(f"{where}: template recursion too deep")
        try:
            out: list[str] = []
            self.run(nodes, dot, _Scope(dot), out)
            return "".join(out)
        finally:
            self.depth -= 1

    def run(self, nodes: list, dot: Any, scope: _Scope, out: list[str]) -> None:
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "action":
                pipe, where = node[1], node[2]
                value = self.pipeline(pipe, dot, scope, where)
                if not pipe[1]:  # declarations print nothing
                    out.append(go_str(value))
            elif kind in ("if", "with"):
                self._branches(node, dot, scope, out)
            elif kind == "range":
                self._range(node, dot, scope, out)
            elif kind == "template":
                _, name, pipe, where = node
                arg = self.pipeline(pipe, dot, scope, where) if pipe else None
                out.append(self.run_named(name, arg, where))
            else:  # pragma: no cover - parser produces only the kinds above
                raise TemplateError(f"unknown node {kind}")

    def _branches(self, node: tuple, dot: Any, scope: _Scope, out: list[str]) -> None:
        word, branches, else_nodes, where = node
        for pipe, body in branches:
            scope.push()
            try:
                value = self.pipeline(pipe, dot, scope, where)
                if truthy(value):
                    self.run(body, value if word == "with" else dot, scope, out)
                    return
            finally:
                scope.pop()
        if else_nodes:
            scope.push()
            try:
                self.run(else_nodes, dot, scope, out)
            finally:
                scope.pop()

    def _range(self, node: tuple, dot: Any, scope: _Scope, out: list[str]) -> None:
        _, pipe, body, else_nodes, where = node
        decl = pipe[1]
        bare = ("pipeline", [], "", pipe[3])
        collection = self.pipeline(bare, dot, scope, where)
        if isinstance(collection, dict):
            items = [(k, collection[k]) for k in sorted(collection)]
        elif isinstance(collection, (list, tuple)):
            items = list(enumerate(collection))
        elif collection is None:
            items = []
        else:
            raise TemplateError(f"{where}: range can't iterate over {go_str(collection)}")
        if not items:
            if else_nodes:
                self.run(else_nodes, dot, scope, out)
            return
        for key, value in items:
            scope.push()
            try:
                if len(decl) == 1:
                    scope.declare(decl[0], value)
                elif len(decl) == 2:
                    scope.declare(decl[0], key)
                    scope.declare(decl[1], value)
                self.run(body, value, scope, out)
            finally:
                scope.pop()

    # -- pipelines
    def pipeline(self, pipe: tuple, dot: Any, scope: _Scope, where: str) -> Any:
        _, decl, op, commands = pipe
        value: Any = None
        first = True
        for command in commands:
            value = self.command(command, dot, scope, where, value, not first)
            first = False
        if decl:
            if len(decl) != 1:
                raise TemplateError(f"{where}: too many declarations")
            if op == "declare":
                scope.declare(decl[0], value)
            else:
                scope.assign(decl[0], value, where)
        return value

    def command(self, command: list, dot: Any, scope: _Scope, where: str,
                piped: Any, has_piped: bool) -> Any:
        head = command[0]
        if head[0] == "ident":
            name = head[1]
            arg_nodes = command[1:]
            if name in ("and", "or"):
                thunks = [lambda n=n: self.operand(n, dot, scope, where) for n in arg_nodes]
                if has_piped:
                    thunks.append(lambda: piped)
                if not thunks:
                    raise TemplateError(f"{where}: {name} needs arguments")
                result: Any = None
                for thunk in thunks:
                    result = thunk()
                    if (name == "and") != truthy(result):
                        return result
                return result
            args = [self.operand(n, dot, scope, where) for n in arg_nodes]
            if has_piped:
                args.append(piped)
            if name == "include":
                if len(args) != 2:
                    raise TemplateError(f"{where}: include needs a name and a context")
                return self.run_named(go_str(args[0]), args[1], where)
            func = FUNCTIONS.get(name)
            if func is None:
                raise TemplateError(f"{where}: function {name!r} not defined")
            try:
                return func(*args)
            except TemplateError as exc:
                raise TemplateError(f"{where}: {name}: {exc}") from None
            except TypeError as exc:
                raise TemplateError(f"{where}: wrong arguments for {name}: {exc}") from None
        if len(command) > 1 or has_piped:
            raise TemplateError(f"{where}: can't give arguments to a non-function")
        return self.operand(head, dot, scope, where)

    def operand(self, node: tuple, dot: Any, scope: _Scope, where: str) -> Any:
        kind = node[0]
        if kind == "const":
            return node[1]
        if kind == "field":
            return self.fields(dot, node[1], where, ".")
        if kind == "var":
            return self.fields(scope.get(node[1], where), node[2], where, node[1])
        if kind == "sub":
            return self.fields(self.pipeline(node[1], dot, scope, where), node[2], where, "(...)")
        if kind == "ident":
            if node[1] in FUNCTIONS or node[1] in LAZY_FUNCTIONS:
                return self.command([node], dot, scope, where, None, False)
            raise TemplateError(f"{where}: function {node[1]!r} not defined")
        raise TemplateError(f"{where}: bad operand")  # pragma: no cover

    @staticmethod
    def fields(value: Any, names: list[str], where: str, base: str) -> Any:
        path = base
        for name in names:
            if value is None:
                raise TemplateError(f"{where}: nil pointer evaluating {path}.{name}")
            if not isinstance(value, dict):
                raise TemplateError(f"{where}: can't evaluate field {name} in {path}")
            value = value.get(name)
            path = f"{path}.{name}" if path != "." else f".{name}"
        return value


def render_template_string(source: str, data: Any, defines: dict[str, list] | None = None,
                           name: str = "inline") -> str:
    """Render one template text (helper for tests of the renderer itself)."""
    defs = dict(defines or {})
    nodes, _, _ = _Parser(_split(source, name), defs).parse()
    engine = _Engine(defs, {name: nodes})
    out: list[str] = []
    engine.run(nodes, data, _Scope(data), out)
    return "".join(out)


# --------------------------------------------------------------------------- charts


def _deep_merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_values(chart_dir: str | Path, *overrides: dict) -> dict:
    """values.yaml merged with overrides (later wins), validated against values.schema.json."""
    chart_dir = Path(chart_dir)
    values = yaml.safe_load((chart_dir / "values.yaml").read_text()) or {}
    for override in overrides:
        values = _deep_merge(values, override or {})
    schema_file = chart_dir / "values.schema.json"
    if schema_file.exists():
        import jsonschema

        schema = json.loads(schema_file.read_text())
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(values),
                        key=lambda e: list(e.absolute_path))
        if errors:
            lines = [f"- {'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
                     for e in errors]
            raise TemplateError("values don't meet the schema:\n" + "\n".join(lines))
    return values


_CHART_FIELDS = {"apiVersion": "APIVersion", "appVersion": "AppVersion", "kubeVersion": "KubeVersion"}


def render_chart(chart_dir: str | Path, values: dict | None = None, *,
                 release_name: str = "radixlm", namespace: str = "default",
                 kube_version: str = "1.30.0") -> dict[str, str]:
    """Render every template of the chart; returns {"<chart>/templates/<file>": text}."""
    chart_dir = Path(chart_dir)
    meta = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    chart = {_CHART_FIELDS.get(k, k[:1].upper() + k[1:]): v for k, v in meta.items()}
    merged = load_values(chart_dir, values or {})
    major, minor = kube_version.split(".")[:2]
    base = f"{meta['name']}/templates"
    context = {
        "Values": _floatify(merged),
        "Release": {"Name": release_name, "Namespace": namespace, "Service": "Helm",
                    "IsInstall": True, "IsUpgrade": False, "Revision": 1},
        "Chart": chart,
        "Capabilities": {"KubeVersion": {"Version": f"v{kube_version}", "Major": major,
                                         "Minor": minor, "GitVersion": f"v{kube_version}"}},
        "Template": {"BasePath": base, "Name": ""},
    }
    defines: dict[str, list] = {}
    files: dict[str, list] = {}
    template_dir = chart_dir / "templates"
    paths = sorted(p for p in template_dir.rglob("*") if p.is_file())
    for path in paths:
        name = f"{base}/{path.relative_to(template_dir).as_posix()}"
        nodes, _, _ = _Parser(_split(path.read_text(), name), defines).parse()
        files[name] = nodes
    engine = _Engine(defines, files)
    rendered: dict[str, str] = {}
    for name, nodes in files.items():
        if Path(name).name.startswith("_"):
            continue
        dot = dict(context, Template={"BasePath": base, "Name": name})
        out: list[str] = []
        engine.run(nodes, dot, _Scope(dot), out)
        rendered[name] = "".join(out)
    return rendered


def render_manifests(chart_dir: str | Path, values: dict | None = None, **kwargs: Any
                     ) -> list[dict]:
    """Rendered Kubernetes objects (NOTES.txt and empty documents left out)."""
    objects: list[dict] = []
    for name, text in render_chart(chart_dir, values, **kwargs).items():
        if name.endswith("NOTES.txt"):
            continue
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            raise TemplateError(f"{name} does not render to valid YAML: {exc}\n{text}") from None
        objects.extend(doc for doc in docs if doc)
    return objects


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chart", type=Path)
    parser.add_argument("-f", "--values", action="append", default=[], type=Path)
    parser.add_argument("--name", default="radixlm")
    parser.add_argument("--namespace", default="default")
    args = parser.parse_args(argv)
    overrides: dict = {}
    for path in args.values:
        overrides = _deep_merge(overrides, yaml.safe_load(path.read_text()) or {})
    try:
        rendered = render_chart(args.chart, overrides, release_name=args.name,
                                namespace=args.namespace)
    except TemplateError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    for name, text in rendered.items():
        if name.endswith("NOTES.txt") or not text.strip():
            continue
        print(f"---\n# Source: {name}\n{text.strip(chr(10))}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
