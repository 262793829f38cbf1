"""POST /v1/completions: a whole answer, or server-sent chunks."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request

from . import params
from .engine import Engine
from .errors import OpenAIError, bad_request
from .generation import collect, merged, primed, unless_disconnected
from .protocol import CompletionRequest
from .responses import (DONE, PromptUsage, Sample, completion_logprobs, envelope,
                        finish_reason, new_id, sse, usage)


async def run(engine: Engine, body: CompletionRequest, settings,
              request: Request) -> dict | AsyncIterator[str]:
    prompts = params.completion_prompts(body)
    if body.echo and not all(isinstance(p, str) for p in prompts):
        raise bad_request("echo needs text prompts", "echo")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported", "echo")
    wire_params = params.completion_params(body, settings.default_max_tokens)
    flow = merged(engine, prompts, wire_params)
    head = envelope(new_id("cmpl"), "text_completion", body.model)
    if body.stream:
        flow = await unless_disconnected(request, primed(flow))
        return _chunks(body, prompts, flow, head)
    usages, samples = await unless_disconnected(request, collect(flow, len(prompts), body.n))
    choices = []
    for index, sample in enumerate(samples):
        text = "".join(sample.text)
        if body.echo:
            text = prompts[index // body.n] + text
        choices.append({"index": index, "text": text,
                        "logprobs": _logprobs(body, sample.logprobs, sample.token_ids),
                        "finish_reason": finish_reason(sample.finish_reason)})
    return {**head, "choices": choices, "usage": usage(usages, samples)}


def _logprobs(body: CompletionRequest, items: list[dict], ids: list[int],
              offset: int = 0) -> dict | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(items, ids, body.logprobs, offset)


async def _chunks(body: CompletionRequest, prompts: list, flow,
                  head: dict) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = body.n
    samples = [Sample() for _ in range(len(prompts) * n)]
    usages = [PromptUsage() for _ in prompts]
    offsets = [0] * len(samples)
    created = int(time.time())

    def event(index: int, text: str, logprobs=None, reason=None) -> str:
        data = {**head, "created": created, "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    try:
        if body.echo:
            for index in range(len(samples)):
                yield event(index, prompts[index // n])
        async for prompt_index, chunk in flow:
            usages[prompt_index].add(chunk)
            index = prompt_index * n + chunk.index
            samples[index].add(chunk)
            reason = finish_reason(chunk.finish_reason) if chunk.finish_reason else None
            logprobs = _logprobs(body, chunk.logprobs or [], list(chunk.output_ids),
                                 offsets[index])
            offsets[index] += len(chunk.text)
            if chunk.text or reason or logprobs:
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
