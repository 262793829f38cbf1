"""Each program state is an asynchronous stream: a worker thread runs its primitives in order.

``submit`` queues primitives and returns at once; readers (``get_var``, ``text``) wait on the
state's condition until what they need is ready. One worker thread at a time per state
(started on demand, gone when the queue is empty) keeps the state's text append-only and
ordered; different states - forks, batch programs - run on their own workers in parallel.
After a primitive fails, the rest of the queue is skipped and the failure (a
``ProgramError`` naming the variable) is raised to whoever reads what it would have made.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterator

from . import ops
from .backend import BaseBackend
from .chat_template import ChatTemplate
from .errors import ProgramError, ServerError
from .ir import (CachePrefix, Expr, Gen, GenParams, RoleBegin, RoleEnd, Select,
                 SeparateReasoning, Text, VarScopeBegin, VarScopeEnd, flatten)
from .results import GenerateResult


class StreamExecutor:
    def __init__(self, backend: BaseBackend, template: ChatTemplate, defaults: GenParams,
                 stream: bool = False, parent: "StreamExecutor | None" = None):
        self.backend = backend
        self.template = template
        self.defaults = defaults  # run-level sampling parameters, overridden per gen
        self.stream = stream  # ask the backend for pieces as they are produced
        self.error: ProgramError | None = None
        self.children: list[StreamExecutor] = []
        self.last_prefix_result: GenerateResult | None = None
        self.program_thread = parent.program_thread if parent else None  # set by run()
        self._cond = threading.Condition()
        self._todo: deque[Expr] = deque()
        self._running = False
        self._closed = False  # the program function has returned: no more submissions
        self._pending: dict[str, int] = {}  # variable -> queued primitives that produce it
        self._failed: set[str] = set()
        self._pieces: dict[str, list[str]] = {}
        self.text_ = parent.text_ if parent else ""
        self.messages_ = list(parent.messages_) if parent else []
        self.vars = dict(parent.vars) if parent else {}
        self.meta = dict(parent.meta) if parent else {}
        # variable -> (start, end) of the text a gen or select appended (separate_reasoning
        # rewrites it); var_scope name -> where its capture starts
        self.spans: dict[str, tuple[int, int]] = dict(parent.spans) if parent else {}
        self._scope_starts: dict[str, int] = {}
        self.fork_start = len(parent.text_) if parent else 0
        self._role = parent._role if parent else None
        self._role_start = parent._role_start if parent else 0
        self._has_roles = parent._has_roles if parent else False

    # -- submission (program thread) ---------------------------------------------------
    def submit(self, expr: Expr | str) -> None:
        primitives = flatten(expr)
        with self._cond:
            for prim in primitives:
                for name in prim.produces():
                    self._pending[name] = self._pending.get(name, 0) + 1
            self._todo.extend(primitives)
            if not self._running:
                self._running = True
                threading.Thread(target=self._work, daemon=True).start()

    def fork(self, n: int, cache_prefix: bool = True) -> list["StreamExecutor"]:
        """Copies of this state after everything submitted so far; the prefix prefilled once."""
        if cache_prefix and n > 1:
            self.submit(CachePrefix())
        self.sync()
        if self.error:
            raise self.error
        children = [StreamExecutor(self.backend, self.template, self.defaults, self.stream, self)
                    for _ in range(n)]
        with self._cond:
            self.children.extend(children)
        return children

    def close(self) -> None:
        """The program function returned: iterators over the whole text may finish."""
        with self._cond:
            self._closed = True
            children = list(self.children)
            self._cond.notify_all()
        for child in children:
            child.close()

    def record_error(self, exc: BaseException, var: str | None = None) -> None:
        with self._cond:
            if self.error is None:
                message = exc.message if isinstance(exc, (ServerError, ProgramError)) else str(exc)
                request_id = exc.request_id if isinstance(exc, ServerError) else None
                self.error = exc if isinstance(exc, ProgramError) else ProgramError(
                    var, message, request_id)
                if self.error is not exc:
                    self.error.__cause__ = exc
            self._cond.notify_all()

    # -- reading (any thread) ------------------------------------------------------------
    def get_var(self, name: str) -> Any:
        # A reader on another thread (stream=True) may ask before the program has submitted
        # the primitive; it waits until the program returns. The program's own thread cannot
        # wait for itself, so for it an unknown name is a KeyError at once.
        own_thread = threading.get_ident() == self.program_thread
        with self._cond:
            self._cond.wait_for(lambda: not self._pending.get(name) and (
                own_thread or self._closed or name in self.vars or name in self._failed))
            if name in self._failed:
                raise self.error
            if name not in self.vars:
                raise KeyError(f"no variable {name!r} in this program state")
            return self.vars[name]

    def set_var(self, name: str, value: Any) -> None:
        with self._cond:
            self.vars[name] = value
            self._cond.notify_all()

    def get_meta(self, name: str) -> dict[str, Any] | None:
        self.get_var(name)
        with self._cond:
            return self.meta.get(name)

    def meta_so_far(self, name: str) -> dict[str, Any]:
        """The meta info of ``name`` if it is complete, else {} (does not wait)."""
        with self._cond:
            return dict(self.meta.get(name) or {})

    def sync(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._running)

    def sync_all(self) -> ProgramError | None:
        """Wait for this state and all its forks; the first error among them, if any."""
        self.sync()
        errors = [self.error] + [child.sync_all() for child in list(self.children)]
        return next((e for e in errors if e is not None), None)

    def iter_var(self, name: str) -> Iterator[str]:
        """Pieces of a variable as they are produced; ends when the variable is complete."""
        seen = 0
        while True:
            with self._cond:
                def ready():
                    return (len(self._pieces.get(name, ())) > seen or self._var_settled(name))
                self._cond.wait_for(ready)
                pieces = self._pieces.get(name, [])[seen:]
                seen += len(pieces)
                settled = not pieces and self._var_settled(name)
                if settled and name in self._failed:
                    raise self.error
            if settled:
                return
            yield from pieces

    def iter_text(self) -> Iterator[str]:
        """The state's text as it grows, until the program has returned and its queue drained."""
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self.text_) > seen or self._idle_and_closed())
                new, seen = self.text_[seen:], len(self.text_)
                if not new and self.error:
                    raise self.error
            if not new:
                return
            yield new

    def _var_settled(self, name: str) -> bool:
        if self._pending.get(name):
            return False
        return name in self.vars or name in self._failed or self._idle_and_closed()

    def _idle_and_closed(self) -> bool:
        return self._closed and not self._running

    # -- the worker ------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._todo:
                    self._running = False
                    self._cond.notify_all()
                    return
                prim = self._todo.popleft()
                failed = self.error is not None
            names = prim.produces()
            ok = False
            if not failed:
                try:
                    self._execute(prim)
                    ok = True
                except Exception as exc:  # the program fails, not the worker
                    self.record_error(exc, names[0] if names else None)
            with self._cond:
                for name in names:
                    self._pending[name] -= 1
                    (self._failed.discard if ok else self._failed.add)(name)
                self._cond.notify_all()

    def _execute(self, prim: Expr) -> None:
        if isinstance(prim, Text):
            self.append(prim.text)
        elif isinstance(prim, Gen):
            ops.run_gen(self, prim)
        elif isinstance(prim, Select):
            ops.run_select(self, prim)
        elif isinstance(prim, RoleBegin):
            self._role_begin(prim.role)
        elif isinstance(prim, RoleEnd):
            self._role_end(prim.role)
        elif isinstance(prim, VarScopeBegin):
            self._scope_starts[prim.name] = len(self.text_)
        elif isinstance(prim, VarScopeEnd):
            if prim.name not in self._scope_starts:
                raise ValueError(f"var_scope {prim.name!r} ends without having begun")
            self.set_var(prim.name, self.text_[self._scope_starts.pop(prim.name):])
        elif isinstance(prim, SeparateReasoning):
            ops.run_separate_reasoning(self, prim)
        elif isinstance(prim, CachePrefix):
            if self.text_:
                self.last_prefix_result = self.backend.cache_prefix(self.text_)
        else:
            raise TypeError(f"unknown primitive {prim!r}")

    # -- what the primitives in ops.py change (worker thread) -------------------------------
    def append(self, text: str) -> None:
        with self._cond:
            self.text_ += text
            self._cond.notify_all()

    def begin_var(self, name: str | None) -> int:
        """A gen starts producing ``name`` (streamed pieces go to it); returns where."""
        with self._cond:
            self._pieces[name] = []
            return len(self.text_)

    def stream_piece(self, name: str | None, piece: str) -> None:
        with self._cond:
            self.text_ += piece
            self._pieces[name].append(piece)
            self._cond.notify_all()

    def finish_var(self, name: str | None, start: int, text: str, value: Any,
                   meta: dict[str, Any] | None) -> None:
        """The gen or select that began at ``start`` appended ``text``: whatever was streamed
        is replaced by it; ``name`` gets ``value`` and ``meta``."""
        with self._cond:
            self.text_ = self.text_[:start] + text
            pieces = self._pieces.setdefault(name, [])
            streamed = "".join(pieces)
            if text.startswith(streamed) and len(text) > len(streamed):
                pieces.append(text[len(streamed):])
            if name:
                self.vars[name] = value
                self.meta[name] = meta
                self.spans[name] = (start, len(self.text_))
            self._cond.notify_all()

    def rewrite(self, start: int, end: int, text: str) -> None:
        """Replace the text between ``start`` and ``end``."""
        with self._cond:
            self.text_ = self.text_[:start] + text + self.text_[end:]
            self._cond.notify_all()

    def _role_begin(self, role: str) -> None:
        if self._role is not None:
            raise ValueError(f"cannot open role {role!r} inside role {self._role!r}")
        prefix = self.template.prefix(role)
        if role != "system" and not self._has_roles:
            prefix = self.template.preamble + prefix
        with self._cond:
            self.text_ += prefix
            self._role, self._role_start, self._has_roles = role, len(self.text_), True
            self._cond.notify_all()

    def _role_end(self, role: str) -> None:
        if self._role != role:
            raise ValueError(f"closing role {role!r} but the open role is {self._role!r}")
        with self._cond:
            content = self.text_[self._role_start:]
            self.text_ += self.template.suffix(role)
            self.messages_.append({"role": role, "content": content})
            self._role = None
            self._cond.notify_all()
