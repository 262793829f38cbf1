"""Per-request sampling parameters and their validation."""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

# Keys accepted from JSON (Triton ``sampling_parameters``) that are spelled differently here.
_ALIASES = {"max_tokens": "max_new_tokens"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# (fields, test, what they must be): checked first, so the ranges compare numbers
_TYPE_CHECKS = (
    (("max_new_tokens", "top_k", "n", "logprobs"), _is_int, "an integer"),
    (("ignore_eos", "skip_special_tokens"), lambda v: isinstance(v, bool), "true or false"),
    (("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
      "presence_penalty"), _is_number, "a number"),
)
# (field, test, requirement in the error message)
_RANGE_CHECKS = (
    ("max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("temperature", lambda v: v >= 0.0, ">= 0"),
    ("top_p", lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    ("top_k", lambda v: v == -1 or v >= 0, "-1 or >= 0"),
    ("min_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    ("repetition_penalty", lambda v: v > 0.0, "> 0"),
    ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("n", lambda v: 1 <= v <= 64, "in [1, 64]"),
    ("logprobs", lambda v: 0 <= v <= 20, "in [0, 20]"),
)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    # False/0: no logprobs; True/1: logprob of each chosen token; k > 1 also the top-k alternatives.
    logprobs: int = 0
    # Return logprobs of prompt tokens from this position on (None: none).
    prompt_logprobs_start: int | None = None
    skip_special_tokens: bool = True
    # Structured decoding (at most one of these).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    choices: list[str] | None = None
    response_format: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if isinstance(self.logprobs, bool):
            self.logprobs = int(self.logprobs)
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        self.validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys raise ``ValueError`` naming them."""
        if not isinstance(data, dict):
            raise ValueError("sampling parameters must be a JSON object")
        known = _field_names(cls)
        kwargs: dict[str, Any] = {}
        unknown = []
        for key, value in data.items():
            name = _ALIASES.get(key, key)
            if name not in known:
                unknown.append(key)
            elif value is not None:
                kwargs[name] = value
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"invalid sampling parameters: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults, by name (``from_dict`` takes it
        back): the form these parameters cross a process boundary in."""
        return {name: value for name, default in _defaults(type(self)).items()
                if (value := getattr(self, name)) != default}

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, or None."""
        found = []
        if self.json_schema is not None:
            found.append(("json_schema", self.json_schema))
        if self.regex is not None:
            found.append(("regex", self.regex))
        if self.ebnf is not None:
            found.append(("ebnf", self.ebnf))
        if self.choices is not None:
            found.append(("choices", json.dumps(list(self.choices))))
        if self.response_format is not None:
            kind = self.response_format.get("type")
            if kind == "json_object":
                found.append(("json_object", ""))
            elif kind == "json_schema":
                schema = self.response_format.get("json_schema", {})
                schema = schema.get("schema", schema) if isinstance(schema, dict) else schema
                found.append(("json_schema", json.dumps(schema)))
            elif kind != "text":
                raise ValueError(f"unsupported response_format type {kind!r}")
        if len(found) > 1:
            raise ValueError("at most one of json_schema, regex, ebnf, choices, response_format")
        return found[0] if found else None

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Messages are formatted only on
        failure: every request is validated on the server's intake path."""
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for names, ok, kind in _TYPE_CHECKS:
            for name in names:
                value = getattr(self, name)
                if not ok(value):
                    raise ValueError(f"{name} must be {kind}, got {value!r}")
        for name, ok, requirement in _RANGE_CHECKS:
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"{name} must be {requirement}, got {value}")
        if not (self.seed is None or _is_int(self.seed)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        check(self.prompt_logprobs_start is None or self.prompt_logprobs_start >= 0,
              "prompt_logprobs_start must be >= 0")
        if self.choices is not None:
            check(isinstance(self.choices, list) and len(self.choices) > 0
                  and all(isinstance(c, str) and c for c in self.choices),
                  "choices must be a non-empty list of non-empty strings")
        self.constraint  # raises on conflicting constraints


@functools.lru_cache(maxsize=None)
def _defaults(cls) -> dict[str, Any]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


@functools.lru_cache(maxsize=None)
def _field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))
