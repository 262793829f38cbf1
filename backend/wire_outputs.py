"""Response tensors of the wire contract (names and rules: ``backend.wire``).

A generation response holds one entry per sample in index order (n > 1: every sample,
streamed or not, as the vLLM backend sends them): ``text_output``, ``finish_reason``
("None" while the sample runs), ``cumulative_logprob``, ``logprobs`` (JSON per sample,
"null" when the request asked for none), ``num_output_tokens`` (this response's tokens
when streaming, all of them otherwise), ``num_cached_tokens``, ``index``; ``output_ids``
holds the samples' ids back to back (``num_output_tokens`` tells where each ends);
``num_input_tokens`` is one count for the request.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from backend import wire


@dataclass
class SampleOutput:
    """One sample's part of one response."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None: still running
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: list | None = None  # core TokenLogprob entries; None: none were asked
    cumulative_logprob: float | None = None


def _bytes(*values: str) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def _entry(logprob, rank, text) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": text}


def logprob_positions(entries: list) -> list[dict[str, dict]]:
    """vLLM's shape: per token, ``{token id: {logprob, rank, decoded_token}}`` for the
    chosen token and its alternatives (chosen first)."""
    out = []
    for lp in entries:
        position = {str(lp.token_id): _entry(lp.logprob, lp.rank, lp.text)}
        texts = lp.top_text or {}
        for rank, (tid, value) in enumerate((lp.top or {}).items(), start=1):
            position.setdefault(str(tid), _entry(value, rank, texts.get(tid)))
        out.append(position)
    return out


def prompt_logprobs_json(entries: list) -> str:
    """One entry per prompt position from logprob_start_len on (the first without a
    logprob): ``{token_id, logprob, rank, text, top_logprobs}``, the alternatives in
    vLLM's per-token shape."""
    out = []
    for lp in entries:
        texts = lp.top_text or {}
        top = {str(t): _entry(v, r, texts.get(t))
               for r, (t, v) in enumerate((lp.top or {}).items(), start=1)}
        out.append({"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank,
                    "text": lp.text, "top_logprobs": top})
    return json.dumps(out)


def generation_outputs(samples: list[SampleOutput], *, outputs: frozenset[str],
                       num_input_tokens: int, context_ids: list[int],
                       prompt_logprobs: list | None = None, input_text: str | None = None,
                       cancel_token: str | None = None) -> dict[str, np.ndarray]:
    """The tensors of one response: ``text_output`` and the optional ``outputs`` asked
    for (a streamed response is built once per engine step: only those are built)."""
    tensors = {wire.TEXT_OUTPUT: _bytes(*(s.text for s in samples))}
    for name in outputs:
        make = _MAKERS.get(name)
        if make is not None:
            tensors[name] = make(samples, num_input_tokens, context_ids)
    if wire.INPUT_TEXT in outputs:
        tensors[wire.INPUT_TEXT] = _bytes(input_text or "")
    if wire.CANCEL_TOKEN in outputs:
        tensors[wire.CANCEL_TOKEN] = _bytes(cancel_token or "")
    if prompt_logprobs is not None:
        tensors[wire.PROMPT_LOGPROBS] = _bytes(prompt_logprobs_json(prompt_logprobs))
    return tensors


_MAKERS = {
    wire.FINISH_REASON: lambda s, n, c: _bytes(
        *(x.finish_reason or wire.NOT_FINISHED for x in s)),
    wire.CUMULATIVE_LOGPROB: lambda s, n, c: np.array(
        [np.nan if x.cumulative_logprob is None else x.cumulative_logprob for x in s],
        dtype=np.float32),
    wire.LOGPROBS: lambda s, n, c: _bytes(
        *(json.dumps(None if x.logprobs is None else logprob_positions(x.logprobs))
          for x in s)),
    wire.NUM_INPUT_TOKENS: lambda s, n, c: np.array([n], dtype=np.uint32),
    wire.NUM_OUTPUT_TOKENS: lambda s, n, c: np.array([x.num_output_tokens for x in s],
                                                     dtype=np.uint32),
    wire.OUTPUT_IDS: lambda s, n, c: np.array([t for x in s for t in x.token_ids],
                                              dtype=np.int32),
    wire.NUM_CACHED_TOKENS: lambda s, n, c: np.array([x.num_cached_tokens for x in s],
                                                     dtype=np.uint32),
    wire.INDEX: lambda s, n, c: np.array([x.index for x in s], dtype=np.int32),
    wire.CONTEXT_IDS: lambda s, n, c: np.asarray(c, dtype=np.int32),
}


def score_outputs(choice_scores: list, num_input_tokens: int, num_cached_tokens: int,
                  finish_reason: str = "stop") -> dict[str, np.ndarray]:
    """A scoring request's one response (always these outputs)."""
    scores = [{"choice": s.choice, "logprob_sum": s.logprob_sum, "num_tokens": s.num_tokens,
               "normalized_logprob": s.normalized_logprob,
               "token_logprobs": list(s.token_logprobs), "token_ids": list(s.token_ids)}
              for s in choice_scores]
    return {
        wire.CHOICE_SCORES: _bytes(json.dumps(scores)),
        wire.FINISH_REASON: _bytes(finish_reason),
        wire.NUM_INPUT_TOKENS: np.array([num_input_tokens], dtype=np.uint32),
        wire.NUM_CACHED_TOKENS: np.array([num_cached_tokens], dtype=np.uint32),
    }


def stats_outputs(stats: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {wire.STATS: _bytes(json.dumps(dict(stats), default=str))}


def empty_outputs() -> dict[str, np.ndarray]:
    """The one response to a cancel request."""
    return {wire.TEXT_OUTPUT: _bytes("")}
