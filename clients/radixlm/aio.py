"""asyncio client for the `llm` model over tritonclient.grpc.aio (one gRPC stream per request)."""
from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator, Sequence

import grpc
import tritonclient.grpc.aio as aioclient

from . import wire
from .client import (choice_scores_or_raise, error_message, is_final, sampling_params,
                     to_infer_inputs)
from .errors import ServerError
from .results import Chunk, GenerateResult, ScoreResult, merge_chunks


class AsyncTritonClient:
    """``await generate(...)``, ``async for chunk in generate_stream(...)``, ``await score(...)``.

    Bound to the event loop it is first used on (as grpc.aio channels are).
    """

    def __init__(self, url: str = "localhost:8001", model: str = wire.MODEL_NAME,
                 verbose: bool = False):
        self.model = model
        self._client = aioclient.InferenceServerClient(url, verbose=verbose)
        self._active: dict[str, object] = {}

    async def generate(self, prompt: str | Sequence[int], request_id: str | None = None,
                       **params) -> GenerateResult:
        chunks = [c async for c in self._chunks(prompt, params, False, request_id)]
        return merge_chunks(chunks)

    def generate_stream(self, prompt: str | Sequence[int], request_id: str | None = None, *,
                        prompt_text: bool = False, **params) -> AsyncIterator[Chunk]:
        """``prompt_text``: the first chunk carries the prompt as text (``Chunk.prompt_text``)."""
        return self._chunks(prompt, params, True, request_id, prompt_text)

    async def score(self, prompt: str, choices: Sequence[str],
                    request_id: str | None = None) -> ScoreResult:
        request_id = request_id or uuid.uuid4().hex
        tensors = wire.encode_request(prompt, {}, stream=False, choices=choices)
        async for result in self._responses(tensors, request_id):
            if wire.decode_choice_scores(result.as_numpy) is not None:
                return choice_scores_or_raise(result, request_id)
        raise ServerError("scoring request ended without choice_scores", request_id)

    def cancel(self, request_id: str) -> bool:
        responses = self._active.pop(request_id, None)
        if responses is None:
            return False
        responses.cancel()
        return True

    async def close(self) -> None:
        await self._client.close()

    async def _chunks(self, prompt, params, stream: bool, request_id: str | None,
                      prompt_text: bool = False):
        request_id = request_id or uuid.uuid4().hex
        tensors = wire.encode_request(prompt, sampling_params(params), stream=stream,
                                      prompt_text=prompt_text)
        async for result in self._responses(tensors, request_id):
            for chunk in wire.decode_chunks(result.as_numpy):
                if chunk.says_something:
                    yield chunk

    async def _responses(self, tensors: list[wire.Tensor], request_id: str):
        async def one_request():
            yield {"model_name": self.model, "inputs": to_infer_inputs(tensors),
                   "request_id": request_id}

        # The request iterator ends after one request, which half-closes the stream: the
        # server then ends it after the request's last response, final flag or not.
        responses = self._client.stream_infer(one_request())
        self._active[request_id] = responses
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    if request_id not in self._active:  # cancelled by us
                        return
                    raise ServerError(error_message(error), request_id)
                yield result
                if is_final(result):
                    finished = True
                    return
            finished = True
        except (asyncio.CancelledError, grpc.RpcError) as exc:
            if request_id in self._active:  # not a cancel() of ours
                if isinstance(exc, grpc.RpcError):
                    raise ServerError(exc.details() or str(exc), request_id) from exc
                raise
        finally:
            if self._active.pop(request_id, None) is not None and not finished:
                responses.cancel()
