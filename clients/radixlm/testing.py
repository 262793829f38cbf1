"""An in-process backend for testing programs without a server (one "token" = one character)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from . import wire
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

    It speaks the wire's sampling keys (unknown ones raise as the server's would) and the
    logprob contract the language reads: with ``logprobs`` k, each character's logprob is
    -1.0 and its k alternatives are it and the next k characters at -1.0, -2.0, ... (in
    the vLLM backend's shape, with token text; ``token_text=False``: a shape without token
    text); with ``prompt_logprobs`` the prompt's characters from ``logprob_start_len`` get
    -0.5 (the first of them none).
    """

    def __init__(self, reply: Reply = _default_reply, scorer: Scorer = _default_scorer,
                 fail: Callable[[str, dict[str, Any]], str | None] | None = None,
                 delay: float = 0.0, template: ChatTemplate | None = None,
                 piece_size: int = 2, token_text: bool = True):
        self.reply, self.scorer, self.fail = reply, scorer, fail
        self.delay = delay
        self.template = template or ChatTemplate.chatml()
        self.piece_size = piece_size
        self.token_text = token_text
        self.calls: list[tuple[str, str, dict[str, Any]]] = []  # (kind, prompt, params)
        self.max_concurrent = 0
        self._concurrent = 0
        self._cached: list[str] = []
        self._lock = threading.Lock()

    def chat_template(self) -> ChatTemplate:
        return self.template

    def unconditional_prompt(self) -> str:
        return ""

    def generate(self, prompt: str, params: dict[str, Any],
                 on_text: OnText | None = None) -> GenerateResult:
        wire.sampling_json(params)  # unknown keys fail here as they would on the server
        with self._enter("generate", prompt, params) as cached:
            samples = [self._sample(prompt, params, i, cached, on_text if i == 0 else None)
                       for i in range(params.get("n", 1))]
            return samples[0]._replace(samples=tuple(samples) if len(samples) > 1 else ())

    def _sample(self, prompt: str, params: dict[str, Any], index: int, cached: int,
                on_text: OnText | None) -> GenerateResult:
        text = self.reply(prompt, params)
        finish_reason = "length" if params.get("max_tokens", 1 << 30) < len(text) else "stop"
        for stop in params.get("stop") or ():
            text = text.split(stop)[0]
        text = text[: params.get("max_tokens", len(text))]
        if on_text is not None:
            for i in range(0, len(text), self.piece_size):
                on_text(text[i:i + self.piece_size])
        self._remember(prompt + text)
        start = params.get("logprob_start_len", 0) \
            if params.get("prompt_logprobs") is not None else None
        return GenerateResult(
            text=text, finish_reason=finish_reason, output_ids=tuple(ord(c) for c in text),
            num_input_tokens=len(prompt), num_output_tokens=len(text), num_cached_tokens=cached,
            index=index,
            logprobs=[self._logprob(c, params["logprobs"]) for c in text]
            if params.get("logprobs") is not None else None,
            prompt_logprobs=None if start is None else [
                {"token_id": ord(c), "logprob": None if i == start else -0.5,
                 **({"text": c} if self.token_text else {})}
                for i, c in enumerate(prompt) if i >= start])

    def _logprob(self, char: str, k: int) -> dict[str, Any]:
        if self.token_text:  # the vLLM backend's shape, which carries the token text
            return {str(ord(char) + j): {"logprob": -1.0 - j, "rank": j + 1,
                                         "decoded_token": chr(ord(char) + j)}
                    for j in range(k + 1)}
        return {str(ord(char) + j): {"logprob": -1.0 - j, "rank": j + 1}
                for j in range(k + 1)}

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
