"""POST /v1/completions: a whole answer, or server-sent chunks.

``echo`` puts the prompt before each choice's text, as the engine has it (a prompt of
token ids as the engine's detokenizer writes it); with ``logprobs`` the choice's logprobs
then start with the prompt's, the first position null, which is what evaluation harnesses
read to score a continuation. ``max_tokens`` 0 (with ``echo``) answers with the prompt
alone.
"""
from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator

from fastapi import Request

from . import params
from ..results import Chunk
from .engine import Engine
from .errors import OpenAIError
from .generation import collect, merged, primed, unless_disconnected
from .protocol import CompletionRequest
from .responses import (DONE, PromptUsage, Sample, completion_logprobs, envelope,
                        finish_reason, new_id, sse, usage)


async def run(engine: Engine, body: CompletionRequest, settings,
              request: Request) -> dict | AsyncIterator[str]:
    prompts = params.completion_prompts(body)
    wire_params = params.completion_params(body, settings.default_max_tokens)
    flow = merged(engine, prompts, wire_params, prompt_text=body.echo)
    head = envelope(new_id("cmpl"), "text_completion", body.model)
    if body.stream:
        flow = await unless_disconnected(request, primed(flow))
        return _chunks(body, len(prompts), flow, head)
    usages, samples = await unless_disconnected(
        request, collect(_answered(body, flow), len(prompts), body.n))
    choices = []
    for index, sample in enumerate(samples):
        prompt = usages[index // body.n]  # its text is "" unless echoed
        text = "".join(sample.text)
        logprobs = _logprobs(body, sample.logprobs, sample.token_ids, len(prompt.text))
        if body.echo:
            text = prompt.text + text
            logprobs = _echoed(body, prompt, logprobs)
        choices.append({"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": finish_reason(sample.finish_reason)})
    return {**head, "choices": choices, "usage": usage(usages, samples)}


async def _answered(body: CompletionRequest, flow):
    """The flow, with the one token a prompt-only request (``max_tokens`` 0) generated
    taken out of its chunks. Closing it closes the flow (which cancels the engine's)."""
    async with contextlib.aclosing(flow) as chunks:
        async for prompt_index, chunk in chunks:
            if body.max_tokens == 0:
                chunk = _prompt_only(chunk)
            yield prompt_index, chunk


def _prompt_only(chunk: Chunk) -> Chunk:
    reason = chunk.finish_reason
    if reason and reason != "abort":
        reason = "length"  # the answer ends where max_tokens put it, whatever the token was
    return chunk._replace(text="", output_ids=(), num_output_tokens=0, logprobs=None,
                          finish_reason=reason)


def _logprobs(body: CompletionRequest, items: list[dict], ids: list[int],
              offset: int = 0) -> dict | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(items, ids, body.logprobs, offset)


def _echoed(body: CompletionRequest, prompt: PromptUsage, generated: dict | None) -> dict | None:
    """A choice's logprobs behind the prompt's (positions from 0, the first null)."""
    if body.logprobs is None:
        return None
    ids = [entry["token_id"] for entry in prompt.logprobs]
    head = completion_logprobs(prompt.logprobs, ids, body.logprobs)
    if generated is None:
        return head
    return {key: head[key] + generated[key] for key in head}


async def _chunks(body: CompletionRequest, num_prompts: int, flow,
                  head: dict) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = body.n
    samples = [Sample() for _ in range(num_prompts * n)]
    usages = [PromptUsage() for _ in range(num_prompts)]
    offsets = [0] * len(samples)
    echoed = [False] * len(samples)
    created = int(time.time())

    def event(index: int, text: str, logprobs=None, reason=None) -> str:
        data = {**head, "created": created, "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    try:
        async for prompt_index, chunk in _answered(body, flow):
            index = prompt_index * n + chunk.index
            if samples[index].finish_reason:  # n > 1: a later response repeating how it ended
                continue
            prompt = usages[prompt_index]
            prompt.add(chunk)
            if body.echo and not echoed[index]:  # the prompt's first chunk carries it
                echoed[index] = True
                offsets[index] = len(prompt.text)
                yield event(index, prompt.text, _echoed(body, prompt, None))
            samples[index].add(chunk)
            reason = finish_reason(chunk.finish_reason) if chunk.finish_reason else None
            logprobs = _logprobs(body, chunk.logprobs or [], list(chunk.output_ids),
                                 offsets[index])
            offsets[index] += len(chunk.text)
            if chunk.text or reason or (logprobs and logprobs["tokens"]):
                yield event(index, chunk.text, logprobs, reason)
        if include_usage:
            yield sse({**head, "created": created, "choices": [],
                       "usage": usage(usages, samples)})
        yield DONE
    except OpenAIError as exc:
        yield sse(exc.body())
        yield DONE
    finally:
        await flow.aclose()
