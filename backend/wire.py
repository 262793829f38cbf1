"""The server side of the wire contract: tensor names, parameter keys, request parsing.

Follows Triton's vLLM backend, so its clients (and Triton's OpenAI-compatible frontend)
work unchanged: ``text_output`` always; ``finish_reason``, ``cumulative_logprob``,
``logprobs``, ``num_input_tokens`` and ``num_output_tokens`` only when asked. Our own
outputs follow the same rule: an optional output ``X`` is sent when the request's BOOL
input (or request parameter) ``return_X`` is true, or when the request names ``X``
among its requested outputs (an ensemble step names what its output_map takes).
Responses are built by ``backend.wire_outputs``.

Request modes, decided by what the request carries:
  * generation: ``text_input`` (or ``input_ids``) -> one or more responses;
  * scoring:    ``choices`` (JSON list of strings) -> one response with ``choice_scores``;
  * debug:      parameter ``debug: "stats"`` (engine counters and the KV integrity check)
                or ``debug: "flush_cache"`` (drop the unused cached prefixes) -> one
                response with ``stats``;
  * cancel:     parameter ``cancel: <a cancel_token this model sent>`` -> aborts that
                request (how the ensemble stops a request its client cancelled).

The model's config.pbtxt ``parameters`` are read by ``backend.model_config``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from backend.core.limits import RequestLimits
from backend.core.sampling_keys import from_request
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
FINISH_REASON = "finish_reason"
CUMULATIVE_LOGPROB = "cumulative_logprob"
LOGPROBS = "logprobs"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
OUTPUT_IDS = "output_ids"
NUM_CACHED_TOKENS = "num_cached_tokens"
INDEX = "index"
CONTEXT_IDS = "context_ids"
INPUT_TEXT = "input_text"
CANCEL_TOKEN = "cancel_token"
PROMPT_LOGPROBS = "prompt_logprobs"
CHOICE_SCORES = "choice_scores"
STATS = "stats"

# Outputs sent only when asked (return_<name>, or named among the requested outputs):
# vLLM's five, then ours.
VLLM_OPTIONAL_OUTPUTS = (FINISH_REASON, CUMULATIVE_LOGPROB, LOGPROBS, NUM_INPUT_TOKENS,
                         NUM_OUTPUT_TOKENS)
OPTIONAL_OUTPUTS = VLLM_OPTIONAL_OUTPUTS + (OUTPUT_IDS, NUM_CACHED_TOKENS, INDEX, CONTEXT_IDS,
                                            INPUT_TEXT, CANCEL_TOKEN)
RETURN_FLAGS = {f"return_{name}": name for name in OPTIONAL_OUTPUTS}
# Unfinished samples' finish_reason while streaming, as the vLLM backend writes it.
NOT_FINISHED = "None"

# Request parameters (Triton's `parameters`) with a meaning of their own; every other key
# is a sampling key, exactly as inside the `sampling_parameters` JSON. "id" is the request
# id Triton's HTTP generate endpoint passes on as a parameter.
DEBUG = "debug"
DEBUG_STATS = "stats"
DEBUG_FLUSH_CACHE = "flush_cache"
CANCEL = "cancel"
RESERVED_PARAMETERS = frozenset((STREAM, EXCLUDE_INPUT_IN_OUTPUT, DEBUG, CANCEL, "id",
                                 *RETURN_FLAGS))

INPUT_SPECS = tuple({"name": name, "data_type": dtype, "dims": dims, "optional": True}
                    for name, dtype, dims in (
    (TEXT_INPUT, "TYPE_STRING", [1]), (INPUT_IDS, "TYPE_INT64", [-1]),
    (STREAM, "TYPE_BOOL", [1]), (SAMPLING_PARAMETERS, "TYPE_STRING", [1]),
    (EXCLUDE_INPUT_IN_OUTPUT, "TYPE_BOOL", [1]), (CHOICES, "TYPE_STRING", [1]),
    *((flag, "TYPE_BOOL", [1]) for flag in RETURN_FLAGS)))
OUTPUT_SPECS = tuple({"name": name, "data_type": dtype, "dims": dims} for name, dtype, dims in (
    (TEXT_OUTPUT, "TYPE_STRING", [-1]), (FINISH_REASON, "TYPE_STRING", [-1]),
    (CUMULATIVE_LOGPROB, "TYPE_FP32", [-1]), (LOGPROBS, "TYPE_STRING", [-1]),
    (NUM_INPUT_TOKENS, "TYPE_UINT32", [1]), (NUM_OUTPUT_TOKENS, "TYPE_UINT32", [-1]),
    (OUTPUT_IDS, "TYPE_INT32", [-1]), (NUM_CACHED_TOKENS, "TYPE_UINT32", [-1]),
    (INDEX, "TYPE_INT32", [-1]), (CONTEXT_IDS, "TYPE_INT32", [-1]),
    (INPUT_TEXT, "TYPE_STRING", [1]), (CANCEL_TOKEN, "TYPE_STRING", [1]),
    (PROMPT_LOGPROBS, "TYPE_STRING", [1]), (CHOICE_SCORES, "TYPE_STRING", [1]),
    (STATS, "TYPE_STRING", [1])))
INPUT_NAMES = tuple(spec["name"] for spec in INPUT_SPECS)
OUTPUT_NAMES = frozenset(spec["name"] for spec in OUTPUT_SPECS)


class InputError(ValueError):
    """The request is malformed; the message is sent back to that client as is."""


@dataclass(frozen=True)
class GenerateJob:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    prepend_input: bool  # the prompt leads the first text_output (or fills input_text)
    outputs: frozenset[str]  # the optional outputs to send


@dataclass(frozen=True)
class ScoreJob:
    prompt: str | list[int]
    choices: list[str]


@dataclass(frozen=True)
class StatsJob:
    flush_cache: bool = False


@dataclass(frozen=True)
class CancelJob:
    token: str


Job = GenerateJob | ScoreJob | StatsJob | CancelJob


def _scalar(array: np.ndarray, name: str, kinds: str, what: str) -> Any:
    if array.size != 1:
        raise InputError(f"'{name}' must hold exactly one element, got shape {list(array.shape)}")
    if array.dtype.kind not in kinds:
        raise InputError(f"'{name}' must be {what}, got data of type {array.dtype}")
    return array.reshape(-1)[0]


def _text(array: np.ndarray, name: str) -> str:
    value = _scalar(array, name, "OSU", "a string (BYTES)")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"'{name}' is not valid UTF-8") from exc
    if not isinstance(value, str):
        raise InputError(f"'{name}' must be a string, got {value!r}")
    return value


def _flag(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any], name: str) -> bool | None:
    if name in inputs:
        return bool(_scalar(inputs[name], name, "b", "a BOOL"))
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


def _prompt(inputs: Mapping[str, np.ndarray], allow_empty: bool = False) -> str | list[int]:
    if TEXT_INPUT in inputs and INPUT_IDS in inputs:
        raise InputError(f"give either '{TEXT_INPUT}' or '{INPUT_IDS}', not both")
    if INPUT_IDS in inputs:
        ids = inputs[INPUT_IDS]
        if ids.dtype.kind not in "iu":
            raise InputError(f"'{INPUT_IDS}' must be INT64 token ids, got {ids.dtype}")
        if ids.ndim != 1 or ids.size == 0:
            raise InputError(f"'{INPUT_IDS}' must be a non-empty 1-D list of token ids")
        if int(ids.min()) < 0:
            raise InputError(f"'{INPUT_IDS}' holds a negative token id ({int(ids.min())})")
        return ids.tolist()  # Python ints; ~10x faster than converting one by one
    if TEXT_INPUT not in inputs:
        if allow_empty:
            return ""
        raise InputError(f"missing input '{TEXT_INPUT}' (or '{INPUT_IDS}')")
    text = _text(inputs[TEXT_INPUT], TEXT_INPUT)
    if not text and not allow_empty:
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


def _outputs(inputs, parameters, requested: frozenset[str] | None) -> frozenset[str]:
    """The optional outputs a request asked for. Triton reports every output as
    requested when a request names none, so only a request naming some of them (not
    all) asks for outputs by name."""
    asked = {name for flag, name in RETURN_FLAGS.items() if _flag(inputs, parameters, flag)}
    if requested is not None and not requested >= OUTPUT_NAMES:
        asked |= requested & set(OPTIONAL_OUTPUTS)
    return frozenset(asked)


def _special(parameters: Mapping[str, Any]) -> Job | None:
    if DEBUG in parameters:
        value = parameters[DEBUG]
        if value not in (DEBUG_STATS, DEBUG_FLUSH_CACHE):
            raise InputError(f"parameter '{DEBUG}' must be '{DEBUG_STATS}' or "
                             f"'{DEBUG_FLUSH_CACHE}', got {value!r}")
        return StatsJob(flush_cache=value == DEBUG_FLUSH_CACHE)
    if CANCEL in parameters:
        if not isinstance(parameters[CANCEL], str):
            raise InputError(f"parameter '{CANCEL}' must be a cancel_token string")
        return CancelJob(parameters[CANCEL])
    return None


def parse_request(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any],
                  requested: frozenset[str] | None = None,
                  limits: RequestLimits | None = None) -> Job:
    """Turn one request's tensors and parameters into a job; raises ``InputError``.
    ``requested``: the output names the request names (None: none named)."""
    return RequestParser(limits or RequestLimits(), remembered=0).parse(
        inputs, parameters, requested)


class RequestParser:
    """``parse_request`` for one model instance, remembering the sampling parameters of
    up to ``remembered`` recent requests. A burst from one client repeats the same keys
    request after request, and building and validating ``SamplingParams`` was the larger
    part of the stub's Python per request taken in. Only parameters whose values are all
    scalars are remembered, by key, type and value (``0`` and ``False`` stay apart); a
    request whose parameters fail is refused with the same message every time. The
    engine never changes a request's ``SamplingParams`` (the samples of a request share
    one already), so requests may share one."""

    def __init__(self, limits: RequestLimits, remembered: int = 256) -> None:
        self.limits = limits
        self._remembered = remembered
        self._params: dict[tuple, SamplingParams] = {}

    def parse(self, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any],
              requested: frozenset[str] | None = None) -> Job:
        special = _special(parameters)
        if special is not None:
            return special
        if CHOICES in inputs:
            choices = _json(_text(inputs[CHOICES], CHOICES), CHOICES)
            if not (isinstance(choices, list) and choices
                    and all(isinstance(c, str) and c for c in choices)):
                raise InputError(f"'{CHOICES}' must be a JSON list of non-empty strings")
            try:
                self.limits.check_choices(choices)
            except ValueError as exc:
                raise InputError(str(exc)) from exc
            return ScoreJob(prompt=_prompt(inputs, allow_empty=True), choices=choices)
        prompt = _prompt(inputs)
        stream = bool(_flag(inputs, parameters, STREAM))
        exclude = _flag(inputs, parameters, EXCLUDE_INPUT_IN_OUTPUT)
        # vLLM-backend default: a streamed answer leaves the prompt out, a whole one has it.
        prepend_input = (not stream) if exclude is None else not exclude
        outputs = _outputs(inputs, parameters, requested)
        # A stream's text is only what is new; the prompt can come in input_text instead
        # (of the first response), which is how an echo of a prompt of ids gets its text.
        # Only a request that asks for it by its flag: an ensemble names every output.
        if stream and prepend_input and not _flag(inputs, parameters, f"return_{INPUT_TEXT}"):
            raise InputError(f"when streaming, {EXCLUDE_INPUT_IN_OUTPUT} = false is not "
                             f"allowed (except with return_{INPUT_TEXT})")
        try:
            params = self._sampling_params(_sampling_dict(inputs, parameters),
                                           CUMULATIVE_LOGPROB in outputs)
        except (ValueError, TypeError) as exc:
            raise InputError(str(exc)) from exc
        if stream and params.num_samples > params.n:
            raise InputError(f"best_of ({params.best_of}) > n ({params.n}) is not supported "
                             "when streaming: the best samples are known only at the end")
        return GenerateJob(prompt=prompt, params=params, stream=stream,
                           prepend_input=prepend_input, outputs=outputs)

    def _sampling_params(self, merged: dict, cumulative: bool) -> SamplingParams:
        if not self._remembered:
            return self._checked_params(merged, cumulative)
        key = (cumulative, *((k, v.__class__, v) for k, v in merged.items()))
        try:
            params = self._params.get(key)
        except TypeError:  # a list or an object among the values: not remembered
            return self._checked_params(merged, cumulative)
        if params is None:
            params = self._checked_params(merged, cumulative)
            if len(self._params) >= self._remembered:
                self._params.clear()  # a client varying its values: start over
            self._params[key] = params
        return params

    def _checked_params(self, merged: dict, cumulative: bool) -> SamplingParams:
        params = from_request(merged)
        if cumulative:
            params = dataclasses.replace(params, cumulative_logprob=True)
        self.limits.check(params)
        return params
