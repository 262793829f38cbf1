"""Exceptions raised by the client and the language interpreter."""
from __future__ import annotations


class ServerError(RuntimeError):
    """The server answered a request with an error; ``message`` is the server's own text."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class ProgramError(RuntimeError):
    """A primitive of a program failed; ``var`` names the variable it was producing."""

    def __init__(self, var: str | None, message: str):
        where = f"variable {var!r}" if var else "program"
        super().__init__(f"{where}: {message}")
        self.var = var
        self.message = message
