"""OpenAI's error object and the HTTP status of each kind of failure.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` with the status
OpenAI uses for it: 400 for a request the server cannot serve as written (bad types, bad
schema, a prompt longer than the context), 404 for an unknown model, 503 when the engine
is not ready, 500 when it fails mid-request.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class OpenAIError(Exception):
    """A failure of one request, answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code = param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist", "invalid_request_error",
                       "model", "model_not_found")


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable", None, "engine_unavailable")


def server_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, None)


# pydantic's labels of union members in a location ("str", "list[str]", "function-after[...]"):
# no field of the request models is named like them.
_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "none", "nullable"}


def _field_path(loc: tuple) -> str | None:
    """pydantic's location ("body", "messages", 0, "content") as OpenAI's ``messages[0].content``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "body" or part in _TYPE_LABELS or any(c in part for c in "[(-"):
            continue
        else:
            path += f".{part}" if path else part
    return path or None


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = _field_path(tuple(first.get("loc", ())))
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    return JSONResponse(bad_request(message, param).body(), status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error = OpenAIError(exc.status_code, str(exc.detail), type_)
    return JSONResponse(error.body(), status_code=exc.status_code)


def install_handlers(app) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
