"""Structured decoding (JSON schema, JSON, regex, EBNF, choices) on top of xgrammar.

A leaf module: the scheduler owns one ``GrammarBackend`` per model, submits each request's
constraint for compilation off its own thread, and gives every request (every sample when
n > 1) a ``GrammarState``. Per decode step the sampler fills one bitmask row per constrained
request, applies it to the logits, and the chosen token is fed back with ``accept``.

Jump-forward (``GrammarBackend.jump_forward``) appends text the grammar forces without
decoding it token by token. Invariants the engine must keep when it uses it:

1. The matcher has accepted exactly the request's output tokens, one ``accept`` per token
   and in order (sampled token included), so rolling back N steps removes the last N tokens.
2. On ``JumpForward(drop, new)`` the output becomes ``output[:-drop] + new``. The KV of the
   dropped positions was computed for tokens that are no longer in the sequence: those slots
   must leave the request's token table (freed if the request owns them) and must never be
   paired with the new ids. The radix cache keys KV by the exact tokens that produced it, so
   it may only ever hold prefixes of the current sequence; simplest is to insert output
   tokens no later than finish, or only up to ``len(output) - lookback``.
3. The new tokens are prefilled (an extend step) before the next sample; they have no
   sampled logprobs. Their bytes are forced, so ``bytes(old output) + forced`` equals
   ``bytes(new output)``: streamed text is never retracted, only detokenizer offsets change.
   Stop strings and ``max_new_tokens`` must also be checked against the jumped tokens.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Sequence

import torch
import xgrammar as xgr

from .token_mask import apply_bitmask

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choices")
# xgrammar errors carry a C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: Check failed: ...
# is false: "); strip it so clients see only the reason.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?", re.S)
# the character class of xgrammar's length-bounded JSON strings, and the JSON-legal one
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'
_EBNF_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


class JumpForward(NamedTuple):
    num_tokens_to_drop: int  # trailing output tokens to remove (their KV is invalid)
    new_token_ids: list[int]  # tokens to append after the drop; empty: no jump


def ebnf_literal(text: str) -> str:
    """``text`` as an xgrammar EBNF string literal (quotes, backslashes, controls escaped)."""
    out = []
    for ch in text:
        if ch in _EBNF_ESCAPES:
            out.append(_EBNF_ESCAPES[ch])
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)  # non-ASCII is matched as its UTF-8 bytes
    return '"' + "".join(out) + '"'


def choices_to_ebnf(text: str) -> str:
    """EBNF matching exactly one of the strings in the JSON list ``text``."""
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"choices must be a JSON list of strings: {exc}") from None
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, str) and c for c in choices)):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    # An alternation of literals rather than a regex: no regex metacharacter escaping to get
    # wrong, and the Earley parser handles shared prefixes ("yes" | "yesterday").
    return "root ::= " + " | ".join(ebnf_literal(c) for c in dict.fromkeys(choices))


class GrammarState:
    """One request's matcher plus the count of tokens it can roll back."""

    def __init__(self, compiled: xgr.CompiledGrammar | None = None, *,
                 _matcher: xgr.GrammarMatcher | None = None, _num_tokens: int = 0) -> None:
        self._matcher = _matcher if _matcher is not None else xgr.GrammarMatcher(compiled)
        self.num_tokens = _num_tokens  # accepted tokens not rolled back (rollback budget)

    @property
    def stop_token_ids(self) -> list[int]:
        """The only tokens allowed once the grammar is complete; accepting one terminates."""
        return self._matcher.stop_token_ids

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed-next-token mask into ``bitmask[row]`` (a CPU int32 tensor)."""
        if not self._matcher.is_terminated():
            return self._matcher.fill_next_token_bitmask(bitmask, row)
        # The request is finishing but an overlapped step may still ask: allow only stop
        # tokens so the row never becomes all -inf (NaN after softmax).
        bits = torch.zeros(bitmask.shape[-1] * 32, dtype=torch.bool)
        bits[self.stop_token_ids] = True
        weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
        bitmask[row] = (bits.view(-1, 32).long() * weights).sum(-1).to(torch.int32)
        return True

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar rejects it."""
        ok = self._matcher.accept_token(int(token_id))
        self.num_tokens += ok
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Accept all of ``token_ids`` or, if any is rejected, none of them."""
        for i, token in enumerate(token_ids):
            if not self.accept(token):
                self.rollback(i)
                return False
        return True

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"cannot roll back {n} tokens, only {self.num_tokens} accepted")
        if n:
            self._matcher.rollback(n)
            self.num_tokens -= n

    def is_terminated(self) -> bool:
        """A stop token was accepted: the request must finish now."""
        return self._matcher.is_terminated()

    def can_stop(self) -> bool:
        """The output so far is a complete match, so a stop/eos token is allowed next."""
        return self._matcher.is_completed()

    def jump_forward_text(self) -> str:
        """Text the grammar forces next ("" if none or terminated)."""
        if self._matcher.is_terminated():
            return ""
        return self._matcher.find_jump_forward_string()

    def copy(self) -> "GrammarState":
        """Independent state at the same position (cheap fork), e.g. for n > 1 samples."""
        return GrammarState(_matcher=self._matcher.fork(), _num_tokens=self.num_tokens)


class GrammarBackend:
    """Compiles constraints for one tokenizer/vocab and hands out per-request states."""

    def __init__(self, tokenizer, vocab_size: int | None = None, *,
                 stop_token_ids: Sequence[int] | None = None, max_workers: int = 2,
                 compile_threads: int = 1, max_cache_entries: int = 512,
                 mask_threads: int | str = "auto") -> None:
        # The model vocab may exceed the tokenizer's (padded embeddings); the extra ids
        # decode to nothing and are always masked.
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size or len(tokenizer))
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        # Our own cache holds the results, so xgrammar's second cache would only duplicate.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads,
                                             cache_enabled=False)
        self._token_bytes: list[bytes] = self.tokenizer_info.decoded_vocab
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._max_cache_entries = max_cache_entries
        self._lock = threading.Lock()
        self.num_compilations = 0  # compilations started (cache misses), for stats and tests
        # masks of a batch's rows computed in parallel ("auto": half the hardware threads)
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=mask_threads)

    def fill_bitmasks(self, bitmask: torch.Tensor, rows: Sequence[tuple[GrammarState, int]]) -> None:
        """``state.fill_bitmask(bitmask, row)`` for every pair, the live matchers in one
        multi-threaded call (a mask costs tens to hundreds of microseconds of CPU per row,
        and a step may have a hundred constrained rows)."""
        live = []
        for state, row in rows:
            if state.is_terminated():
                state.fill_bitmask(bitmask, row)  # stop tokens only: not the matcher's to say
            else:
                live.append((state, row))
        if len(live) == 1:  # no thread hand-off for one row
            live[0][0].fill_bitmask(bitmask, live[0][1])
        elif live:
            self._batch_matcher.batch_fill_next_token_bitmask(
                [state.matcher for state, _ in live], bitmask, [row for _, row in live])

    def submit(self, kind: str, text: str) -> Future:
        """Start (or share) the compilation of one constraint; never blocks on compiling.

        The future yields a ``CompiledGrammar`` or raises ``ValueError`` naming the kind and
        the reason. Same (kind, text) shares one future, in flight or done (LRU-bounded).
        """
        if kind not in KINDS:
            future: Future = Future()
            future.set_exception(ValueError(
                f"unknown constraint kind {kind!r}; expected one of {', '.join(KINDS)}"))
            return future
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            self.num_compilations += 1
            future = self._pool.submit(self._compile, kind, text)
            self._cache[key] = future
            while len(self._cache) > self._max_cache_entries:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_unless_deterministic(key, f))
        return future

    def _forget_unless_deterministic(self, key, future: Future) -> None:
        # Invalid constraints fail the same way every time, so keeping the ValueError saves
        # recompiling them; anything else (cancelled, MemoryError) may succeed on retry.
        if future.cancelled() or not isinstance(future.exception(), (type(None), ValueError)):
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_schema":
                try:
                    json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not valid JSON: {exc}") from None
                # No free whitespace: with it a weak model can emit spaces forever.
                ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False))
                # xgrammar 0.2.9 lets length-bounded strings hold raw control characters,
                # which JSON forbids (strict parsers reject the output): exclude them.
                return self._compiler.compile_grammar(
                    ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "ebnf":
                return self._compiler.compile_grammar(text)
            return self._compiler.compile_grammar(choices_to_ebnf(text))
        except (ValueError, RuntimeError) as exc:  # xgrammar reports bad input as RuntimeError
            reason = _LOG_PREFIX.sub("", str(exc).strip())
            raise ValueError(f"invalid {kind} constraint: {reason}") from None

    def create_state(self, compiled: xgr.CompiledGrammar) -> GrammarState:
        return GrammarState(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """CPU int32 bitmask, all tokens allowed; pinned when a GPU may consume it."""
        bitmask = xgr.allocate_token_bitmask(batch_size, self.vocab_size)
        return bitmask.pin_memory() if torch.cuda.is_available() else bitmask

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Sequence[int] | None = None) -> None:
        apply_bitmask(logits, bitmask, rows, self.vocab_size)

    def jump_forward(self, state: GrammarState, output_ids: Sequence[int],
                     forced_text: str | None = None, *, lookback: int = 4,
                     max_added: int | None = None) -> JumpForward:
        """Tokens that append the forced text, re-tokenized across the output boundary.

        The last ``lookback`` output tokens are decoded, joined with the forced text and
        re-encoded; tokens up to the first difference are kept, the rest are replaced, so a
        token that the tokenizer would merge with the forced text is merged. ``state`` is
        updated (dropped tokens rolled back, new ones accepted). Returns (0, []) with the
        state unchanged when nothing is forced or the net growth would exceed ``max_added``.
        Invariants for the caller: see the module docstring.
        """
        forced = state.jump_forward_text() if forced_text is None else forced_text
        if not forced:
            return JumpForward(0, [])
        forced_bytes = forced.encode("utf-8")
        tail_len = min(lookback, len(output_ids), state.num_tokens)
        for k in range(tail_len, -1, -1):
            # The tail must start on a character boundary to be re-encoded; shrink until it
            # does (k == 0 always works: the forced text is whole characters).
            tail = [int(t) for t in output_ids[len(output_ids) - k:]]
            target = b"".join(self._token_bytes[t] for t in tail) + forced_bytes
            try:
                text = target.decode("utf-8")
            except UnicodeDecodeError:
                continue
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            # Tokenizers that normalize or add a prefix space do not round-trip; skip them.
            if b"".join(self._token_bytes[t] for t in ids) == target:
                common = 0
                while common < k and common < len(ids) and ids[common] == tail[common]:
                    common += 1
                result = JumpForward(k - common, ids[common:])
                if self._try_replace(state, tail, result, max_added):
                    return result
            break
        # Fallback: xgrammar's greedy tokenization of the forced text, appended as is.
        result = JumpForward(0, state.matcher.find_jump_forward_tokens())
        if result.new_token_ids and self._try_replace(state, [], result, max_added):
            return result
        return JumpForward(0, [])

    @staticmethod
    def _try_replace(state: GrammarState, tail: list[int], result: JumpForward,
                     max_added: int | None) -> bool:
        drop, new = result
        if not new or (max_added is not None and len(new) - drop > max_added):
            return False
        state.rollback(drop)
        if state.accept_tokens(new):
            return True
        restored = state.accept_tokens(tail[len(tail) - drop:])  # were accepted just before
        assert restored, "grammar rejected tokens it had already accepted"
        return False
