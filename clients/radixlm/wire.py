"""The `llm` model's wire contract (client side): tensor names, keys, and request/response codecs.

The server writes the same contract once in ``backend/wire.py``; a test checks that the two
agree. Nothing here imports tritonclient: requests are lists of ``(name, datatype, array)``
and responses are read through a ``get(name) -> np.ndarray | None`` function, so the sync
client, the asyncio client and tests share one codec.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

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

# Outputs: name -> datatype.
TEXT_OUTPUT = "text_output"
OUTPUT_IDS = "output_ids"
FINISH_REASON = "finish_reason"
CUMULATIVE_LOGPROB = "cumulative_logprob"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
NUM_CACHED_TOKENS = "num_cached_tokens"
INDEX = "index"
LOGPROBS = "logprobs"
PROMPT_LOGPROBS = "prompt_logprobs"
INPUT_TEXT = "input_text"
CHOICE_SCORES = "choice_scores"
OUTPUTS = {
    TEXT_OUTPUT: "BYTES",
    OUTPUT_IDS: "INT32",
    FINISH_REASON: "BYTES",
    CUMULATIVE_LOGPROB: "FP32",
    NUM_INPUT_TOKENS: "UINT32",
    NUM_OUTPUT_TOKENS: "UINT32",
    NUM_CACHED_TOKENS: "UINT32",
    INDEX: "INT32",
    LOGPROBS: "BYTES",
    PROMPT_LOGPROBS: "BYTES",
    INPUT_TEXT: "BYTES",
    CHOICE_SCORES: "BYTES",
}
# The server sends an optional output X only when the request's BOOL input return_X is
# true: these are the ones every generation request asks for (logprobs when wanted).
ALWAYS_RETURNED = (FINISH_REASON, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS, OUTPUT_IDS,
                   NUM_CACHED_TOKENS, INDEX)
RETURN_FLAGS = {f"return_{name}": name for name in (*ALWAYS_RETURNED, LOGPROBS,
                                                     CUMULATIVE_LOGPROB, INPUT_TEXT)}
INPUTS = {
    TEXT_INPUT: ("BYTES", [1]),
    INPUT_IDS: ("INT64", [-1]),
    STREAM: ("BOOL", [1]),
    SAMPLING_PARAMETERS: ("BYTES", [1]),
    EXCLUDE_INPUT_IN_OUTPUT: ("BOOL", [1]),
    CHOICES: ("BYTES", [1]),
    **{flag: ("BOOL", [1]) for flag in RETURN_FLAGS},
}

# Keys of the ``sampling_parameters`` JSON object the server accepts (vLLM's, plus
# SGLang's ``stop_regex`` and ``logprob_start_len`` and our constraint keys).
SAMPLING_KEYS = frozenset({
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop",
    "stop_token_ids", "stop_regex", "include_stop_str_in_output", "ignore_eos", "n",
    "best_of", "logprobs", "prompt_logprobs", "logprob_start_len", "skip_special_tokens",
    "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens", "json_schema", "regex", "ebnf", "choices", "response_format",
    "structured_outputs", "guided_decoding", "lora_name",
})
FINISH_REASONS = ("stop", "length", "abort")
NOT_FINISHED = "None"  # finish_reason of a sample still running
CHOICE_SCORE_KEYS = ("choice", "logprob_sum", "num_tokens", "normalized_logprob",
                     "token_logprobs", "token_ids")

# Request parameter of the server's debug requests; "flush_cache" empties its prefix cache.
DEBUG_PARAM = "debug"
FLUSH_CACHE = "flush_cache"
# Debug requests are administrative: the server admits them with its admin token, which
# the clients take from this environment variable (the one the server reads) when set.
ADMIN_TOKEN_ENV = "RADIXLM_ADMIN_TOKEN"
ADMIN_TOKEN_PARAM = "radixlm-admin-token"


def flush_cache_parameters(environ: Mapping[str, str]) -> dict[str, str]:
    """The request parameters of a cache flush, with the admin token where one is set."""
    token = environ.get(ADMIN_TOKEN_ENV)
    return {DEBUG_PARAM: FLUSH_CACHE, **({ADMIN_TOKEN_PARAM: token} if token else {})}

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
                   stream: bool = False, choices: Sequence[str] | None = None, *,
                   prompt_text: bool = False) -> list[Tensor]:
    """Tensors of one request: a generation, or a scoring request when ``choices`` is given.
    ``prompt_text``: the first response also carries the prompt as text (``input_text``;
    of a prompt of ids, the server's detokenization of it)."""
    params = params or {}
    if isinstance(prompt, str):
        tensors = [_bytes_tensor(TEXT_INPUT, prompt)]
    else:
        tensors = [(INPUT_IDS, "INT64", np.asarray(list(prompt), dtype=np.int64))]
    tensors.append((STREAM, "BOOL", np.array([bool(stream)], dtype=bool)))
    tensors.append(_bytes_tensor(SAMPLING_PARAMETERS, sampling_json(params)))
    tensors.append((EXCLUDE_INPUT_IN_OUTPUT, "BOOL", np.array([not prompt_text], dtype=bool)))
    for flag in return_flags(params, prompt_text):
        tensors.append((flag, "BOOL", np.array([True], dtype=bool)))
    if choices is not None:
        choices = list(choices)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        tensors.append(_bytes_tensor(CHOICES, json.dumps(choices)))
    return tensors


def return_flags(params: dict[str, Any], prompt_text: bool = False) -> list[str]:
    """The return_* inputs of a generation request with these sampling parameters."""
    names = list(ALWAYS_RETURNED)
    if params.get("logprobs") is not None:
        names.append(LOGPROBS)
    if prompt_text:
        names.append(INPUT_TEXT)
    return [f"return_{name}" for name in names]


def _texts(get: Callable[[str], np.ndarray | None], name: str) -> list[str]:
    array = get(name)
    if array is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


def _ints(get: Callable[[str], np.ndarray | None], name: str) -> list[int]:
    array = get(name)
    return [int(v) for v in array.reshape(-1)] if array is not None else []


def _text(get: Callable[[str], np.ndarray | None], name: str) -> str:
    values = _texts(get, name)
    return values[0] if values else ""


def _json(text: str) -> Any:
    return json.loads(text) if text else None


def decode_chunks(get: Callable[[str], np.ndarray | None]) -> list[Chunk]:
    """The chunks of one response: one, or one per sample when the server sent all the
    samples of a request in one response (text_output then holds one entry per sample,
    output_ids the samples' ids back to back, num_output_tokens where each ends)."""
    texts = _texts(get, TEXT_OUTPUT) or [""]
    ids = _ints(get, OUTPUT_IDS)
    reasons = ["" if r == NOT_FINISHED else r for r in _texts(get, FINISH_REASON)]
    index, num_out, num_cached = (_ints(get, name)
                                  for name in (INDEX, NUM_OUTPUT_TOKENS, NUM_CACHED_TOKENS))
    num_in = _ints(get, NUM_INPUT_TOKENS)
    logprobs = [_json(t) for t in _texts(get, LOGPROBS)]
    prompt_logprobs = _json(_text(get, PROMPT_LOGPROBS))
    prompt_text = _text(get, INPUT_TEXT) or None  # asked for: "" after the first response
    merged = len(texts) > 1

    def at(values: list, i: int, default):
        return values[i] if i < len(values) else default

    chunks, start = [], 0
    for i, text in enumerate(texts):
        count = at(num_out, i, 0)
        own_ids = ids[start:start + count] if merged else ids
        start += count
        chunks.append(Chunk(
            text=text, index=at(index, i, 0), output_ids=tuple(own_ids),
            finish_reason=at(reasons, i, ""), num_input_tokens=at(num_in, 0, 0),
            num_output_tokens=count, num_cached_tokens=at(num_cached, i, 0),
            logprobs=at(logprobs, i, None),
            prompt_logprobs=prompt_logprobs if i == 0 else None,
            prompt_text=prompt_text if i == 0 else None))
    return chunks


def decode_chunk(get: Callable[[str], np.ndarray | None]) -> Chunk:
    """The (first) chunk of a response."""
    return decode_chunks(get)[0]


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
        token_ids=tuple(int(x) for x in item.get("token_ids", ())),
    )
