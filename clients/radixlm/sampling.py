"""One gen's parameters (SGLang's names) -> the ``sampling_parameters`` the server reads.

The names differ where the wire follows vLLM (``max_new_tokens`` -> ``max_tokens``,
``min_new_tokens`` -> ``min_tokens``); typed generation becomes a regex; the logprob
options become vLLM's ``logprobs`` and ``prompt_logprobs`` (how many alternatives per
token, 0 for the token's own logprob only) and ``logprob_start_len``.
"""
from __future__ import annotations

import warnings
from typing import Any, NamedTuple

from .ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, GenParams

# dtype -> (regex, extra stop strings)
_TYPED = {
    int: (REGEX_INT, (" ", "\n")),
    float: (REGEX_FLOAT, (" ", "\n")),
    str: (REGEX_STR, ()),
    bool: (REGEX_BOOL, ()),
}
_TYPE_NAMES = {"int": int, "float": float, "str": str, "bool": bool}

# GenParams field -> wire key, for the values sent as they are
_SAME = {
    "min_new_tokens": "min_tokens", "n": "n", "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos", "seed": "seed", "json_schema": "json_schema",
    "ebnf": "ebnf",
}


class WireGen(NamedTuple):
    """A gen as sent, and what to do with the answer."""

    params: dict[str, Any]  # sampling_parameters
    prefill_only: bool  # max_new_tokens=0: one token is generated for its logprobs, then dropped
    return_logprob: bool
    top_logprobs_num: int
    prompt_logprobs: bool  # logprob_start_len was given
    want_text: bool  # return_text_in_logprobs
    n: int


def to_wire(p: GenParams) -> WireGen:
    params = {wire: getattr(p, field) for field, wire in _SAME.items()
              if getattr(p, field) is not None}
    for key in ("stop_token_ids", "stop_regex"):
        if key in params:
            params[key] = list(params[key])
    stop = list(p.stop or ())
    regex = p.regex
    if p.dtype is not None:
        dtype = _TYPE_NAMES.get(p.dtype, p.dtype)
        if regex is not None:
            warnings.warn(f"gen has both dtype={dtype.__name__} and a regex; the dtype is used")
        regex, extra_stop = _TYPED[dtype]
        stop += [s for s in extra_stop if s not in stop]
    if stop:
        params["stop"] = stop
    if regex is not None:
        params["regex"] = regex
    prefill_only = p.max_new_tokens == 0
    if p.max_new_tokens is not None:
        params["max_tokens"] = 1 if prefill_only else p.max_new_tokens
    return_logprob = bool(p.return_logprob)
    top_n = int(p.top_logprobs_num or 0) if return_logprob else 0
    prompt_logprobs = return_logprob and p.logprob_start_len is not None \
        and p.logprob_start_len >= 0
    if return_logprob:
        params["logprobs"] = top_n
    if prompt_logprobs:
        params["prompt_logprobs"] = top_n
        params["logprob_start_len"] = p.logprob_start_len
    return WireGen(params, prefill_only, return_logprob, top_n, prompt_logprobs,
                   bool(p.return_text_in_logprobs) and return_logprob, int(p.n or 1))


# run()/run_batch() keywords that set defaults for every gen (SGLang's, and their wire names)
_RUN_KEYWORDS = {
    **{name: name for name in (
        "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "seed",
        "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")},
    "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
}


def run_defaults(kwargs: dict[str, Any], func_params: set[str]) -> GenParams:
    """Pop the sampling keywords of ``run``/``run_batch`` (those the program function does
    not take itself) into the run's default ``GenParams``."""
    found: dict[str, Any] = {}
    for key in list(kwargs):
        if key in _RUN_KEYWORDS and key not in func_params:
            found[_RUN_KEYWORDS[key]] = kwargs.pop(key)
    for key in ("stop", "stop_token_ids"):
        value = found.get(key)
        if isinstance(value, str):
            found[key] = (value,)
        elif value is not None:
            found[key] = tuple(value) or None  # SGLang's default () means "none"
    return GenParams(**{k: v for k, v in found.items() if v is not None})
