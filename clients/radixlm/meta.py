"""The meta info a program reads with ``state.get_meta_info(name)``.

A gen's meta info has SGLang's keys (``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``finish_reason`` as ``{"type": "stop" | "length" | "abort", ...}``,
``e2e_latency``; with ``return_logprob`` also ``output_token_logprobs``,
``output_top_logprobs``, ``input_token_logprobs``, ``input_top_logprobs``,
``normalized_prompt_logprob``) and the server's own counters (``output_ids``,
``num_input_tokens``, ``num_output_tokens``, ``num_cached_tokens``, ``index``). With
``n > 1`` it is the first sample's, and ``samples`` lists every sample's.
"""
from __future__ import annotations

from typing import Any

from . import logprobs
from .results import GenerateResult
from .sampling import WireGen


def finish_reason(reason: str, completion_tokens: int) -> dict[str, Any]:
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": reason or "abort"}


def gen_meta(result: GenerateResult, wire: WireGen, latency_s: float) -> dict[str, Any]:
    samples = result.samples or (result,)
    metas = [_sample_meta(s, wire, latency_s) for s in samples]
    meta = dict(metas[0])
    if len(metas) > 1:
        meta["samples"] = metas
    return meta


def _sample_meta(r: GenerateResult, wire: WireGen, latency_s: float) -> dict[str, Any]:
    completion = 0 if wire.prefill_only else r.num_output_tokens
    reason = "length" if wire.prefill_only else r.finish_reason
    meta = {
        "finish_reason": finish_reason(reason, completion),
        "prompt_tokens": r.num_input_tokens,
        "completion_tokens": completion,
        "cached_tokens": r.num_cached_tokens,
        "e2e_latency": latency_s,
        "output_ids": [] if wire.prefill_only else list(r.output_ids),
        "num_input_tokens": r.num_input_tokens,
        "num_output_tokens": completion,
        "num_cached_tokens": r.num_cached_tokens,
        "index": r.index,
    }
    if wire.return_logprob:
        meta.update(_logprob_meta(r, wire))
    return meta


def _logprob_meta(r: GenerateResult, wire: WireGen) -> dict[str, Any]:
    if r.logprobs is None and r.output_ids:
        raise ValueError("output_token_logprobs: the server sent no logprobs")
    out = logprobs.parse(r.logprobs, r.output_ids, wire.top_logprobs_num, wire.want_text,
                         "output_token_logprobs")
    tokens, top = out.tokens, out.top
    if wire.prefill_only:  # the one token was generated only for the next position's top
        tokens, top = [], top[:1]
    meta: dict[str, Any] = {"output_token_logprobs": tokens, "input_token_logprobs": []}
    if wire.top_logprobs_num:
        meta["output_top_logprobs"] = top
    if wire.prompt_logprobs:
        if r.prompt_logprobs is None:
            raise ValueError("input_token_logprobs: logprob_start_len asks for the prompt's "
                             "logprobs, and the server sent none (its 'prompt_logprobs' "
                             "output)")
        prompt = logprobs.parse(r.prompt_logprobs, [], wire.top_logprobs_num, wire.want_text,
                                "input_token_logprobs")
        meta["input_token_logprobs"] = prompt.tokens
        if wire.top_logprobs_num:
            meta["input_top_logprobs"] = prompt.top
        meta["normalized_prompt_logprob"] = logprobs.mean_logprob(prompt.tokens)
    return meta
