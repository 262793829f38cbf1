"""What a program sees: ``ProgramState`` (``s``) and the ``ForkGroup`` that ``s.fork(n)`` returns."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from .interpreter import StreamExecutor
from .ir import Expr, RoleBegin, RoleEnd, assistant, system, user
from .results import GenerateResult


class ProgramState:
    """``s += expr`` submits without waiting; ``s["name"]`` waits for that variable."""

    def __init__(self, executor: StreamExecutor):
        self._executor = executor

    def __iadd__(self, expr: Expr | str) -> "ProgramState":
        self._executor.submit(expr)
        return self

    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def get_var(self, name: str) -> Any:
        return self._executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """What the server reported for a gen (counts, finish_reason) or select (scores)."""
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

    @property
    def error(self):
        """The ``ProgramError`` that stopped this state (or one of its forks), else None."""
        return self._executor.sync_all()

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Stream a variable's pieces (or the whole text) as they are produced."""
        if var_name is None:
            return self._executor.iter_text()
        return self._executor.iter_var(var_name)

    def fork(self, size: int = 1, cache_prefix: bool = True) -> "ForkGroup":
        """``size`` branches that continue from this state's text, run in parallel."""
        children = self._executor.fork(size, cache_prefix)
        return ForkGroup(self, [ProgramState(c) for c in children],
                         self._executor.last_prefix_result)

    def system(self, expr: Expr | str | None = None):
        return self._role("system", expr, system)

    def user(self, expr: Expr | str | None = None):
        return self._role("user", expr, user)

    def assistant(self, expr: Expr | str | None = None):
        return self._role("assistant", expr, assistant)

    def _role(self, role: str, expr, wrap):
        if expr is None:
            return self._role_scope(role)
        self._executor.submit(wrap(expr))
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
        return f"ProgramState(text={self._executor.text_[-60:]!r})"


class ForkGroup(Sequence[ProgramState]):
    """The branches of one fork; reading ``forks[i]["name"]`` waits for that branch."""

    def __init__(self, parent: ProgramState, states: list[ProgramState],
                 prefix_result: GenerateResult | None):
        self.parent = parent
        self.states = states
        # The one request that prefilled the shared prefix (None when nothing was sent).
        self.prefix_result = prefix_result
        self._base_vars = set(parent._executor.vars)
        self._prefix_len = len(parent._executor.text_)  # the parent is synced at fork time

    def __getitem__(self, i):
        return self.states[i]

    def __setitem__(self, i, state: ProgramState) -> None:
        # ``forks[i] += expr`` stores the (same) branch back; anything else is a mistake.
        if state is not self.states[i]:
            raise TypeError("fork branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, expr: Expr | str) -> "ForkGroup":
        for state in self.states:
            state += expr
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
            self.parent += "".join(s._executor.text_[self._prefix_len:] for s in self.states)
        else:
            raise ValueError(f"unknown join mode {mode!r}")
