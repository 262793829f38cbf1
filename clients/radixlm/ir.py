"""The language's expressions: text, gen, select and roles, and how they flatten to primitives."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


class Expr:
    """Anything that can be appended to a program state; ``a + b`` appends both in order."""

    def __add__(self, other: "Expr | str") -> "Concat":
        return Concat((self, other))

    def __radd__(self, other: "Expr | str") -> "Concat":
        return Concat((other, self))


@dataclass(frozen=True)
class Text(Expr):
    text: str


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)  # wire sampling keys, Nones dropped


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class CachePrefix(Expr):
    """Internal: prefill the state's text once before a fork."""


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple


def flatten(expr: "Expr | str") -> list[Expr]:
    """Primitives of an expression, in execution order."""
    if isinstance(expr, str):
        return [Text(expr)]
    if isinstance(expr, Concat):
        return [p for part in expr.parts for p in flatten(part)]
    if isinstance(expr, Expr):
        return [expr]
    raise TypeError(f"cannot append {type(expr).__name__} to a program state")


def gen(name: str | None = None, max_tokens: int | None = None, stop: str | Sequence[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, repetition_penalty: float | None = None,
        stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
        seed: int | None = None, regex: str | None = None, json_schema: Any = None,
        ebnf: str | None = None, choices: Sequence[str] | None = None,
        max_new_tokens: int | None = None) -> Expr:
    """Generate text into variable ``name``; with ``choices`` it is a ``select``."""
    if choices is not None:
        return select(name, choices)
    params = dict(max_tokens=max_tokens if max_tokens is not None else max_new_tokens,
                  stop=[stop] if isinstance(stop, str) else stop, temperature=temperature,
                  top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                  presence_penalty=presence_penalty, repetition_penalty=repetition_penalty,
                  stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, seed=seed, regex=regex,
                  json_schema=json_schema, ebnf=ebnf)
    return Gen(name, {k: v for k, v in params.items() if v is not None})


def select(name: str | None = None, choices: Sequence[str] = ()) -> Expr:
    """Append whichever of ``choices`` the model finds most likely (length-normalized)."""
    choices = tuple(choices)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs a non-empty list of non-empty strings")
    return Select(name, choices)


def _role(role: str, expr: "Expr | str") -> Expr:
    return Concat((RoleBegin(role), expr, RoleEnd(role)))


def system(expr: "Expr | str") -> Expr:
    return _role("system", expr)


def user(expr: "Expr | str") -> Expr:
    return _role("user", expr)


def assistant(expr: "Expr | str") -> Expr:
    return _role("assistant", expr)
