"""Multi-turn chats for the two-tier cache benchmarks: many users, each turn resending the
whole history (a shared system prompt, the earlier messages and the model's answers).

The histories grow to about HISTORY_TOKENS each; together they average ``WORKING_SET_X``
times the GPU KV pool, and the host tier holds ``HOST_RATIO`` pools (room for every
history). Users come back in an order that varies (think times differ), a fixed number
of turns in flight. Message and answer lengths vary around their means (half to one and
a half times), seeded, so every configuration sees the same trace.

``ChatTrace`` is the driver-independent part: ``next_turns()`` gives the prompts to
submit now, ``done(turn, output_ids)`` takes an answer back. Used by
``gpu/bench_cache_tiers.py`` (the engine on a GPU) and ``bench_tier_host.py`` (the
scheduler, radix cache and tiers alone, on the CPU).
"""
from __future__ import annotations

import collections
import random
from dataclasses import dataclass
from typing import NamedTuple

HISTORY_TOKENS = 6144  # a history's length after its last turn (about)
WORKING_SET_X = 4.0  # histories on average / GPU KV pool
HOST_RATIO = 8.0  # host tier / GPU KV pool


@dataclass(frozen=True)
class ChatSpec:
    users: int
    turns: int
    in_flight: int
    system: int  # tokens of the system prompt every user shares
    message: int  # mean tokens of a user message
    answer: int  # mean tokens of an answer

    def mean_working_set(self) -> int:
        """Tokens of all users' histories, averaged over the run (a history grows by one
        message and one answer a turn)."""
        return int(self.users * (self.system + (self.message + self.answer) * self.turns / 2))

    def pool_tokens(self) -> int:
        return int(self.mean_working_set() / WORKING_SET_X)


def _spec(users: int, turns: int, in_flight: int, answer: int, system: int = 1024,
          history: int = HISTORY_TOKENS) -> ChatSpec:
    message = (history - system) // turns - answer
    return ChatSpec(users, turns, in_flight, system, message, answer)


# per model shape (bench_cache_tiers.py picks by the model's directory name)
SPECS = {
    "llama-1b": _spec(users=48, turns=10, in_flight=24, answer=96),
    "llama-8b": _spec(users=32, turns=6, in_flight=16, answer=128),
    "quick": ChatSpec(users=12, turns=3, in_flight=4, system=32, message=16, answer=4),
}


class Turn(NamedTuple):
    user: int
    prompt: list[int]  # the history so far and this turn's message
    max_new_tokens: int  # this turn's answer length


class ChatTrace:
    """The chats of ``spec``'s users, one turn per user in flight at a time."""

    def __init__(self, spec: ChatSpec, seed: int, vocab: tuple[int, int] = (100, 32000)) -> None:
        self.spec = spec
        self._rng = random.Random(seed)
        self._vocab = vocab
        system = self._tokens(spec.system)
        self._history = [list(system) for _ in range(spec.users)]
        self._left = [spec.turns] * spec.users
        self._ready = collections.deque(range(spec.users))
        self.in_flight = 0

    @property
    def finished(self) -> bool:
        return not self._ready and self.in_flight == 0

    def next_turns(self) -> list[Turn]:
        """Turns to submit now: users whose answer came back, up to ``in_flight``."""
        out = []
        while self._ready and self.in_flight < self.spec.in_flight:
            user = self._ready.popleft()
            prompt = self._history[user] + self._tokens(self._vary(self.spec.message))
            out.append(Turn(user, prompt, self._vary(self.spec.answer)))
            self.in_flight += 1
        return out

    def done(self, turn: Turn, output_ids: list[int]) -> None:
        """The answer to ``turn``: it joins the user's history; the user comes back
        later (somewhere in the queue's later half: think times vary)."""
        self.in_flight -= 1
        self._history[turn.user] = turn.prompt + list(output_ids)
        self._left[turn.user] -= 1
        if self._left[turn.user]:
            ready = self._ready
            ready.insert(self._rng.randint(len(ready) // 2, len(ready)), turn.user)

    def _vary(self, mean: int) -> int:
        return max(1, self._rng.randint(mean // 2, mean + mean // 2))

    def _tokens(self, n: int) -> list[int]:
        lo, hi = self._vocab
        return [self._rng.randrange(lo, hi) for _ in range(n)]
