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

from ..results import Chunk
from .errors import unavailable


@dataclass
class Sample:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str = ""
    num_output_tokens: int = 0

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        # the engine's count is cumulative (and counts an EOS that has no text)
        self.num_output_tokens = max(self.num_output_tokens, chunk.num_output_tokens)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason


@dataclass
class PromptUsage:
    """One engine request's counts: prompt tokens once, cached tokens of the sample that
    prefilled (the other samples of n > 1 reuse its prefill)."""

    prompt_tokens: int = 0
    cached_tokens: int | None = None

    def add(self, chunk: Chunk) -> None:
        if chunk.num_input_tokens:
            self.prompt_tokens = chunk.num_input_tokens
            cached = chunk.num_cached_tokens
            self.cached_tokens = cached if self.cached_tokens is None else min(self.cached_tokens, cached)


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

def token_ids_of(items: list[dict]) -> list[int]:
    """Every id a list of engine logprob entries mentions (to decode them in one call)."""
    ids = []
    for item in items:
        ids.append(int(item["token_id"]))
        ids.extend(int(k) for k in (item.get("top_logprobs") or {}))
    return ids


def _top(item: dict, k: int) -> list[tuple[int, float]]:
    pairs = [(int(t), float(v)) for t, v in (item.get("top_logprobs") or {}).items()]
    return sorted(pairs, key=lambda p: -p[1])[:k]


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(items: list[dict], texts: dict[int, str], top: int) -> dict:
    content = []
    for item in items:
        entry = _entry(texts[int(item["token_id"])], float(item["logprob"]))
        entry["top_logprobs"] = [_entry(texts[t], v) for t, v in _top(item, top)]
        content.append(entry)
    return {"content": content}


def completion_logprobs(items: list[dict], texts: dict[int, str], top: int,
                        offset: int = 0) -> dict:
    tokens, logprobs, tops, offsets = [], [], [], []
    for item in items:
        token = texts[int(item["token_id"])]
        tokens.append(token)
        logprobs.append(float(item["logprob"]))
        tops.append({texts[t]: v for t, v in _top(item, top)} if top else None)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}
