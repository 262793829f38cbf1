"""Running one OpenAI request's engine requests, and stopping them when the client leaves.

A request with several prompts runs one engine request per prompt, concurrently; their
chunks are merged into one flow of ``(prompt index, chunk)``. Every way out (the end, an
error, the client disconnecting, the server's task being cancelled) closes the engine
streams, which cancels whatever still runs in the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Sequence, TypeVar

from fastapi import Request

from ..results import Chunk
from .engine import Engine
from .responses import PromptUsage, Sample

T = TypeVar("T")
_DONE = object()


class ClientGone(Exception):
    """The HTTP client disconnected; its engine requests have been cancelled."""


async def merged(engine: Engine, prompts: Sequence[str | list[int]], params: dict[str, Any],
                 prompt_text: bool = False) -> AsyncIterator[tuple[int, Chunk]]:
    if len(prompts) == 1:  # the common case: no tasks, no queue
        async with contextlib.aclosing(engine.stream(prompts[0], params,
                                                     prompt_text)) as chunks:
            async for chunk in chunks:
                yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, prompt) -> None:
        try:
            async with contextlib.aclosing(engine.stream(prompt, params,
                                                         prompt_text)) as chunks:
                async for chunk in chunks:
                    queue.put_nowait((index, chunk))
            queue.put_nowait((index, _DONE))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(flow: AsyncIterator[tuple[int, Chunk]], num_prompts: int,
                  n: int) -> tuple[list[PromptUsage], list[Sample]]:
    """Run a flow to its end: per-prompt counts and per-choice outputs."""
    usages = [PromptUsage() for _ in range(num_prompts)]
    samples = [Sample() for _ in range(num_prompts * n)]
    async with contextlib.aclosing(flow) as chunks:
        async for index, chunk in chunks:
            usages[index].add(chunk)
            samples[index * n + chunk.index].add(chunk)
    return usages, samples


async def primed(flow: AsyncIterator[T]) -> AsyncIterator[T]:
    """The flow with its first item already taken, so that a request the engine refuses
    is answered with an error status instead of a stream that fails at once."""
    try:
        first = await flow.__anext__()
    except StopAsyncIteration:
        first = _DONE
    except BaseException:
        await flow.aclose()
        raise

    async def rest() -> AsyncIterator[T]:
        try:
            if first is _DONE:
                return
            yield first
            async for item in flow:
                yield item
        finally:
            await flow.aclose()

    return rest()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnect(request: Request) -> None:
    # The body has been read: the next ASGI message is the client going away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
