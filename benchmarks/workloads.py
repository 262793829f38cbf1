"""Shared-prefix workloads (token-id programs) used by the engine benchmarks.

A workload is a list of rounds; each round is a list of requests submitted together,
and a round may build on the outputs of the one before it (multi-turn chat)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int


@dataclass
class Workload:
    name: str
    # rounds(previous_outputs) -> next round's requests, or None when done
    next_round: Callable[[list[list[int]] | None, int], list[Request] | None]
    description: str = ""
    meta: dict = field(default_factory=dict)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def few_shot(vocab: int, num_questions: int = 32, shots_tokens: int = 512, question_tokens: int = 24,
             new_tokens: int = 16, seed: int = 0) -> Workload:
    """One block of shared few-shot examples, then a different question per request."""
    rng = random.Random(seed)
    shots = _tokens(rng, shots_tokens, vocab)
    reqs = [Request(shots + _tokens(rng, question_tokens, vocab), new_tokens) for _ in range(num_questions)]
    return Workload("few-shot", lambda prev, i: reqs if i == 0 else None,
                    f"{num_questions} questions after {shots_tokens} shared example tokens, "
                    f"{new_tokens}-token answers")


def multi_turn(vocab: int, num_sessions: int = 8, turns: int = 4, system_tokens: int = 128,
               user_tokens: int = 32, new_tokens: int = 16, seed: int = 1) -> Workload:
    """Chat sessions: each turn resends the history (system, users, answers) plus a new message."""
    rng = random.Random(seed)
    system = _tokens(rng, system_tokens, vocab)
    history = [list(system) for _ in range(num_sessions)]

    def next_round(prev, i):
        if i >= turns:
            return None
        if prev is not None:
            for h, answer in zip(history, prev):
                h.extend(answer)
        for h in history:
            h.extend(_tokens(rng, user_tokens, vocab))
        return [Request(list(h), new_tokens) for h in history]

    return Workload("multi-turn", next_round,
                    f"{num_sessions} sessions x {turns} turns, {system_tokens}-token system prompt, "
                    f"{new_tokens}-token answers")


def tree_of_thought(vocab: int, branching: int = 3, depth: int = 3, root_tokens: int = 256,
                    step_tokens: int = 16, new_tokens: int = 16, seed: int = 2) -> Workload:
    """Each level expands every node into ``branching`` children that extend its text."""
    rng = random.Random(seed)
    frontier = [_tokens(rng, root_tokens, vocab)]

    def next_round(prev, i):
        nonlocal frontier
        if i >= depth:
            return None
        if prev is not None:
            frontier = [node + answer for node, answer in zip(frontier, prev)]
        frontier = [node + _tokens(rng, step_tokens, vocab) for node in frontier for _ in range(branching)]
        return [Request(list(node), new_tokens) for node in frontier]

    return Workload("tree-of-thought", next_round,
                    f"branching {branching}, depth {depth}, {root_tokens}-token root, "
                    f"{new_tokens}-token steps")


class BestHitTracker:
    """Hit tokens of an ideal cache (infinite, perfect order): a prompt token is a hit if
    an earlier round's prompt+output, or another prompt of the same round, covers it."""

    def __init__(self) -> None:
        self.root: dict = {}

    def _insert(self, tokens: list[int]) -> None:
        node = self.root
        for t in tokens:
            node = node.setdefault(t, {})

    def _match(self, tokens: list[int]) -> int:
        node, n = self.root, 0
        for t in tokens:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    def round(self, prompts: list[list[int]]) -> int:
        hits = 0
        for p in prompts:
            hits += min(self._match(p), len(p) - 1)
            self._insert(p)
        return hits

    def finished(self, prompt: list[int], output: list[int]) -> None:
        self._insert(prompt + output[:-1])
