"""Exceptions raised by the client and the language interpreter."""
from __future__ import annotations


class ServerError(RuntimeError):
    """The server answered a request with an error; ``message`` is the server's own text."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class ProgramError(RuntimeError):
    """A primitive of a program failed; ``var`` names the variable it was producing and
    ``request_id`` the server request that failed (when there was one with an id)."""

    def __init__(self, var: str | None, message: str, request_id: str | None = None):
        where = f"variable {var!r}" if var else "program"
        if request_id:
            where += f" (request {request_id})"
        super().__init__(f"{where}: {message}")
        self.var = var
        self.message = message
        self.request_id = request_id
