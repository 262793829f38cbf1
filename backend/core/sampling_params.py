"""Per-request sampling parameters and their validation."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Keys accepted from JSON (Triton ``sampling_parameters``) that are spelled differently here.
_ALIASES = {"max_tokens": "max_new_tokens"}


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
        known = {f.name for f in dataclasses.fields(cls)}
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
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for name in ("max_new_tokens", "top_k", "n", "logprobs"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool),
                  f"{name} must be an integer, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            check(isinstance(getattr(self, name), bool),
                  f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool),
                  f"{name} must be a number, got {value!r}")
        check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 or >= 0, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0.0,
              f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(1 <= self.n <= 64, f"n must be in [1, 64], got {self.n}")
        check(0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}")
        check(self.seed is None or isinstance(self.seed, int) and not isinstance(self.seed, bool),
              f"seed must be an integer, got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        check(self.prompt_logprobs_start is None or self.prompt_logprobs_start >= 0,
              "prompt_logprobs_start must be >= 0")
        if self.choices is not None:
            check(isinstance(self.choices, list) and len(self.choices) > 0
                  and all(isinstance(c, str) and c for c in self.choices),
                  "choices must be a non-empty list of non-empty strings")
        self.constraint  # raises on conflicting constraints
