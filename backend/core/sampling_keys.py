"""The sampling keys clients send (the ``sampling_parameters`` JSON, or Triton request
parameters) -> ``SamplingParams``.

Values are converted to the field's type as Triton's vLLM backend does, so that its
clients work unchanged: ``"0"`` is 0.0 for ``temperature``, ``"100"`` is 100 for
``max_tokens``, ``"true"``/``"false"`` are booleans; a value that does not convert fails
naming the key. vLLM's ``structured_outputs`` / ``guided_decoding`` map onto the engine's
own constraint keys. Only the keys in ``REQUEST_KEYS`` are read: the fields the engine
or the serving layer sets (``prompt_logprobs_start``, ``cumulative_logprob``) cannot be
reached from here.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from .sampling_params import SamplingParams

_INT_KEYS = ("max_tokens", "min_tokens", "top_k", "n", "seed", "best_of", "logprobs",
             "prompt_logprobs", "logprob_start_len", "truncate_prompt_tokens")
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
               "presence_penalty")
_BOOL_KEYS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
              "include_stop_str_in_output")
_OBJECT_KEYS = ("logit_bias", "response_format")  # an object, or a JSON string of one
_AS_IS_KEYS = ("stop", "stop_token_ids", "stop_regex", "allowed_token_ids", "bad_words",
               "json_schema", "regex", "ebnf", "choices")
_STRUCTURED_KEYS = ("structured_outputs", "guided_decoding")
LORA_KEY = "lora_name"
REQUEST_KEYS = frozenset(_INT_KEYS + _FLOAT_KEYS + _BOOL_KEYS + _OBJECT_KEYS + _AS_IS_KEYS
                         + _STRUCTURED_KEYS + (LORA_KEY,))

# vLLM's StructuredOutputsParams field -> our key
_STRUCTURED_FIELDS = {"json": "json_schema", "regex": "regex", "choice": "choices",
                      "grammar": "ebnf"}
# accepted as they change nothing here: xgrammar is the only backend and never falls back
_STRUCTURED_NO_OPS = ("backend", "disable_fallback")
_BACKENDS = ("xgrammar", "xgrammar:no-fallback", "xgrammar:_auto", "auto")
_INTEGER = re.compile(r"\s*[-+]?[0-9]+\s*")


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str) and _INTEGER.fullmatch(value):
        return int(value)
    raise ValueError(f"{key} must be an integer, got {value!r}")


def _to_float(key: str, value: Any) -> float:
    if not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
    raise ValueError(f"{key} must be a number, got {value!r}")


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{key} must be true or false, got {value!r}")


def _to_object(key: str, value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object, got {value!r}")
    return value


_CONVERTERS: dict[str, Callable[[str, Any], Any]] = {
    **{k: _to_int for k in _INT_KEYS}, **{k: _to_float for k in _FLOAT_KEYS},
    **{k: _to_bool for k in _BOOL_KEYS}, **{k: _to_object for k in _OBJECT_KEYS},
}


def _structured(key: str, value: Any) -> dict[str, Any]:
    """vLLM's structured_outputs / guided_decoding object -> our constraint keys."""
    spec = _to_object(key, value)
    out: dict[str, Any] = {}
    for name, item in spec.items():
        if item is None or item is False:
            continue
        if name in _STRUCTURED_FIELDS:
            out[_STRUCTURED_FIELDS[name]] = item
        elif name == "json_object":
            out["response_format"] = {"type": "json_object"}
        elif name == "backend":
            if item not in _BACKENDS:
                raise ValueError(f"{key}.backend must be one of {', '.join(_BACKENDS)} "
                                 f"(the engine's grammars are xgrammar's), got {item!r}")
        elif name not in _STRUCTURED_NO_OPS:
            raise ValueError(f"{key}.{name} is not supported (supported: "
                             f"{', '.join([*_STRUCTURED_FIELDS, 'json_object', 'backend'])})")
    if len(out) > 1:
        raise ValueError(f"{key} must hold one constraint, got {', '.join(sorted(spec))}")
    return out


def from_request(data: dict[str, Any]) -> SamplingParams:
    """A client's sampling keys -> ``SamplingParams``; raises ``ValueError`` naming the
    key and why (unknown keys, values that do not convert, values out of range)."""
    if not isinstance(data, dict):
        raise ValueError("sampling parameters must be a JSON object")
    unknown = sorted(k for k in data if k not in REQUEST_KEYS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    if data.get(LORA_KEY) is not None:
        raise ValueError(f"LoRA feature is not enabled: {LORA_KEY} {data[LORA_KEY]!r} cannot "
                         "be served (this model has no adapters)")
    fields: dict[str, Any] = {}
    for key, value in data.items():
        if value is None or key == LORA_KEY:
            continue
        if key in _STRUCTURED_KEYS:
            for name, item in _structured(key, value).items():
                if name in fields or name in data:
                    raise ValueError(f"{key} and {name} both set a constraint: give one")
                fields[name] = item
            continue
        if key == "logprobs" and isinstance(value, bool):
            # OpenAI chat's logprobs: true/false (true is 1, as vLLM's backend reads it)
            if value:
                fields[key] = 1
            continue
        convert = _CONVERTERS.get(key)
        fields[key] = convert(key, value) if convert is not None else value
    if fields.get("truncate_prompt_tokens") == -1:  # vLLM: -1 keeps the whole prompt
        fields.pop("truncate_prompt_tokens")
    if isinstance(fields.get("json_schema"), dict):
        fields["json_schema"] = json.dumps(fields["json_schema"])
    return SamplingParams.from_dict(fields)
