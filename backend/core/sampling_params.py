"""Per-request sampling parameters and their validation.

``SamplingParams`` holds every field the engine reads, some of which only the serving
layer or the engine itself may set (``prompt_logprobs_start``, ``cumulative_logprob``).
Clients reach it through ``sampling_keys.from_request``, which reads the documented
keys only; ``from_dict``/``to_dict`` are the form the fields cross a process boundary in.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

# Keys accepted from JSON that are spelled differently here (and named so in errors).
_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
_WIRE_NAMES = {field: key for key, field in _ALIASES.items()}
MAX_LOGPROBS = 20  # alternatives per position (vLLM's default cap)
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a torch generator accepts
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# An object for the json_object constraint: a JSON value that is an object, not any value.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int_list(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) and s for s in v)


# (fields, test, what they must be): checked first, so the ranges compare numbers
_TYPE_CHECKS = (
    (("max_new_tokens", "min_new_tokens", "top_k", "n"), _is_int, "an integer"),
    (("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
      "include_stop_str_in_output", "cumulative_logprob"),
     lambda v: isinstance(v, bool), "true or false"),
    (("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
      "presence_penalty"), _is_number, "a finite number"),
    (("seed", "logprobs", "prompt_logprobs", "best_of", "truncate_prompt_tokens",
      "prompt_logprobs_start"), lambda v: v is None or _is_int(v), "an integer"),
    (("stop", "stop_regex", "bad_words"), lambda v: v is None or _is_str_list(v),
     "a list of non-empty strings"),
    (("stop_token_ids",), _is_int_list, "a list of integer token ids"),
    (("allowed_token_ids",), lambda v: v is None or (_is_int_list(v) and v),
     "a non-empty list of integer token ids"),
    (("json_schema", "regex", "ebnf"), lambda v: v is None or isinstance(v, str), "a string"),
    (("choices",), lambda v: v is None or (_is_str_list(v) and v),
     "a non-empty list of non-empty strings"),
    (("response_format",), lambda v: v is None or isinstance(v, dict),
     'an object such as {"type": "json_object"}'),
)
_FIELD_TYPE_CHECKS = tuple((name, ok, kind) for names, ok, kind in _TYPE_CHECKS
                           for name in names)
# (field, test, requirement in the error message); None values pass
_RANGE_CHECKS = (
    ("max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("min_new_tokens", lambda v: v >= 0, ">= 0"),
    ("temperature", lambda v: v >= 0.0, ">= 0"),
    ("top_p", lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    ("top_k", lambda v: v >= -1, "-1 (or 0) for all tokens, or >= 1"),
    ("min_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    ("repetition_penalty", lambda v: v > 0.0, "> 0"),
    ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("n", lambda v: v >= 1, ">= 1"),
    ("seed", lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1], "in [-2**63, 2**64 - 1]"),
    ("logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
    ("prompt_logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
    ("truncate_prompt_tokens", lambda v: v >= 1, ">= 1"),
    ("prompt_logprobs_start", lambda v: v >= 0, ">= 0"),
    ("stop_token_ids", lambda v: all(t >= 0 for t in v), "token ids >= 0"),
    ("allowed_token_ids", lambda v: all(t >= 0 for t in v), "token ids >= 0"),
)


@dataclass
class SamplingParams:
    max_new_tokens: int = 16  # vLLM's default
    min_new_tokens: int = 0  # no EOS, stop token or stop string before this many tokens
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
    # regular expressions: the output ends with the first match of one
    stop_regex: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    # best_of samples are drawn and the n with the highest cumulative logprob returned
    best_of: int | None = None
    # None: no logprobs; 0: the chosen token's; k: also the k most likely alternatives
    logprobs: int | None = None
    # the same for prompt tokens (from logprob_start_len on), sent with the first output
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0
    skip_special_tokens: bool = True
    # accepted as in vLLM; fast (tokenizer.json) tokenizers never put spaces there
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (their last token is masked)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # Structured decoding (at most one of these).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    choices: list[str] | None = None
    response_format: dict | None = None
    # Set by the engine or the serving layer, never by a client's keys:
    # prompt positions whose logprobs are computed (scoring, prompt_logprobs)
    prompt_logprobs_start: int | None = None
    # compute each sampled token's logprob (cumulative_logprob output, best_of)
    cumulative_logprob: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop = list(self.stop or [])
        self.stop_regex = list(self.stop_regex or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        elif self.logit_bias is not None:
            raise ValueError(f"logit_bias must be an object of token id -> bias, "
                             f"got {self.logit_bias!r}")
        self.validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Every field by name (``to_dict``'s form); unknown keys raise ``ValueError``.
        Clients' keys go through ``sampling_keys.from_request`` instead."""
        if not isinstance(data, dict):
            raise ValueError("sampling parameters must be a JSON object")
        known = _field_names(cls)
        kwargs = {_ALIASES.get(k, k): v for k, v in data.items() if v is not None}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"invalid sampling parameters: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults, by name (``from_dict`` takes it
        back): the form these parameters cross a process boundary in."""
        values = self.__dict__  # read directly: this runs for every request submitted
        return {name: value for name, default in _defaults(type(self)).items()
                if (value := values[name]) is not default and value != default}

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
    def has_logit_rules(self) -> bool:
        """Logit bias, allowed or bad tokens, or a minimum length: the sampler edits the
        logits row before drawing."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words
                    or self.min_new_tokens)

    @property
    def wants_token_logprobs(self) -> bool:
        """The sampler must report each chosen token's logprob."""
        return self.logprobs is not None or self.cumulative_logprob

    @property
    def num_samples(self) -> int:
        """How many samples the engine draws (best_of of them when it is larger than n)."""
        return max(self.n, self.best_of or 0)

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
                found.append(("json_schema", JSON_OBJECT_SCHEMA))
            elif kind == "json_schema":
                schema = self.response_format.get("json_schema", {})
                schema = schema.get("schema", schema) if isinstance(schema, dict) else schema
                if not isinstance(schema, (dict, str)):
                    raise ValueError("response_format.json_schema.schema must be an object")
                found.append(("json_schema",
                              schema if isinstance(schema, str) else json.dumps(schema)))
            elif kind != "text":
                raise ValueError(f"response_format.type must be 'text', 'json_object' or "
                                 f"'json_schema', got {kind!r}")
        if len(found) > 1:
            raise ValueError("give at most one of json_schema, regex, ebnf, choices, "
                             "response_format")
        return found[0] if found else None

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and why. Messages are formatted
        only on failure: every request is validated on the server's intake path."""
        # A field still holding its default object passes its checks (the defaults are
        # valid): skipped by identity, leaving the few a request set (calling ~50
        # checks was a fifth of the stub's Python time per request taken in).
        values, defaults = self.__dict__, _defaults(type(self))
        for name, ok, kind in _FIELD_TYPE_CHECKS:
            value = values[name]
            if value is not defaults[name] and not ok(value):
                raise ValueError(f"{_WIRE_NAMES.get(name, name)} must be {kind}, "
                                 f"got {value!r}")
        for name, ok, requirement in _RANGE_CHECKS:
            value = values[name]
            if value is not None and value is not defaults[name] and not ok(value):
                raise ValueError(f"{_WIRE_NAMES.get(name, name)} must be {requirement}, "
                                 f"got {value}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_new_tokens}) must be <= max_tokens "
                             f"({self.max_new_tokens})")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if not (_is_int(self.logprob_start_len) and self.logprob_start_len >= 0):
            raise ValueError(f"logprob_start_len must be an integer >= 0, "
                             f"got {self.logprob_start_len!r}")
        self._validate_logit_bias()
        for pattern in self.stop_regex:
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular "
                                 f"expression: {exc}") from None
            if compiled.search("") is not None:
                raise ValueError(f"stop_regex {pattern!r} matches the empty string, so it "
                                 "would stop every output at once")
        self.constraint  # raises on conflicting or malformed constraints

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
            if not (_is_number(bias) and low <= bias <= high):
                raise ValueError(f"logit_bias values must be numbers in [{low:g}, {high:g}], "
                                 f"got {bias!r} for token {token}")


def _token_key(key) -> int:
    """A logit_bias key: an int, or a string of one (JSON object keys are strings)."""
    if _is_int(key):
        return key
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key.strip()):
        return int(key)
    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")


@functools.lru_cache(maxsize=None)
def _defaults(cls) -> dict[str, Any]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


@functools.lru_cache(maxsize=None)
def _field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))
