"""The FastAPI application: /v1/models, /v1/completions, /v1/chat/completions, /health,
and, with a tokenizer (``Settings.tokenizer``), /tokenize, /detokenize, /tokenizer_info."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import wire
from . import chat, completions, params
from .engine import Engine
from .errors import install_handlers, model_not_found, unavailable
from .generation import ClientGone
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest)
from .tokenize import LocalTokenizer, tokenize


@dataclass(frozen=True)
class Settings:
    grpc_url: str = "localhost:8001"
    triton_model: str = wire.MODEL_NAME
    served_model_name: str = wire.MODEL_NAME
    # max_tokens of requests that give none (None: the engine's default)
    default_max_tokens: int | None = None
    # the served model's tokenizer folder, for /tokenize and its kin (None: no such routes)
    tokenizer: str | None = None


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(settings: Settings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # gRPC asyncio channels belong to the loop that serves: made here, not at import.
        app.state.engine = Engine(settings.grpc_url, settings.triton_model)
        try:
            yield
        finally:
            await app.state.engine.close()

    app = FastAPI(title="RadixLM OpenAI-compatible API", lifespan=lifespan)
    app.state.settings = settings
    app.state.created = int(time.time())
    install_handlers(app)

    def engine_for(request: Request, model: str) -> Engine:
        if model != settings.served_model_name:
            raise model_not_found(model)
        return request.app.state.engine

    @app.get("/health")
    async def health(request: Request) -> Response:
        if await request.app.state.engine.ready():
            return JSONResponse({"status": "ok"})
        error = unavailable(f"the model '{settings.triton_model}' is not ready")
        return JSONResponse(error.body(), status_code=error.status)

    def model_card() -> dict:
        return {"id": settings.served_model_name, "object": "model",
                "created": app.state.created, "owned_by": "radixlm"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id != settings.served_model_name:
            raise model_not_found(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        engine = engine_for(request, body.model)
        return await _answer(request, completions.run(engine, body, settings, request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        engine = engine_for(request, body.model)
        return await _answer(request, chat.run(engine, body, settings, request))

    if settings.tokenizer is not None:
        _tokenizer_routes(app, LocalTokenizer(settings.tokenizer), engine_for)
    return app


def _tokenizer_routes(app: FastAPI, tokenizer: LocalTokenizer, engine_for) -> None:
    @app.post("/tokenize")
    async def tokenize_text(body: TokenizeRequest, request: Request) -> dict:
        engine = (request.app.state.engine if body.model is None
                  else engine_for(request, body.model))
        info = await engine.info() if body.messages is not None else None
        return tokenize(tokenizer, body, lambda chat: params.chat_prompt(chat, info))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        if body.model is not None:
            engine_for(request, body.model)
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return tokenizer.info()


async def _answer(request: Request, work) -> Response:
    """A handler's result: a JSON body, or an SSE stream (an async iterator of events)."""
    try:
        result = await work
    except ClientGone:
        return Response(status_code=499)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)

