"""An in-process backend for testing programs without a server (one "token" = one character)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from .backend import BaseBackend, OnText
from .chat_template import ChatTemplate
from .errors import ServerError
from .results import ChoiceScore, GenerateResult, ScoreResult

Reply = Callable[[str, dict[str, Any]], str]
Scorer = Callable[[str, str], Sequence[float]]


def _default_reply(prompt: str, params: dict[str, Any]) -> str:
    return "ok"


def _default_scorer(prompt: str, choice: str) -> Sequence[float]:
    return [-1.0] * len(choice)


class FakeBackend(BaseBackend):
    """Deterministic stand-in for a server.

    ``reply(prompt, params)`` makes the text of a gen (then cut at ``stop`` and ``max_tokens``);
    ``scorer(prompt, choice)`` gives a choice's per-token logprobs; ``fail(prompt, params)``
    may return an error message to raise as ``ServerError``; ``delay`` seconds are slept per
    call. Calls are recorded, the peak number of concurrent calls is kept, and
    ``num_cached_tokens`` is the longest prefix shared with any earlier prompt or output
    (a radix cache at character granularity).
    """

    def __init__(self, reply: Reply = _default_reply, scorer: Scorer = _default_scorer,
                 fail: Callable[[str, dict[str, Any]], str | None] | None = None,
                 delay: float = 0.0, template: ChatTemplate | None = None,
                 piece_size: int = 2):
        self.reply, self.scorer, self.fail = reply, scorer, fail
        self.delay = delay
        self.template = template or ChatTemplate.chatml()
        self.piece_size = piece_size
        self.calls: list[tuple[str, str, dict[str, Any]]] = []  # (kind, prompt, params)
        self.max_concurrent = 0
        self._concurrent = 0
        self._cached: list[str] = []
        self._lock = threading.Lock()

    def chat_template(self) -> ChatTemplate:
        return self.template

    def generate(self, prompt: str, params: dict[str, Any],
                 on_text: OnText | None = None) -> GenerateResult:
        with self._enter("generate", prompt, params) as cached:
            text = self.reply(prompt, params)
            finish_reason = "length" if params.get("max_tokens", 1 << 30) < len(text) else "stop"
            for stop in params.get("stop") or ():
                text = text.split(stop)[0]
            text = text[: params.get("max_tokens", len(text))]
            if on_text is not None:
                for i in range(0, len(text), self.piece_size):
                    on_text(text[i:i + self.piece_size])
            self._remember(prompt + text)
            return GenerateResult(text=text, finish_reason=finish_reason,
                                  output_ids=tuple(ord(c) for c in text),
                                  num_input_tokens=len(prompt), num_output_tokens=len(text),
                                  num_cached_tokens=cached)

    def score(self, prompt: str, choices: Sequence[str]) -> ScoreResult:
        with self._enter("score", prompt, {"choices": list(choices)}) as cached:
            scores = []
            for choice in choices:
                logprobs = tuple(float(x) for x in self.scorer(prompt, choice))
                scores.append(ChoiceScore(choice, sum(logprobs), len(logprobs),
                                          sum(logprobs) / max(len(logprobs), 1), logprobs))
            self._remember(prompt)
            return ScoreResult(tuple(scores), len(prompt), cached)

    def _remember(self, text: str) -> None:
        with self._lock:
            self._cached.append(text)

    @contextmanager
    def _enter(self, kind: str, prompt: str, params: dict[str, Any]) -> Iterator[int]:
        """Record the call, count concurrency, sleep, maybe fail; yields the cached length."""
        with self._lock:
            self.calls.append((kind, prompt, dict(params)))
            self._concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self._concurrent)
            cached = max((_common_prefix(prompt, c) for c in self._cached), default=0)
        try:
            if self.delay:
                time.sleep(self.delay)
            message = self.fail(prompt, params) if self.fail else None
            if message:
                raise ServerError(message)
            yield cached
        finally:
            with self._lock:
                self._concurrent -= 1


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
