"""``@function`` programs: ``run`` (blocking or streaming), ``run_batch``, the default backend."""
from __future__ import annotations

import functools
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .backend import BaseBackend
from .interpreter import StreamExecutor
from .state import ProgramState

# run()/run_batch() keywords that set default sampling parameters for every gen of the run
# (unless the program function itself takes a parameter of that name).
_RUN_SAMPLING_KEYS = {
    "max_new_tokens": "max_tokens", "max_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos", "seed": "seed",
}


class _DefaultBackend:
    """The backend ``set_default_backend`` chose: the one process-wide setting the SGLang-style
    API asks for. Programs can always pass ``backend=`` instead."""

    lock = threading.Lock()
    backend: BaseBackend | None = None


def set_default_backend(backend: BaseBackend) -> None:
    with _DefaultBackend.lock:
        _DefaultBackend.backend = backend


def get_default_backend() -> BaseBackend | None:
    with _DefaultBackend.lock:
        return _DefaultBackend.backend


class Function:
    """A program: a Python function ``f(s, ...)`` that appends to a program state ``s``."""

    def __init__(self, func: Callable[..., Any]):
        self.func = func
        self._func_params = set(inspect.signature(func).parameters)
        functools.update_wrapper(self, func)

    def run(self, *args, backend: BaseBackend | None = None, stream: bool = False,
            **kwargs) -> ProgramState:
        """Run the program. Blocking: waits for every primitive (forks included) and raises the
        first ``ProgramError``. ``stream=True``: returns at once; read with ``text_iter``."""
        state, body = self._prepare(args, kwargs, backend, stream)
        if stream:
            threading.Thread(target=self._guarded, args=(state, body), daemon=True).start()
            return state
        body()
        error = state._executor.sync_all()
        if error is not None:
            raise error
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: BaseBackend | None = None,
                  num_threads: int | str = "auto", **defaults) -> list[ProgramState]:
        """Run one program per kwargs dict, ``num_threads`` at a time; states come back in order.

        A failed program does not stop the others: its state raises when read (``state.error``
        tells without raising).
        """
        if num_threads == "auto":
            num_threads = max(1, min(len(batch_kwargs), 64))

        def one(kwargs: dict[str, Any]) -> ProgramState:
            state, body = self._prepare((), {**defaults, **kwargs}, backend, False)
            self._guarded(state, body)
            state._executor.sync_all()
            return state

        if not batch_kwargs:
            return []
        with ThreadPoolExecutor(max_workers=int(num_threads)) as pool:
            return list(pool.map(one, batch_kwargs))

    def __call__(self, *args, **kwargs):
        """Inside another program, ``f(s, ...)`` runs this program on ``s``."""
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **kwargs)
        return self.run(*args, **kwargs)

    def _prepare(self, args, kwargs, backend, stream):
        backend = backend or get_default_backend()
        if backend is None:
            raise RuntimeError("no backend: call radixlm.set_default_backend(...) "
                               "or pass backend=")
        sampling = {}
        for key in list(kwargs):
            if key in _RUN_SAMPLING_KEYS and key not in self._func_params:
                sampling[_RUN_SAMPLING_KEYS[key]] = kwargs.pop(key)
        executor = StreamExecutor(backend, backend.chat_template(), sampling, stream=stream)
        state = ProgramState(executor)

        def body() -> None:
            executor.program_thread = threading.get_ident()
            try:
                self.func(state, *args, **kwargs)
            finally:
                executor.close()

        return state, body

    @staticmethod
    def _guarded(state: ProgramState, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as exc:  # recorded on the state; raised when it is read
            state._executor.record_error(exc)


def function(func: Callable[..., Any] | None = None):
    """Decorator: ``@radixlm.function`` (or ``@radixlm.function()``) makes a program."""
    if func is None:
        return Function
    return Function(func)
