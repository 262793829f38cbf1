"""The `llm` model's wire contract (client side): tensor names, keys, and request/response codecs.

The server writes the same contract once in ``backend/wire.py``; a test checks that the two
agree. Nothing here imports tritonclient: requests are lists of ``(name, datatype, array)``
and responses are read through a ``get(name) -> np.ndarray | None`` function, so the sync
client, the asyncio client and tests share one codec.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import numpy as np

from .results import Chunk, ChoiceScore

MODEL_NAME = "llm"

# Inputs: name -> (datatype, shape).
TEXT_INPUT = "text_input"
INPUT_IDS = "input_ids"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
CHOICES = "choices"
INPUTS = {
    TEXT_INPUT: ("BYTES", [1]),
    INPUT_IDS: ("INT32", [-1]),
    STREAM: ("BOOL", [1]),
    SAMPLING_PARAMETERS: ("BYTES", [1]),
    EXCLUDE_INPUT_IN_OUTPUT: ("BOOL", [1]),
    CHOICES: ("BYTES", [1]),
}

# Outputs: name -> datatype.
TEXT_OUTPUT = "text_output"
OUTPUT_IDS = "output_ids"
FINISH_REASON = "finish_reason"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
NUM_CACHED_TOKENS = "num_cached_tokens"
INDEX = "index"
LOGPROBS = "logprobs"
CHOICE_SCORES = "choice_scores"
OUTPUTS = {
    TEXT_OUTPUT: "BYTES",
    OUTPUT_IDS: "INT32",
    FINISH_REASON: "BYTES",
    NUM_INPUT_TOKENS: "INT32",
    NUM_OUTPUT_TOKENS: "INT32",
    NUM_CACHED_TOKENS: "INT32",
    INDEX: "INT32",
    LOGPROBS: "BYTES",
    CHOICE_SCORES: "BYTES",
}

# Keys of the ``sampling_parameters`` JSON object.
SAMPLING_KEYS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "n", "logprobs", "json_schema", "regex", "ebnf", "choices", "response_format",
    "skip_special_tokens", "prompt_logprobs_start",
})
FINISH_REASONS = ("stop", "length", "abort")
CHOICE_SCORE_KEYS = ("choice", "logprob_sum", "num_tokens", "normalized_logprob",
                     "token_logprobs")

# Response parameter that marks a request's last response (set by Triton itself).
FINAL_RESPONSE_PARAM = "triton_final_response"
# Model config parameters the client reads.
CHAT_TEMPLATE_PARAM = "chat_template"
EOS_TOKEN_PARAM = "eos_token"
BOS_TOKEN_PARAM = "bos_token"

Tensor = tuple[str, str, np.ndarray]


def _bytes_tensor(name: str, text: str) -> Tensor:
    return name, "BYTES", np.array([text.encode("utf-8")], dtype=np.object_)


def sampling_json(params: dict[str, Any]) -> str:
    """Serialize sampling parameters; unknown keys raise ``ValueError`` before any round trip."""
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    clean = {k: v for k, v in params.items() if v is not None}
    if isinstance(clean.get("stop"), str):
        clean["stop"] = [clean["stop"]]
    return json.dumps(clean)


def encode_request(prompt: str | Sequence[int], params: dict[str, Any] | None = None,
                   stream: bool = False, choices: Sequence[str] | None = None) -> list[Tensor]:
    """Tensors of one request: a generation, or a scoring request when ``choices`` is given."""
    if isinstance(prompt, str):
        tensors = [_bytes_tensor(TEXT_INPUT, prompt)]
    else:
        tensors = [(INPUT_IDS, "INT32", np.asarray(list(prompt), dtype=np.int32))]
    tensors.append((STREAM, "BOOL", np.array([bool(stream)], dtype=bool)))
    tensors.append(_bytes_tensor(SAMPLING_PARAMETERS, sampling_json(params or {})))
    tensors.append((EXCLUDE_INPUT_IN_OUTPUT, "BOOL", np.array([True], dtype=bool)))
    if choices is not None:
        choices = list(choices)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        tensors.append(_bytes_tensor(CHOICES, json.dumps(choices)))
    return tensors


def _text(get: Callable[[str], np.ndarray | None], name: str) -> str:
    array = get(name)
    if array is None or array.size == 0:
        return ""
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _int(get: Callable[[str], np.ndarray | None], name: str) -> int:
    array = get(name)
    return int(array.reshape(-1)[0]) if array is not None and array.size else 0


def decode_chunk(get: Callable[[str], np.ndarray | None]) -> Chunk:
    """One streamed (or the only) response of a generation request."""
    ids = get(OUTPUT_IDS)
    logprobs = _text(get, LOGPROBS)
    return Chunk(
        text=_text(get, TEXT_OUTPUT),
        index=_int(get, INDEX),
        output_ids=tuple(int(t) for t in ids.reshape(-1)) if ids is not None else (),
        finish_reason=_text(get, FINISH_REASON),
        num_input_tokens=_int(get, NUM_INPUT_TOKENS),
        num_output_tokens=_int(get, NUM_OUTPUT_TOKENS),
        num_cached_tokens=_int(get, NUM_CACHED_TOKENS),
        logprobs=json.loads(logprobs) if logprobs else None,
    )


def decode_choice_scores(get: Callable[[str], np.ndarray | None]) -> list[ChoiceScore] | None:
    """The scores of a scoring response, in the order the choices were sent (None if absent)."""
    raw = _text(get, CHOICE_SCORES)
    if not raw:
        return None
    return [parse_choice_score(item) for item in json.loads(raw)]


def parse_choice_score(item: dict[str, Any]) -> ChoiceScore:
    num_tokens = int(item["num_tokens"])
    logprob_sum = float(item["logprob_sum"])
    normalized = item.get("normalized_logprob")
    return ChoiceScore(
        choice=item["choice"],
        logprob_sum=logprob_sum,
        num_tokens=num_tokens,
        normalized_logprob=float(normalized) if normalized is not None
        else logprob_sum / max(num_tokens, 1),
        token_logprobs=tuple(float(x) for x in item.get("token_logprobs", ())),
    )
