"""POST /v1/chat/completions: a whole answer, or server-sent chunks."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request

from . import params, tools
from .engine import Engine
from .errors import OpenAIError
from .generation import collect, merged, primed, unless_disconnected
from .protocol import ChatCompletionRequest
from .responses import (DONE, PromptUsage, Sample, chat_logprobs, envelope, finish_reason,
                        new_id, sse, usage)


async def run(engine: Engine, body: ChatCompletionRequest, settings,
              request: Request) -> dict | AsyncIterator[str]:
    info = await engine.info()
    plan = tools.plan(body)
    prompt = params.chat_prompt(body, info)
    wire_params = params.chat_params(body, plan, settings.default_max_tokens)
    flow = merged(engine, [prompt], wire_params)
    head = envelope(new_id("chatcmpl"), "chat.completion", body.model)
    if body.stream:
        flow = await unless_disconnected(request, primed(flow))
        return _chunks(body, plan, flow, dict(head, object="chat.completion.chunk"))
    usages, samples = await unless_disconnected(request, collect(flow, 1, body.n))
    choices = [_choice(body, plan, i, s) for i, s in enumerate(samples)]
    return {**head, "choices": choices, "usage": usage(usages, samples)}


def _logprobs(body: ChatCompletionRequest, items: list[dict], ids: list[int]) -> dict | None:
    if not body.logprobs:
        return None
    return chat_logprobs(items, ids, body.top_logprobs or 0)


def _message_and_reason(plan: tools.ToolPlan, text: str, reason: str) -> tuple[dict, str]:
    content, calls = tools.read_calls(plan, text) if plan.mode != "none" else (text, [])
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
        if reason == "stop":
            reason = "tool_calls"
    return message, reason


def _choice(body: ChatCompletionRequest, plan: tools.ToolPlan, index: int,
            sample: Sample) -> dict:
    message, reason = _message_and_reason(plan, "".join(sample.text),
                                          finish_reason(sample.finish_reason))
    return {"index": index, "message": message,
            "logprobs": _logprobs(body, sample.logprobs, sample.token_ids),
            "finish_reason": reason}


def _whole_delta(plan: tools.ToolPlan, sample: Sample, chunk) -> tuple[dict, str, list, list]:
    """The one delta of a held answer: its calls (or its text) once it has ended."""
    message, reason = _message_and_reason(plan, "".join(sample.text),
                                          finish_reason(chunk.finish_reason))
    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(delta["tool_calls"])]
    return delta, reason, sample.logprobs, sample.token_ids


def _piece_delta(plan: tools.ToolPlan, chunk) -> tuple[dict, str | None, list, list]:
    """A streamed piece: text, or the next piece of a named call's arguments."""
    reason = finish_reason(chunk.finish_reason) if chunk.finish_reason else None
    delta: dict = {}
    if plan.mode == "named":
        reason = "tool_calls" if reason == "stop" else reason
        if chunk.text:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": chunk.text}}]}
    elif chunk.text:
        delta = {"content": chunk.text}
    return delta, reason, chunk.logprobs or [], list(chunk.output_ids)


async def _chunks(body: ChatCompletionRequest, plan: tools.ToolPlan, flow,
                  head: dict) -> AsyncIterator[str]:
    """The SSE events. A forced call of a named function streams its arguments as they
    come; "required" and "auto" answers are held until they end (a call can only be told
    from text once it is complete) and sent as one delta."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    held = plan.mode in ("required", "auto")
    samples = [Sample() for _ in range(body.n)]
    prompt_usage = PromptUsage()
    created = int(time.time())

    def event(index: int, delta: dict, logprobs=None, reason=None) -> str:
        data = {**head, "created": created, "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    try:
        for index in range(body.n):
            yield event(index, {"role": "assistant", "content": ""})
            if plan.mode == "named":
                call = tools.new_call(plan.named, "")
                yield event(index, {"tool_calls": [dict(call, index=0)]})
        async for _, chunk in flow:
            sample = samples[chunk.index]
            if sample.finish_reason:  # n > 1: a later response repeating how it ended
                continue
            prompt_usage.add(chunk)
            sample.add(chunk)
            if held and not chunk.finish_reason:
                continue
            delta, reason, items, ids = (_whole_delta(plan, sample, chunk) if held
                                         else _piece_delta(plan, chunk))
            logprobs = _logprobs(body, items, ids) if items else None
            if delta or logprobs or reason:
                yield event(chunk.index, delta, logprobs, reason)
        if include_usage:
            yield sse({**head, "created": created, "choices": [],
                       "usage": usage([prompt_usage], samples)})
        yield DONE
    except OpenAIError as exc:  # the engine failed mid-stream: say so, then end the stream
        yield sse(exc.body())
        yield DONE
    finally:
        await flow.aclose()
