"""Engine chunks -> OpenAI response bodies: choices, usage and logprobs.

Choice indexes: prompt ``p`` of a request with ``n`` samples per prompt owns choices
``p * n .. p * n + n - 1`` (OpenAI's order for a list of prompts).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .. import logprobs
from ..results import Chunk
from .errors import server_error, unavailable


@dataclass
class Sample:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # the engine's entries, one a token
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_output_tokens: int = 0

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.output_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        # each response counts its own tokens (an EOS that has no text included)
        self.num_output_tokens += chunk.num_output_tokens
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason


@dataclass
class PromptUsage:
    """What one engine request said of its prompt: its tokens once, the cached tokens of
    the sample that prefilled (the other samples of n > 1 reuse its prefill), and, when
    asked (an echo), its text and its logprobs (the engine's prompt entries)."""

    prompt_tokens: int = 0
    cached_tokens: int | None = None
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        if chunk.num_input_tokens:
            self.prompt_tokens = chunk.num_input_tokens
            cached = chunk.num_cached_tokens
            self.cached_tokens = cached if self.cached_tokens is None else min(self.cached_tokens, cached)
        if chunk.prompt_text is not None:
            self.text = chunk.prompt_text
        if chunk.prompt_logprobs:
            self.logprobs = chunk.prompt_logprobs


def usage(prompts: list[PromptUsage], samples: list[Sample]) -> dict[str, Any]:
    prompt_tokens = sum(p.prompt_tokens for p in prompts)
    completion_tokens = sum(s.num_output_tokens for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens or 0 for p in prompts)}}


def finish_reason(reason: str) -> str:
    """The engine's reason as OpenAI's; an answer the engine aborted by itself (it is
    shutting down) is an error, not a short answer."""
    if reason == "abort" or not reason:
        raise unavailable("the engine ended the request early (abort); try again")
    return reason


DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(id_: str, object_: str, model: str, created: int | None = None) -> dict:
    return {"id": id_, "object": object_, "created": created or int(time.time()), "model": model}


# ---- logprobs ------------------------------------------------------------------------
# The engine's entries are vLLM's: per token, {token id: {logprob, rank, decoded_token}}
# for the chosen token and the asked number of best alternatives, each with its text.

def _parsed(items: list[dict], ids: list[int], top: int):
    try:
        return logprobs.parse(items, ids, top, True, "logprobs")
    except ValueError as exc:
        raise server_error(f"the engine's logprobs cannot be read: {exc}") from exc


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(items: list[dict], ids: list[int], top: int) -> dict:
    parsed = _parsed(items, ids, top)
    content = []
    for token, alternatives in zip(parsed.tokens, parsed.top):
        entry = _entry(token.text, token.logprob)
        entry["top_logprobs"] = [_entry(t.text, t.logprob) for t in alternatives]
        content.append(entry)
    return {"content": content}


def completion_logprobs(items: list[dict], ids: list[int], top: int,
                        offset: int = 0) -> dict:
    parsed = _parsed(items, ids, top)
    tokens, values, tops, offsets = [], [], [], []
    for token, alternatives in zip(parsed.tokens, parsed.top):
        tokens.append(token.text)
        values.append(token.logprob)
        # a prompt's first position has no logprob and no alternatives
        known = top and token.logprob is not None
        tops.append({t.text: t.logprob for t in alternatives} if known else None)
        offsets.append(offset)
        offset += len(token.text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
