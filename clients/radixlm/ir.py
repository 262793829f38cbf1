"""The language's expressions and how they flatten to primitives (the public constructors
that build them are in api.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .choices import ChoicesSamplingMethod

# Regular expressions of the typed generations (``gen(dtype=int)``, ``gen_int``, ...); the
# values SGLang programs expect under these names. A number may end in spaces or newlines;
# ``gen(dtype=int/float)`` also stops at the first space or newline.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
REGEX_STRING = REGEX_STR  # the older name


class Expr:
    """Anything that can be appended to a program state; ``a + b`` appends both in order."""

    def __add__(self, other: "Expr | str") -> "Concat":
        return Concat((self, other))

    def __radd__(self, other: "Expr | str") -> "Concat":
        return Concat((other, self))

    def produces(self) -> tuple[str, ...]:
        """Variables this primitive sets (readers of them wait until it has run)."""
        return ()


@dataclass(frozen=True)
class GenParams:
    """What one ``gen`` asks for, in SGLang's names; None means "the run's default"."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None  # int, float, bool, str (or their names)
    regex: str | None = None
    json_schema: Any = None
    ebnf: str | None = None

    def over(self, defaults: "GenParams") -> "GenParams":
        """These values, falling back to ``defaults`` where unset."""
        merged = dict(vars(defaults))
        merged.update({k: v for k, v in vars(self).items() if v is not None})
        return GenParams(**merged)


@dataclass(frozen=True)
class Text(Expr):
    text: str


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    params: GenParams = field(default_factory=GenParams)

    def produces(self) -> tuple[str, ...]:
        return (self.name,) if self.name else ()


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: ChoicesSamplingMethod | None = None  # None: token_length_normalized

    def produces(self) -> tuple[str, ...]:
        return (self.name,) if self.name else ()


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    """Start capturing the text appended from here into variable ``name``."""

    name: str

    def produces(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str

    def produces(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True)
class SeparateReasoning(Expr):
    """Split each named gen/select in ``names`` into its reasoning and its answer."""

    model_type: str | None
    names: tuple[str, ...]

    def produces(self) -> tuple[str, ...]:
        return self.names + tuple(reasoning_name(n) for n in self.names)


@dataclass(frozen=True)
class CachePrefix(Expr):
    """Internal: prefill the state's text once before a fork."""


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple


def role_expr(role: str, expr: "Expr | str | None") -> Expr:
    """A whole turn of ``role`` holding ``expr`` (an empty turn for None)."""
    inner = () if expr is None else (expr,)
    return Concat((RoleBegin(role), *inner, RoleEnd(role)))


def reasoning_name(name: str) -> str:
    """The variable that receives a gen's reasoning under ``separate_reasoning``."""
    return f"{name}_reasoning_content"


def flatten(expr: "Expr | str") -> list[Expr]:
    """Primitives of an expression, in execution order."""
    if isinstance(expr, str):
        return [Text(expr)]
    if isinstance(expr, Concat):
        return [p for part in expr.parts for p in flatten(part)]
    if isinstance(expr, Expr):
        return [expr]
    if expr is None:
        raise TypeError("cannot append None to a program state")
    raise TypeError(f"cannot append {type(expr).__name__} to a program state")


def named_outputs(expr: "Expr | str") -> tuple[str, ...]:
    """Names of the gens and selects inside an expression, in order."""
    return tuple(p.name for p in flatten(expr) if isinstance(p, (Gen, Select)) and p.name)
