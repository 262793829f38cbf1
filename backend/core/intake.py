"""From a caller's prompt and parameters to the scheduler's requests: tokenizing,
checking that it fits, one request per sample (or per scored choice), and starting the
compilation of its constraint. Runs on the caller's thread; raises ValueError on bad
input."""
from __future__ import annotations

import dataclasses
import threading

from .detokenizer import TokenDecoder
from .limits import RequestLimits
from .radix_node import common_prefix_len
from .request import LogitRules, Req
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
                 share_prefill: bool, grammar: GrammarProvider, eos_token_ids: list[int],
                 limits: RequestLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.decoder = TokenDecoder(tokenizer)
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.kv_slots = kv_slots
        self.share_prefill = share_prefill  # later samples wait for the first's prompt KV
        self.grammar = grammar
        self.eos_token_ids = list(eos_token_ids)
        self.limits = limits or RequestLimits()

    def samples(self, group_id: str, prompt, params: SamplingParams, stream: bool) -> list[Req]:
        """One request per sample (best_of of them when it is larger than n).
        ``stream=False``: text is decoded once, at the end."""
        self.limits.check(params)
        self._check_token_ids(params)
        if params.num_samples > params.n and not params.cumulative_logprob:
            # the n best of best_of samples are picked by their cumulative logprob
            params = dataclasses.replace(params, cumulative_logprob=True)
        ids = self.prompt_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        self.limits.check_prompt(len(ids), params)
        self._check_fits(ids)
        rules = self._logit_rules(params)
        reqs = [self._new_req(group_id, i, ids, params, rules)
                for i in range(params.num_samples)]
        if params.prompt_logprobs is not None:  # sample 0 computes them for all
            reqs[0].prompt_logprobs_start = min(params.logprob_start_len, len(ids) - 1) + 1
        for r in reqs[1:]:
            r.blocked_by = reqs[0] if self.share_prefill else None  # share one prefill
        self._start_grammar(reqs, params)
        self._attach_text(reqs, stream)
        return reqs

    def choices(self, group_id: str, prompt, choices: list[str]) -> list[Req]:
        """One request per choice, scoring the choice's tokens after ``prompt``. An
        empty prompt scores each choice from its second token (nothing precedes its
        first), unless the tokenizer starts every text with a BOS token."""
        if not isinstance(choices, list) or not choices or not all(
                isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        self.limits.check_choices(choices)
        empty = isinstance(prompt, str) and not prompt
        prefix = [] if empty else self.prompt_ids(prompt)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        reqs = []
        for i, choice in enumerate(choices):
            if empty:
                full = self.tokenizer.encode(choice)  # a BOS, if the tokenizer adds one
            elif isinstance(prompt, str):
                full = self.tokenizer.encode(text + choice, add_special_tokens=False)
            else:
                full = prefix + self.tokenizer.encode(choice, add_special_tokens=False)
            # the choice starts where its tokenization leaves the prompt's
            start = max(min(common_prefix_len(prefix, full), len(full) - 1), 1)
            self._check_fits(full)
            params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs_start=start)
            req = self._new_req(group_id, i, full, params)
            req.prompt_logprobs_start = start
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
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)),
                   None)
        if bad is not None:
            raise ValueError(f"input_ids must be token ids in [0, {self.vocab_size}), got {bad}")
        return ids

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Every token id a request names must be in the model's vocabulary."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size ({vocab}), "
                             f"got {params.top_k}")
        for key in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = getattr(params, key) or ()
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                what = "keys" if key == "logit_bias" else "entries"
                raise ValueError(f"{key} {what} must be token ids in [0, {vocab}), got {bad}")

    def _logit_rules(self, params: SamplingParams) -> LogitRules | None:
        if not params.has_logit_rules:
            return None
        bias = params.logit_bias or {}
        stop_ids = ([] if params.ignore_eos else self.eos_token_ids) + params.stop_token_ids
        return LogitRules(list(bias), [float(v) for v in bias.values()],
                          params.allowed_token_ids, self._bad_word_ids(params.bad_words or []),
                          params.min_new_tokens, sorted(set(stop_ids)))

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as it would appear at the start of the output and
        after a space (tokenizers spell a word differently there)."""
        found: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    def _check_fits(self, ids: list[int]) -> None:
        if len(ids) >= self.context_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length is "
                             f"{self.context_len} (prompt plus at least one new token must fit)")
        if len(ids) + 1 > self.kv_slots:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds {self.kv_slots}")

    @staticmethod
    def _new_req(group_id: str, index: int, ids: list[int], params: SamplingParams,
                 rules: LogitRules | None = None) -> Req:
        rid = group_id if index == 0 else f"{group_id}#{index}"
        return Req(rid=rid, group_id=group_id, index=index, origin_input_ids=list(ids),
                   params=params, rules=rules)

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
            p = r.params
            r.text_state = TextState(self.decoder, r.origin_input_ids, p.stop,
                                     p.skip_special_tokens, incremental=stream,
                                     stop_regex=p.stop_regex,
                                     include_stop=p.include_stop_str_in_output)
