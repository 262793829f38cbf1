"""``@function`` programs: ``run`` (blocking or streaming), ``run_batch``, the default backend."""
from __future__ import annotations

import functools
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

from .backend import BaseBackend
from .interpreter import StreamExecutor
from .sampling import run_defaults
from .state import ProgramState

MAX_AUTO_THREADS = 64


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
    """A program: a Python function ``f(s, ...)`` that appends to a program state ``s``.

    ``run``/``run_batch`` take SGLang's sampling keywords (``max_new_tokens``,
    ``temperature``, ``stop``, ``return_logprob``, ...) as defaults for every gen of the
    run, unless the program function has a parameter of that name.
    """

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None):
        self.func = func
        signature = inspect.signature(func)
        self._func_params = set(signature.parameters)
        params = list(signature.parameters.values())[1:]  # after the state
        self.arg_names = [p.name for p in params]
        self._required = sum(p.default is inspect.Parameter.empty for p in params)
        self.bind_arguments = dict(bind_arguments or {})
        functools.update_wrapper(self, func)

    def bind(self, **kwargs) -> "Function":
        """This program with some arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no argument(s) {', '.join(unknown)}")
        return Function(self.func, {**self.bind_arguments, **kwargs})

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

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]], *,
                  backend: BaseBackend | None = None, num_threads: int | str = "auto",
                  progress_bar: bool = False, generator_style: bool = False,
                  **defaults) -> list[ProgramState] | Iterator[ProgramState]:
        """Run one program per argument set (a dict of keyword arguments, or a list of
        positional ones), ``num_threads`` at a time; states come back in order
        (``generator_style=True``: yielded one by one, in order).

        A failed program does not stop the others: its state raises when read
        (``state.error()`` tells without raising).
        """
        batch = [self._as_kwargs(a) for a in batch_kwargs]
        if not batch:
            return []
        workers = min(len(batch), MAX_AUTO_THREADS if num_threads == "auto" else int(num_threads))
        bar = _progress_bar(len(batch)) if progress_bar else None

        def one(kwargs: dict[str, Any]) -> ProgramState:
            state, body = self._prepare((), {**defaults, **kwargs}, backend, False)
            self._guarded(state, body)
            state._executor.sync_all()
            if bar is not None:
                bar.update(1)
            return state

        states = _map_in_order(one, batch, max(workers, 1), bar)
        return states if generator_style else list(states)

    def __call__(self, *args, **kwargs):
        """Inside another program, ``f(s, ...)`` runs this program on ``s``."""
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    def trace(self, *args, **kwargs):
        raise NotImplementedError("tracing programs is not supported; run them")

    def compile(self, *args, **kwargs):
        raise NotImplementedError("compiling programs is not supported; run them")

    def cache(self, *args, **kwargs):
        raise NotImplementedError("pre-caching a program's prefix by tracing is not "
                                  "supported; the server's radix cache keeps prefixes as "
                                  "programs run")

    def _as_kwargs(self, arguments: dict[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(arguments, dict):
            return arguments
        values = list(arguments)
        if not self._required <= len(values) <= len(self.arg_names):
            raise TypeError(f"{self.func.__name__}() takes {self._required} to "
                            f"{len(self.arg_names)} arguments, got {len(values)}: {values!r}")
        return dict(zip(self.arg_names, values))

    def _prepare(self, args, kwargs, backend, stream):
        backend = backend or get_default_backend()
        if backend is None:
            raise RuntimeError("no backend: call radixlm.set_default_backend(...) "
                               "or pass backend=")
        kwargs = {**self.bind_arguments, **kwargs}
        defaults = run_defaults(kwargs, self._func_params)
        executor = StreamExecutor(backend, backend.chat_template(), defaults, stream=stream)
        state = ProgramState(executor)

        def body() -> None:
            executor.program_thread = threading.get_ident()
            try:
                state.ret_value = self.func(state, *args, **kwargs)
            finally:
                executor.close()

        return state, body

    @staticmethod
    def _guarded(state: ProgramState, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as exc:  # recorded on the state; raised when it is read
            state._executor.record_error(exc)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None):
    """Decorator: ``@radixlm.function`` (or ``@radixlm.function()``) makes a program.

    ``num_api_spec_tokens`` (speculative calls to API-only models) is accepted and has no
    effect: the server runs every gen itself.
    """
    if func is None:
        return Function
    return Function(func)


def _map_in_order(fn, items: list, workers: int, bar) -> Iterator[ProgramState]:
    """``fn`` over ``items`` on ``workers`` threads, results in order, as they are ready."""
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            yield from pool.map(fn, items)
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total)
