"""The OpenAI server's view of the Triton server: model facts, readiness, generation.

Generation goes through ``radixlm.AsyncTritonClient`` (one gRPC stream per request, so that
closing a request's iterator cancels it in the engine). Metadata and readiness use a second
asyncio gRPC client. Logprobs need no decoding here: the engine's carry each token's text.

Errors: Triton's stream carries an error as text only, without a status. An error before
the request produced anything is the engine refusing it (a prompt longer than the context,
a schema that does not compile) while the model is ready, and the engine failing when it
is not; readiness is asked at that moment to tell the two apart.
"""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from .. import wire
from ..aio import AsyncTritonClient
from ..chat_template import ChatTemplate
from ..errors import ServerError
from ..results import Chunk
from .errors import OpenAIError, bad_request, server_error, unavailable


@dataclass(frozen=True)
class ModelInfo:
    """What the OpenAI layer needs to know of the served model (from its config.pbtxt)."""

    chat_template: ChatTemplate
    eos_token: str
    has_template: bool  # False: the config has no chat_template (ChatML is assumed)


class Engine:
    def __init__(self, url: str, model: str = wire.MODEL_NAME):
        self.url, self.model = url, model
        self._generator = AsyncTritonClient(url, model)
        self._meta = aioclient.InferenceServerClient(url)
        self._info: ModelInfo | None = None

    async def close(self) -> None:
        await self._generator.close()
        await self._meta.close()

    # -- model facts and health --------------------------------------------------------
    async def info(self) -> ModelInfo:
        """The served model's chat template and EOS token (read once it is ready)."""
        if self._info is None:
            try:
                config = (await self._meta.get_model_config(self.model, as_json=True))["config"]
            except InferenceServerException as exc:
                raise unavailable(f"the model '{self.model}' is not available: "
                                  f"{exc.message()}") from exc
            params = config.get("parameters", {})

            def param(key: str) -> str:
                return params.get(key, {}).get("string_value", "")

            source = param(wire.CHAT_TEMPLATE_PARAM)
            self._info = ModelInfo(
                chat_template=ChatTemplate.from_jinja(source, eos_token=param(wire.EOS_TOKEN_PARAM)),
                eos_token=param(wire.EOS_TOKEN_PARAM), has_template=bool(source))
        return self._info

    async def ready(self) -> bool:
        try:
            return bool(await self._meta.is_server_live()
                        and await self._meta.is_model_ready(self.model))
        except InferenceServerException:
            return False

    # -- generation ----------------------------------------------------------------------
    async def stream(self, prompt: str | Sequence[int], params: dict[str, Any],
                     prompt_text: bool = False) -> AsyncIterator[Chunk]:
        """The request's chunks as the engine sends them (always streamed: samples of
        n > 1 arrive as chunks of their own); leaving the loop early, or the task being
        cancelled (a client that went away), cancels the request in the engine.
        ``prompt_text``: the first chunk carries the prompt as text (an echo's)."""
        produced = False
        chunks = self._generator.generate_stream(prompt, request_id=uuid.uuid4().hex,
                                                 prompt_text=prompt_text, **params)
        try:
            async with contextlib.aclosing(chunks) as source:
                async for chunk in source:
                    produced = True
                    yield chunk
        except ServerError as exc:
            raise await self._classify(exc.message, produced) from exc
        except ValueError as exc:  # the client library refused the parameters
            raise bad_request(str(exc)) from exc

    async def _classify(self, message: str, produced: bool) -> OpenAIError:
        if produced:
            return server_error(f"the engine failed during generation: {message}")
        if await self.ready():
            return bad_request(message)
        return unavailable(f"the engine is not ready: {message}")


async def first_error(tasks: list[asyncio.Task]) -> None:
    """Wait for all tasks; if one failed, cancel the rest and raise its error."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
