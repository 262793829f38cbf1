"""What a program sees: ``ProgramState`` (``s``) and the ``ForkGroup`` that ``s.fork(n)`` returns."""
from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from .errors import ProgramError
from .interpreter import StreamExecutor
from .ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, role_expr
from .results import GenerateResult


class ProgramState:
    """``s += expr`` submits without waiting; ``s["name"]`` waits for that variable."""

    def __init__(self, executor: StreamExecutor):
        self._executor = executor
        self.ret_value: Any = None  # what the program function returned

    def __iadd__(self, expr: Expr | str) -> "ProgramState":
        self._executor.submit(expr)
        return self

    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self._executor.vars

    def get_var(self, name: str) -> Any:
        return self._executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        """What the server reported for a gen or select (see meta.py); None for variables
        that no gen or select made."""
        return self._executor.get_meta(name)

    def text(self) -> str:
        """The whole text once everything submitted has run."""
        self._check()
        return self._executor.text_

    def messages(self) -> list[dict[str, str]]:
        """The role turns closed so far, as chat messages."""
        self._check()
        return list(self._executor.messages_)

    def variables(self) -> dict[str, Any]:
        self._check()
        return dict(self._executor.vars)

    def sync(self) -> None:
        self._executor.sync()

    def error(self) -> ProgramError | None:
        """The ``ProgramError`` that stopped this state (or one of its forks), else None."""
        return self._executor.sync_all()

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Stream a variable's pieces (or the whole text) as they are produced."""
        if var_name is None:
            return self._executor.iter_text()
        return self._executor.iter_var(var_name)

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """``text_iter`` for asyncio: each piece is awaited on a worker thread, so the event
        loop keeps running. ``return_meta_data``: yields ``(piece, meta_info)``, the meta
        info as known when the piece came ({} until the variable is complete)."""
        pieces = self.text_iter(var_name)
        done = object()
        while True:
            piece = await asyncio.to_thread(next, pieces, done)
            if piece is done:
                return
            if return_meta_data:
                yield piece, self._executor.meta_so_far(var_name) if var_name else {}
            else:
                yield piece

    def fork(self, size: int = 1, position_ids_offset: Sequence[int] | None = None, *,
             cache_prefix: bool = True) -> "ForkGroup":
        """``size`` branches that continue from this state's text, run in parallel.

        ``position_ids_offset`` (SGLang's parallel encoding) is accepted and not used: each
        branch is encoded after the shared text, as usual.
        """
        children = self._executor.fork(int(size), cache_prefix)
        return ForkGroup(self, [ProgramState(c) for c in children],
                         self._executor.last_prefix_result)

    @contextmanager
    def copy(self, position_ids_offset: Sequence[int] | None = None):
        """A one-branch fork, joined (its new variables gathered) when the block ends."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    @contextmanager
    def var_scope(self, name: str):
        """Variable ``name`` receives all the text appended inside the block."""
        self._executor.submit(VarScopeBegin(name))
        try:
            yield
        finally:
            self._executor.submit(VarScopeEnd(name))

    def system(self, expr: Expr | str | None = None):
        """``s.system(expr)`` appends a system turn; ``with s.system():`` opens one."""
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None):
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None):
        return self._role("assistant", expr)

    def _role(self, role: str, expr):
        if expr is None:
            return self._role_scope(role)
        self._executor.submit(role_expr(role, expr))
        return None

    @contextmanager
    def _role_scope(self, role: str):
        self._executor.submit(RoleBegin(role))
        try:
            yield self
        finally:
            self._executor.submit(RoleEnd(role))

    def _check(self) -> None:
        error = self._executor.sync_all()
        if error is not None:
            raise error

    def __repr__(self) -> str:
        return f"ProgramState({self.text()})"


class ForkGroup(Sequence[ProgramState]):
    """The branches of one fork; reading ``forks[i]["name"]`` waits for that branch."""

    def __init__(self, parent: ProgramState, states: list[ProgramState],
                 prefix_result: GenerateResult | None):
        self.parent = parent
        self.states = states
        # The one request that prefilled the shared prefix (None when nothing was sent).
        self.prefix_result = prefix_result
        self._base_vars = set(parent._executor.vars)

    def __getitem__(self, i):
        return self.states[i]

    def __setitem__(self, i, state: ProgramState) -> None:
        # ``forks[i] += expr`` stores the (same) branch back; anything else is a mistake.
        if state is not self.states[i]:
            raise TypeError("fork branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, expr: Expr | str | Callable[[int], Expr | str] | Sequence) -> "ForkGroup":
        """The same expression to every branch; ``lambda i: ...`` one per branch index; a
        list: its i-th element to branch i."""
        if isinstance(expr, (list, tuple)):
            if len(expr) != len(self.states):
                raise ValueError(f"{len(expr)} expressions for {len(self.states)} branches")
            parts = list(expr)
        elif callable(expr):
            parts = [expr(i) for i in range(len(self.states))]
        else:
            parts = [expr] * len(self.states)
        for state, part in zip(self.states, parts):
            state += part
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for all branches, then bring their results into the parent.

        ``gather_variable``: each variable made in the branches becomes a list in the parent.
        ``concate_and_append``: the branches' new text is appended to the parent's text.
        """
        for state in self.states:
            state._check()
        if mode == "gather_variable":
            names = {n for s in self.states for n in s._executor.vars} - self._base_vars
            for name in sorted(names):
                self.parent.set_var(name, [s._executor.vars.get(name) for s in self.states])
        elif mode == "concate_and_append":
            self.parent += "".join(s._executor.text_[s._executor.fork_start:]
                                   for s in self.states)
        else:
            raise ValueError(f"unknown join mode {mode!r}")
