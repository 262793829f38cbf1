"""Streamed output text of one request: incremental detokenization plus stop strings
and stop regular expressions.

Text that could still turn into a stop string is held back until it cannot; a stop
string and everything after it is never emitted (with ``include_stop``, the stop string
is, and nothing after it). A stop regular expression is searched in the output's last
``REGEX_WINDOW`` characters each time text is added; the output ends where the first
match ends (emitted text is never taken back, so the match is kept). The pieces a
request emits concatenate to exactly its final ``text``.
"""
from __future__ import annotations

import re

from .detokenizer import STATELESS_CONTEXT_IDS, IncrementalDetokenizer, TokenDecoder

REGEX_WINDOW = 1024  # characters of the output a stop regex is matched against


class TextState:
    def __init__(self, decoder: TokenDecoder, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, incremental: bool = True,
                 stop_regex: list[str] | None = None, include_stop: bool = False) -> None:
        self.decoder, self.skip = decoder, skip_special_tokens
        self.tokenizer = decoder.tokenizer
        self.prompt_ids = _clean_context(self.tokenizer, prompt_ids)
        self.detok = IncrementalDetokenizer(decoder, self.prompt_ids, skip_special_tokens)
        self.stop_regex = [re.compile(p) for p in stop_regex or ()]
        # Nobody reads the text before the end (no streaming, no stop strings): decode
        # once at the finish instead of every step.
        self.lazy_ids: list[int] | None = \
            None if incremental or stop or self.stop_regex else []
        self.stop = stop
        self.include_stop = include_stop
        self.pending = ""  # decoded but held back (may begin a stop string)
        self.text = ""  # emitted so far
        self.stopped = False

    def add(self, token_ids: list[int], check_stop: bool = True) -> str:
        """Feed new tokens; returns the text that became final. Sets ``stopped`` when a
        stop string appeared (the text is cut before it). ``check_stop=False`` (the
        output is shorter than min_tokens): no stop is looked for in this text."""
        if self.lazy_ids is not None:
            self.lazy_ids.extend(token_ids)
            return ""
        if not check_stop:
            out, self.pending = self.pending + self.detok.add(token_ids), ""
            self.text += out
            return out
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
        found = [(i, s) for s in self.stop if (i := buf.find(s)) >= 0]
        if found:
            cut, stop = min(found, key=lambda f: f[0])
            self.stopped = True
            out, self.pending = buf[:cut + len(stop) if self.include_stop else cut], ""
        elif final or not self.stop:
            out, self.pending = buf, ""
        else:
            hold = _partial_stop_len(buf, self.stop)
            out, self.pending = buf[:len(buf) - hold], buf[len(buf) - hold:]
        if self.stop_regex and out:
            out = self._regex_cut(out)
        self.text += out
        return out

    def _regex_cut(self, out: str) -> str:
        """``out`` up to the end of the first stop-regex match that ends inside it."""
        before = self.text[-REGEX_WINDOW:]
        tail = before + out
        ends = [m.end() for rx in self.stop_regex for m in rx.finditer(tail)
                if m.end() > len(before)]
        if not ends:
            return out
        self.stopped, self.pending = True, ""
        return out[:min(ends) - len(before)]


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
