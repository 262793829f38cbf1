"""The server side of the wire contract: tensor names, parameter keys, parsing, encoding.

Follows Triton's vLLM-backend conventions so existing clients work unchanged. Requests
come in as plain numpy arrays plus the request's ``parameters`` dict (``model.py`` pulls
them out of pb_utils objects); responses go out as ``{tensor name: numpy array}``.

Request modes, decided by what the request carries:
  * generation: ``text_input`` (or ``input_ids``) -> one or more responses;
  * scoring:    ``choices`` (JSON list of strings) -> one response with ``choice_scores``;
  * debug:      request parameter ``debug: "stats"`` -> one response with ``stats``
                (engine counters plus the KV integrity check, as JSON).

The model's config.pbtxt ``parameters`` are read by ``backend.model_config``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from backend.core.sampling_params import SamplingParams

# Inputs
TEXT_INPUT = "text_input"
INPUT_IDS = "input_ids"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
CHOICES = "choices"

# Outputs
TEXT_OUTPUT = "text_output"
OUTPUT_IDS = "output_ids"
FINISH_REASON = "finish_reason"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
NUM_CACHED_TOKENS = "num_cached_tokens"
INDEX = "index"
LOGPROBS = "logprobs"
CHOICE_SCORES = "choice_scores"
CONTEXT_IDS = "context_ids"
STATS = "stats"

# Request parameters (Triton's `parameters` field) with a meaning of their own; every
# other key is a sampling parameter, exactly as inside the `sampling_parameters` JSON.
DEBUG = "debug"
DEBUG_STATS = "stats"
RESERVED_PARAMETERS = (STREAM, EXCLUDE_INPUT_IN_OUTPUT, DEBUG)

INPUT_SPECS = tuple({"name": name, "data_type": dtype, "dims": dims, "optional": True}
                    for name, dtype, dims in (
    (TEXT_INPUT, "TYPE_STRING", [1]), (INPUT_IDS, "TYPE_INT32", [-1]),
    (STREAM, "TYPE_BOOL", [1]), (SAMPLING_PARAMETERS, "TYPE_STRING", [1]),
    (EXCLUDE_INPUT_IN_OUTPUT, "TYPE_BOOL", [1]), (CHOICES, "TYPE_STRING", [1])))
OUTPUT_SPECS = tuple({"name": name, "data_type": dtype, "dims": [-1]} for name, dtype in (
    (TEXT_OUTPUT, "TYPE_STRING"), (OUTPUT_IDS, "TYPE_INT32"), (FINISH_REASON, "TYPE_STRING"),
    (NUM_INPUT_TOKENS, "TYPE_INT32"), (NUM_OUTPUT_TOKENS, "TYPE_INT32"),
    (NUM_CACHED_TOKENS, "TYPE_INT32"), (INDEX, "TYPE_INT32"), (LOGPROBS, "TYPE_STRING"),
    (CHOICE_SCORES, "TYPE_STRING"), (CONTEXT_IDS, "TYPE_INT32"), (STATS, "TYPE_STRING")))
INPUT_NAMES = tuple(spec["name"] for spec in INPUT_SPECS)


class InputError(ValueError):
    """The request is malformed; the message is sent back to that client as is."""


@dataclass(frozen=True)
class GenerateJob:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    prepend_input: bool  # put the prompt text in front of the first text_output


@dataclass(frozen=True)
class ScoreJob:
    prompt: str | list[int]
    choices: list[str]


@dataclass(frozen=True)
class StatsJob:
    pass


Job = GenerateJob | ScoreJob | StatsJob


def _scalar(array: np.ndarray, name: str, kinds: str) -> Any:
    if array.size != 1:
        raise InputError(f"'{name}' must hold exactly one element, got shape {list(array.shape)}")
    if array.dtype.kind not in kinds:
        raise InputError(f"'{name}' has the wrong data type {array.dtype}")
    return array.reshape(-1)[0]


def _text(array: np.ndarray, name: str) -> str:
    value = _scalar(array, name, "OSU")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"'{name}' is not valid UTF-8") from exc
    return str(value)


def _flag(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any], name: str) -> bool | None:
    if name in inputs:
        return bool(_scalar(inputs[name], name, "b"))
    if name in parameters:
        value = parameters[name]
        if not isinstance(value, bool):
            raise InputError(f"parameter '{name}' must be a boolean, got {value!r}")
        return value
    return None


def _json(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"'{name}' is not valid JSON: {exc}") from exc


def _prompt(inputs: Mapping[str, np.ndarray]) -> str | list[int]:
    if TEXT_INPUT in inputs and INPUT_IDS in inputs:
        raise InputError(f"give either '{TEXT_INPUT}' or '{INPUT_IDS}', not both")
    if INPUT_IDS in inputs:
        ids = inputs[INPUT_IDS]
        if ids.dtype.kind not in "iu":
            raise InputError(f"'{INPUT_IDS}' must be INT32, got {ids.dtype}")
        if ids.ndim != 1 or ids.size == 0:
            raise InputError(f"'{INPUT_IDS}' must be a non-empty 1-D list of token ids")
        if int(ids.min()) < 0:
            raise InputError(f"'{INPUT_IDS}' holds a negative token id")
        return ids.tolist()  # Python ints; ~10x faster than converting one by one
    if TEXT_INPUT not in inputs:
        raise InputError(f"missing input '{TEXT_INPUT}' (or '{INPUT_IDS}')")
    text = _text(inputs[TEXT_INPUT], TEXT_INPUT)
    if not text:
        raise InputError(f"'{TEXT_INPUT}' is empty")
    return text


def _sampling_dict(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any]) -> dict:
    merged = {k: v for k, v in parameters.items() if k not in RESERVED_PARAMETERS}
    if SAMPLING_PARAMETERS in inputs:
        text = _text(inputs[SAMPLING_PARAMETERS], SAMPLING_PARAMETERS)
        data = _json(text, SAMPLING_PARAMETERS) if text.strip() else {}
        if not isinstance(data, dict):
            raise InputError(f"'{SAMPLING_PARAMETERS}' must be a JSON object")
        merged.update(data)  # the tensor wins over plain request parameters
    return merged


def parse_request(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any]) -> Job:
    """Turn one request's tensors and parameters into a job; raises ``InputError``."""
    if DEBUG in parameters:
        if parameters[DEBUG] != DEBUG_STATS:
            raise InputError(f"parameter '{DEBUG}' must be '{DEBUG_STATS}'")
        return StatsJob()
    prompt = _prompt(inputs)
    if CHOICES in inputs:
        choices = _json(_text(inputs[CHOICES], CHOICES), CHOICES)
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) and c for c in choices)):
            raise InputError(f"'{CHOICES}' must be a JSON list of non-empty strings")
        return ScoreJob(prompt=prompt, choices=choices)
    stream = bool(_flag(inputs, parameters, STREAM))
    exclude = _flag(inputs, parameters, EXCLUDE_INPUT_IN_OUTPUT)
    # vLLM-backend default: a streamed answer leaves the prompt out, a whole one has it.
    prepend_input = (not stream) if exclude is None else not exclude
    try:
        params = SamplingParams.from_dict(_sampling_dict(inputs, parameters))
    except (ValueError, TypeError) as exc:
        raise InputError(str(exc)) from exc
    return GenerateJob(prompt=prompt, params=params, stream=stream, prepend_input=prepend_input)


# ---- encoding -------------------------------------------------------------------------

def _bytes(*values: str) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def _int32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def logprobs_json(logprobs: list) -> str:
    """[{token_id, logprob, top_logprobs: {id: logprob}}] for core.TokenLogprob items."""
    return json.dumps([
        {"token_id": lp.token_id, "logprob": lp.logprob,
         "top_logprobs": {str(k): v for k, v in (lp.top or {}).items()}}
        for lp in logprobs
    ])


def generation_outputs(*, text: str, token_ids: list[int], context_ids: list[int],
                       finish_reason: str | None, num_input_tokens: int,
                       num_output_tokens: int, num_cached_tokens: int, index: int,
                       logprobs: list | None,
                       wanted: frozenset[str] | None = None) -> dict[str, np.ndarray]:
    """The response tensors; with ``wanted`` (the outputs the client asked for) only
    those are built (a streamed response is built once per token)."""
    makers = {
        TEXT_OUTPUT: lambda: _bytes(text),
        OUTPUT_IDS: lambda: np.asarray(token_ids, dtype=np.int32),
        FINISH_REASON: lambda: _bytes(finish_reason or ""),
        NUM_INPUT_TOKENS: lambda: _int32(num_input_tokens),
        NUM_OUTPUT_TOKENS: lambda: _int32(num_output_tokens),
        NUM_CACHED_TOKENS: lambda: _int32(num_cached_tokens),
        INDEX: lambda: _int32(index),
        CONTEXT_IDS: lambda: np.asarray(context_ids, dtype=np.int32),
    }
    if logprobs is not None:
        makers[LOGPROBS] = lambda: _bytes(logprobs_json(logprobs))
    return {name: make() for name, make in makers.items() if wanted is None or name in wanted}


def merge_samples(payloads: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One response for several samples: every output concatenated in sample order
    (text_output, finish_reason, index, counts: one entry per sample; output_ids: the
    samples' ids back to back, num_output_tokens tells where each ends; context_ids: the
    ids before every sample's first output, i.e. the prompt's tail, shared by all;
    logprobs: a JSON list with one list per sample)."""
    if len(payloads) == 1:
        return payloads[0]
    merged = {name: np.concatenate([p[name] for p in payloads])
              for name in payloads[0] if name not in (LOGPROBS, CONTEXT_IDS)}
    if CONTEXT_IDS in payloads[0]:
        merged[CONTEXT_IDS] = payloads[0][CONTEXT_IDS]  # the prompt's tail: the same for all
    if LOGPROBS in payloads[0]:
        merged[LOGPROBS] = _bytes(json.dumps([json.loads(p[LOGPROBS][0]) for p in payloads]))
    return merged


def score_outputs(choice_scores: list, num_input_tokens: int,
                  num_cached_tokens: int) -> dict[str, np.ndarray]:
    scores = [{"choice": s.choice, "logprob_sum": s.logprob_sum, "num_tokens": s.num_tokens,
               "normalized_logprob": s.normalized_logprob,
               "token_logprobs": list(s.token_logprobs)} for s in choice_scores]
    return {
        CHOICE_SCORES: _bytes(json.dumps(scores)),
        FINISH_REASON: _bytes("stop"),
        NUM_INPUT_TOKENS: _int32(num_input_tokens),
        NUM_CACHED_TOKENS: _int32(num_cached_tokens),
    }


def stats_outputs(stats: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {STATS: _bytes(json.dumps(dict(stats), default=str))}
