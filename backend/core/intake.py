"""From a caller's prompt and parameters to the scheduler's requests: tokenizing,
checking that it fits, one request per sample (or per scored choice), and starting the
compilation of its constraint. Runs on the caller's thread; raises ValueError on bad
input."""
from __future__ import annotations

import threading

from .detokenizer import TokenDecoder
from .radix_cache import common_prefix_len
from .request import Req
from .sampling_params import SamplingParams
from .text_state import TextState


class GrammarProvider:
    """The model's ``grammar.GrammarBackend``, made with the first constrained request
    (xgrammar and its tokenizer tables cost seconds to set up)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 compile_threads: int) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids, compile_threads)
        self._lock = threading.Lock()
        self.backend = None  # grammar.GrammarBackend once a request needed one

    def get(self):
        with self._lock:
            if self.backend is None:
                from .grammar import GrammarBackend

                tokenizer, vocab_size, stop_ids, threads = self._args
                self.backend = GrammarBackend(tokenizer, vocab_size, stop_token_ids=stop_ids,
                                              max_workers=threads)
            return self.backend


class RequestIntake:
    def __init__(self, tokenizer, vocab_size: int, context_len: int, kv_slots: int,
                 share_prefill: bool, grammar: GrammarProvider) -> None:
        self.tokenizer = tokenizer
        self.decoder = TokenDecoder(tokenizer)
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.kv_slots = kv_slots
        self.share_prefill = share_prefill  # later samples wait for the first's prompt KV
        self.grammar = grammar

    def samples(self, group_id: str, prompt, params: SamplingParams, stream: bool) -> list[Req]:
        """One request per sample. ``stream=False``: text is decoded once, at the end."""
        ids = self.prompt_ids(prompt)
        self._check_fits(ids)
        reqs = [self._new_req(group_id, i, ids, params) for i in range(params.n)]
        for r in reqs[1:]:
            r.blocked_by = reqs[0] if self.share_prefill else None  # share one prefill
        self._start_grammar(reqs, params)
        self._attach_text(reqs, stream)
        return reqs

    def choices(self, group_id: str, prompt, choices: list[str]) -> list[Req]:
        """One request per choice, scoring the choice's tokens after ``prompt``."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        prefix = self.prompt_ids(prompt) if not isinstance(prompt, str) or prompt else []
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        reqs = []
        for i, choice in enumerate(choices):
            if isinstance(prompt, str):
                full = self.tokenizer.encode(text + choice, add_special_tokens=False)
            else:
                full = prefix + self.tokenizer.encode(choice, add_special_tokens=False)
            # the choice starts where its tokenization leaves the prompt's
            start = max(min(common_prefix_len(prefix, full), len(full) - 1), 1)
            self._check_fits(full)
            params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs_start=start)
            req = self._new_req(group_id, i, full, params)
            req.is_choice = True
            reqs.append(req)
        for r in reqs[1:]:
            r.blocked_by = reqs[0] if self.share_prefill else None  # prefix prefilled once
        self._attach_text(reqs, True)
        return reqs

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return ids

    def _check_fits(self, ids: list[int]) -> None:
        if len(ids) >= self.context_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length is "
                             f"{self.context_len} (prompt plus at least one new token must fit)")
        if len(ids) + 1 > self.kv_slots:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds {self.kv_slots}")

    @staticmethod
    def _new_req(group_id: str, index: int, ids: list[int], params: SamplingParams) -> Req:
        rid = group_id if index == 0 else f"{group_id}#{index}"
        return Req(rid=rid, group_id=group_id, index=index, origin_input_ids=list(ids),
                   params=params)

    def _start_grammar(self, reqs: list[Req], params: SamplingParams) -> None:
        """Start compiling the constraint off this thread; one already known to be invalid
        fails here, others fail when their compilation finishes."""
        constraint = params.constraint
        if constraint is None:
            return
        future = self.grammar.get().submit(*constraint)
        if future.done() and future.exception() is not None:
            raise ValueError(str(future.exception()))
        for r in reqs:
            r.grammar_future = future

    def _attach_text(self, reqs: list[Req], stream: bool) -> None:
        for r in reqs:
            r.text_state = TextState(self.decoder, r.origin_input_ids, r.params.stop,
                                     r.params.skip_special_tokens, incremental=stream)
