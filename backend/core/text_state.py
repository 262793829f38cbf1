"""Streamed output text of one request: incremental detokenization plus stop strings.

Text that could still turn into a stop string is held back until it cannot; a stop
string and everything after it is never emitted. The pieces a request emits concatenate
to exactly its final ``text``.
"""
from __future__ import annotations

from .detokenizer import STATELESS_CONTEXT_IDS, IncrementalDetokenizer, TokenDecoder


class TextState:
    def __init__(self, decoder: TokenDecoder, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, incremental: bool = True) -> None:
        self.decoder, self.skip = decoder, skip_special_tokens
        self.tokenizer = decoder.tokenizer
        self.prompt_ids = _clean_context(self.tokenizer, prompt_ids)
        self.detok = IncrementalDetokenizer(decoder, self.prompt_ids, skip_special_tokens)
        # Nobody reads the text before the end (no streaming, no stop strings): decode
        # once at the finish instead of every step.
        self.lazy_ids: list[int] | None = None if incremental or stop else []
        self.stop = stop
        self.pending = ""  # decoded but held back (may begin a stop string)
        self.text = ""  # emitted so far
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that became final. Sets ``stopped`` when a
        stop string appeared (the text is cut before it)."""
        if self.lazy_ids is not None:
            self.lazy_ids.extend(token_ids)
            return ""
        return self._emit(self.pending + self.detok.add(token_ids), final=False)

    def jump(self, output_ids: list[int]) -> str:
        """The output was re-tokenized (jump-forward): its bytes only grew, so the text
        emitted so far is still a prefix. Emit the new tail and restart decoding after it."""
        if self.lazy_ids is not None:
            self.lazy_ids = list(output_ids)
            return ""
        full = self.tokenizer.decode(output_ids, skip_special_tokens=self.skip)
        seen = self.text + self.pending
        self.detok = IncrementalDetokenizer(self.decoder, self.prompt_ids + output_ids, self.skip)
        return self._emit(self.pending + full[len(seen):], final=False)

    def finish(self) -> str:
        """The request ended: release what was held back."""
        if self.stopped:
            return ""
        if self.lazy_ids is not None:
            ids, self.lazy_ids = self.lazy_ids, None
            return self._emit(self.detok.add(ids) + self.detok.flush(), final=True)
        return self._emit(self.pending + self.detok.flush(), final=True)

    def _emit(self, buf: str, final: bool) -> str:
        if self.stopped:
            return ""
        cut = min((i for i in (buf.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = buf[:cut], ""
        elif final or not self.stop:
            out, self.pending = buf, ""
        else:
            hold = _partial_stop_len(buf, self.stop)
            out, self.pending = buf[:len(buf) - hold], buf[len(buf) - hold:]
        self.text += out
        return out


def _clean_context(tokenizer, prompt_ids: list[int]) -> list[int]:
    """The prompt tail as decoding context (it keeps a SentencePiece leading space), unless
    it ends inside a character: then output text is decoded on its own, so it never starts
    with bytes that belong to the prompt."""
    tail = prompt_ids[-STATELESS_CONTEXT_IDS:]
    if tokenizer.decode(tail, skip_special_tokens=False).endswith("\ufffd"):
        return []
    return tail


def _partial_stop_len(buf: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(buf)), best, -1):
            if buf.endswith(stop[:k]):
                best = k
                break
    return best
