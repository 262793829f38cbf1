"""Blocking and streaming gRPC client for the `llm` model (asyncio variants delegate to aio.py).

The model is decoupled, so every call goes over Triton's bidirectional stream API. Triton
reports a streamed error without the request it belongs to, so requests are not multiplexed
on one stream: each in-flight request gets its own stream, on a connection borrowed from a
small pool (a tritonclient client holds at most one stream at a time).
"""
from __future__ import annotations

import asyncio
import os
import queue
import threading
import uuid
from typing import Any, Iterator, Sequence

import tritonclient.grpc as grpcclient

from . import wire
from .chat_template import ChatTemplate
from .errors import ServerError
from .results import Chunk, GenerateResult, ScoreResult, merge_chunks

_ALIASES = {"max_new_tokens": "max_tokens"}


def sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments to wire keys (``max_new_tokens`` is accepted for ``max_tokens``)."""
    return {_ALIASES.get(k, k): v for k, v in params.items() if v is not None}


def to_infer_inputs(tensors: list[wire.Tensor]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, datatype, array in tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def error_message(error: Exception) -> str:
    """The server's own text of a tritonclient error."""
    message = getattr(error, "message", None)
    return message() if callable(message) else str(error)


def is_final(result) -> bool:
    params = result.get_response().parameters
    return wire.FINAL_RESPONSE_PARAM in params and params[wire.FINAL_RESPONSE_PARAM].bool_param


def choice_scores_or_raise(result, request_id: str) -> ScoreResult:
    scores = wire.decode_choice_scores(result.as_numpy)
    if scores is None:
        raise ServerError("scoring response carried no choice_scores", request_id)
    chunk = wire.decode_chunk(result.as_numpy)
    return ScoreResult(tuple(scores), chunk.num_input_tokens, chunk.num_cached_tokens)


class _Call:
    """One in-flight request: its connection, its response queue, its cancellation."""

    def __init__(self, connection: grpcclient.InferenceServerClient):
        self.connection = connection
        self.responses: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.stream_closed = threading.Event()


class Stream:
    """Iterator over the chunks of one streaming request; ``cancel()`` stops it server-side."""

    def __init__(self, client: "TritonClient", tensors: list[wire.Tensor], request_id: str):
        self.request_id = request_id
        self._client = client
        self._results = client._responses(tensors, request_id)

    def __iter__(self) -> Iterator[Chunk]:
        for result in self._results:
            for chunk in wire.decode_chunks(result.as_numpy):
                if chunk.says_something:
                    yield chunk

    def cancel(self) -> bool:
        return self._client.cancel(self.request_id)


class TritonClient:
    """Client for the `llm` model: ``generate``, ``generate_stream``, ``score``, ``cancel``."""

    def __init__(self, url: str = "localhost:8001", model: str = wire.MODEL_NAME,
                 verbose: bool = False):
        self.url = url
        self.model = model
        self._verbose = verbose
        self._lock = threading.Lock()
        self._idle: list[grpcclient.InferenceServerClient] = []
        self._active: dict[str, _Call] = {}
        self._async_clients: dict[int, tuple] = {}  # id(loop) -> (loop, AsyncTritonClient)
        self._config: dict | None = None

    # -- blocking API -------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], request_id: str | None = None,
                 **params) -> GenerateResult:
        """Generate to the end; raises ``ServerError`` with the server's message on failure."""
        request_id = request_id or uuid.uuid4().hex
        tensors = wire.encode_request(prompt, sampling_params(params), stream=False)
        return merge_chunks(list(Stream(self, tensors, request_id)))

    def generate_stream(self, prompt: str | Sequence[int], request_id: str | None = None, *,
                        prompt_text: bool = False, **params) -> Stream:
        """Iterate over new text as the engine produces it (one ``Chunk`` per engine step);
        ``prompt_text``: the first chunk carries the prompt as text (``Chunk.prompt_text``)."""
        request_id = request_id or uuid.uuid4().hex
        tensors = wire.encode_request(prompt, sampling_params(params), stream=True,
                                      prompt_text=prompt_text)
        return Stream(self, tensors, request_id)

    def score(self, prompt: str, choices: Sequence[str],
              request_id: str | None = None) -> ScoreResult:
        """Log-probabilities of each choice following ``prompt``, scored in one batched call."""
        request_id = request_id or uuid.uuid4().hex
        tensors = wire.encode_request(prompt, {}, stream=False, choices=choices)
        for result in self._responses(tensors, request_id):
            if wire.decode_choice_scores(result.as_numpy) is not None:
                return choice_scores_or_raise(result, request_id)
        raise ServerError("scoring request ended without choice_scores", request_id)

    def flush_cache(self) -> bool:
        """Ask the server to drop every cached prefix no request uses; False when it
        refuses (a server may restrict debug requests)."""
        try:
            for _ in self._responses([], uuid.uuid4().hex,
                                     parameters=wire.flush_cache_parameters(os.environ)):
                pass
        except ServerError:
            return False
        return True

    def cancel(self, request_id: str) -> bool:
        """Cancel an in-flight request; its generate call returns with finish_reason "abort"."""
        with self._lock:
            call = self._active.get(request_id)
            if call is None or call.cancelled.is_set():
                return False
            call.cancelled.set()
        call.connection.stop_stream(cancel_requests=True)
        call.responses.put((None, None))  # wake the waiting caller even if no error arrives
        call.stream_closed.set()
        return True

    def model_config(self) -> dict:
        """The model's config as JSON (fetched once)."""
        if self._config is None:
            connection = self._acquire()
            try:
                self._config = connection.get_model_config(self.model, as_json=True)["config"]
            finally:
                self._release(connection)
        return self._config

    def chat_template(self) -> ChatTemplate:
        params = self.model_config().get("parameters", {})

        def param(key: str) -> str:
            return params.get(key, {}).get("string_value", "")

        return ChatTemplate.from_jinja(param(wire.CHAT_TEMPLATE_PARAM),
                                       eos_token=param(wire.EOS_TOKEN_PARAM))

    # -- asyncio API (one aio connection per event loop) ----------------------------------
    def _aio(self):
        from .aio import AsyncTritonClient

        loop = asyncio.get_running_loop()
        with self._lock:
            # Forget clients of closed loops (asyncio.run closes its loop; ids get reused).
            self._async_clients = {k: v for k, v in self._async_clients.items()
                                   if not v[0].is_closed()}
            entry = self._async_clients.get(id(loop))
            if entry is None or entry[0] is not loop:
                entry = (loop, AsyncTritonClient(self.url, self.model, self._verbose))
                self._async_clients[id(loop)] = entry
        return entry[1]

    async def agenerate(self, prompt: str | Sequence[int], **params) -> GenerateResult:
        return await self._aio().generate(prompt, **params)

    def agenerate_stream(self, prompt: str | Sequence[int], **params):
        return self._aio().generate_stream(prompt, **params)

    async def ascore(self, prompt: str, choices: Sequence[str]) -> ScoreResult:
        return await self._aio().score(prompt, choices)

    # -- plumbing ------------------------------------------------------------------------
    def _acquire(self) -> grpcclient.InferenceServerClient:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return grpcclient.InferenceServerClient(self.url, verbose=self._verbose)

    def _release(self, connection: grpcclient.InferenceServerClient) -> None:
        with self._lock:
            self._idle.append(connection)

    def _responses(self, tensors: list[wire.Tensor], request_id: str,
                   parameters: dict | None = None):
        """Raw results of one request until its final response (generator)."""
        connection = self._acquire()
        call = _Call(connection)
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._active[request_id] = call
        finished = False
        try:
            connection.start_stream(
                callback=lambda result=None, error=None: call.responses.put((result, error)))
            connection.async_stream_infer(self.model, to_infer_inputs(tensors),
                                          request_id=request_id, parameters=parameters,
                                          enable_empty_final_response=True)
            while True:
                result, error = call.responses.get()
                if call.cancelled.is_set():
                    return
                if error is not None:
                    raise ServerError(error_message(error), request_id)
                yield result
                if is_final(result):
                    finished = True
                    return
        finally:
            with self._lock:
                self._active.pop(request_id, None)
                cancelled_by_user = call.cancelled.is_set()
                call.cancelled.set()  # a late cancel() of this id is now a no-op
            if cancelled_by_user:
                call.stream_closed.wait()
            else:
                connection.stop_stream(cancel_requests=not finished)
            self._release(connection)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def __enter__(self) -> "TritonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
