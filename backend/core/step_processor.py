"""The host side of a step's results: the bookkeeping of new tokens (finish checks, stop
strings, text, grammar and jump-forward, radix-cache inserts) and the outputs it yields.

``finish`` is the one place that ends a request: the token path (stop token, stop
string, length, grammar violation), aborts, out-of-room and failed grammars all come
through it, and it alone sets ``finish_reason``, gives the KV back and counts the
request.
"""
from __future__ import annotations

import time

from .detokenizer import STATELESS_CONTEXT_IDS, TokenDecoder
from .forward_step import InFlight, SampledLogprobs
from .groups import RequestGroups
from .intake import GrammarProvider
from .outputs import EngineCounters, StepOutput, TokenLogprob
from .request import Req
from .schedule_plan import ScheduledItem
from .scheduler import Scheduler


class StepProcessor:
    def __init__(self, scheduler: Scheduler, groups: RequestGroups, grammar: GrammarProvider,
                 counters: EngineCounters, eos_token_ids: set[int], context_len: int,
                 decoder: TokenDecoder) -> None:
        self.decoder = decoder  # token texts of logprobs
        self.scheduler = scheduler
        self.groups = groups
        self.grammar = grammar
        self.counters = counters
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len

    def process(self, flight: InFlight) -> list[StepOutput]:
        """Read a launched step's results (the host's one wait) and account for them."""
        results = flight.read()
        for i, row in enumerate(flight.prompt_rows):
            num_top = row.req.params.prompt_logprobs or 0
            row.req.partial_prompt_logprobs.append(
                results.prompt_logprobs.record(i, row.token_id, num_top))
        outputs: list[StepOutput] = []
        for it in flight.items:
            if not it.samples and not it.req.finished:
                self.scheduler.cache_unfinished(it.req)
        for i, it in enumerate(flight.sampled):
            if it.req.finished:  # ended (abort, limit) while this step was in flight
                continue
            outputs += self._on_token(it, results.token_ids[i], results.logprobs, i)
        return outputs

    def _on_token(self, it: ScheduledItem, tok: int, logprobs: SampledLogprobs | None,
                  row: int) -> list[StepOutput]:
        r = it.req
        p = r.params
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
            if r.prompt_logprobs_start is not None:
                r.prompt_logprobs = self._prompt_logprobs(r)
        out, i = r.output_ids, it.out_index
        context = _detok_context(r, i)
        # the token replaces its placeholder; a later step's placeholder (overlap) stays
        # after it unless this request ends here
        out[i] = tok
        n_out = i + 1
        if logprobs is not None and p.wants_token_logprobs:
            entry = logprobs.record(row, tok, p.logprobs or 0)
            r.cumulative_logprob += entry.logprob
            if p.logprobs is not None:
                r.logprobs.append(self._with_texts(entry, p.skip_special_tokens))
        grammar = r.grammar
        if grammar is not None and not grammar.accept(tok):
            r.error = f"token {tok} violates the request's grammar"
            del out[n_out:]
            return self._finish(r, "abort", [tok], "", context)
        new_ids, text = [tok], ""
        if tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos) or (
                grammar is not None and grammar.is_terminated()):
            reason = "stop"  # the stop token's own text is not returned
        else:
            state = r.text_state
            text = state.add(new_ids, check_stop=n_out > p.min_new_tokens)
            if grammar is not None and not state.stopped:
                del out[n_out:]  # (no overlap with a grammar: nothing after it anyway)
                new_ids, text = self._jump_forward(r, new_ids, text)
                n_out = len(out)
            if state.stopped:
                reason = "stop"
            elif n_out >= p.max_new_tokens or len(r.origin_input_ids) + n_out >= self.context_len:
                reason = "length"
            else:
                reason = None
        if reason is not None:
            del out[n_out:]
            return self._finish(r, reason, new_ids, text, context)
        if it.num_new > 1 and it.out_index == 0:
            self.scheduler.cache_unfinished(r)  # the prompt is now shareable (n > 1 samples)
        if r.is_choice:
            return []
        return [_output(r, new_ids, text, context, n_out)]

    def _with_texts(self, entry: TokenLogprob,
                    skip_special_tokens: bool = False) -> TokenLogprob:
        """The entry with its tokens' texts (vLLM's decoded_token; special tokens are ""
        where the request skips them, so the chosen tokens' texts spell its text)."""
        decoder = self.decoder
        entry.text = decoder.token_text(entry.token_id, skip_special_tokens)
        if entry.top:
            entry.top_text = {t: decoder.token_text(t, skip_special_tokens) for t in entry.top}
        return entry

    def _prompt_logprobs(self, r: Req) -> list[TokenLogprob]:
        """The prompt's logprobs as the request gets them: for scoring, the computed
        positions; for ``prompt_logprobs``, every position from logprob_start_len on,
        the first without a logprob (null), each with its token's text."""
        computed = r.partial_prompt_logprobs
        if r.params.prompt_logprobs is None:
            return computed
        start = r.prompt_logprobs_start - 1
        first = TokenLogprob(r.origin_input_ids[start], None)
        return [self._with_texts(e) for e in [first, *computed]]

    def _jump_forward(self, r: Req, new_ids: list[int], text: str) -> tuple[list[int], str]:
        """Append the text the grammar forces as tokens, computed next step. Only this
        step's new tokens (not yet streamed, no KV yet) may be re-tokenized together with
        the forced text, so what was streamed is never taken back, ids or text.
        Returns the step's new ids and text."""
        room = r.params.max_new_tokens - len(r.output_ids)
        drop, added = self.grammar.get().jump_forward(r.grammar, r.output_ids,
                                                      lookback=len(new_ids), max_added=room)
        if not added:
            return new_ids, text
        if drop:
            del r.output_ids[-drop:]
            del r.logprobs[len(r.output_ids):]
        r.output_ids.extend(added)
        text += r.text_state.jump(r.output_ids)
        return new_ids[:len(new_ids) - drop] + list(added), text

    def finish(self, r: Req, reason: str, error: str | None = None) -> list[StepOutput]:
        """End a request from outside the token path (abort, out of room, a grammar that
        failed to compile). Tokens still in flight are dropped, with the KV of any that
        was already fed back."""
        if error is not None:
            r.error = error
        real = next((i for i, t in enumerate(r.output_ids) if t < 0), len(r.output_ids))
        if real < len(r.output_ids):
            del r.output_ids[real:]
            keep = len(r.origin_input_ids) + real
            if r.num_computed > keep:
                self.scheduler.slots.free(r.kv_indices[keep:])
                del r.kv_indices[keep:]
        return self._finish(r, reason, [], "", _detok_context(r))

    def _finish(self, r: Req, reason: str, new_ids, text: str, context) -> list[StepOutput]:
        if reason != "abort":
            text += r.text_state.finish()
        r.finish_reason = reason
        self.scheduler.finish(r)
        c = self.counters
        c.prompt_tokens += len(r.origin_input_ids)
        c.cache_hit_tokens += r.num_cached_tokens
        c.cache_hit_tokens_host += r.num_host_cached_tokens
        c.generated_tokens += len(r.output_ids)
        c.finished_requests += 1
        group_answer = self.groups.on_finished(r)
        if r.is_choice:
            return [group_answer] if group_answer is not None else []
        out = _output(r, new_ids, text, context, len(r.output_ids))
        out.timings = _timings(r)
        return [out]


def _output(r: Req, new_ids: list[int], text: str, context: list[int], n_out: int) -> StepOutput:
    """``new_ids`` and ``context`` are the caller's own lists (not copied); ``n_out`` the
    request's output length, placeholders of later steps not counted. (Runs once per
    token: what is usually left at its default is set only when it is not.)"""
    out = StepOutput(request_id=r.group_id, index=r.index, new_token_ids=new_ids,
                     new_text=text, finished=r.finish_reason is not None,
                     finish_reason=r.finish_reason, num_prompt_tokens=len(r.origin_input_ids),
                     num_cached_tokens=r.num_cached_tokens, num_output_tokens=n_out,
                     context_token_ids=context)
    if new_ids:
        if r.params.logprobs is not None:
            out.logprobs = r.logprobs[-len(new_ids):]
        if n_out == len(new_ids):  # the sample's first output
            out.prompt_logprobs = r.prompt_logprobs
            out.timings = _first_timings(r)
    if r.params.wants_token_logprobs:
        out.cumulative_logprob = r.cumulative_logprob
    if r.error is not None:
        out.error = r.error
    return out


def _detok_context(r: Req, end: int | None = None) -> list[int]:
    """Ids before output token ``end`` (default: after the last one), as a stateless
    detokenizer needs them to decode that token's text exactly as the engine's own
    TextState does. A new list."""
    k = STATELESS_CONTEXT_IDS
    out = r.output_ids
    if end is None:
        end = len(out)
    if end >= k:
        return out[end - k:end]
    return r.text_state.prompt_ids[-(k - end):] + out[:end]


def _first_timings(r: Req) -> dict[str, float]:
    """On a sample's first output: arrival to admission and to the first token."""
    t = {"time_to_first_token": r.first_token_time - r.arrival}
    if r.first_admit_time is not None:
        t["queue_time"] = r.first_admit_time - r.arrival
    return t


def _timings(r: Req) -> dict[str, float]:
    now = time.monotonic()
    t = {"e2e_latency": now - r.arrival}
    if r.admit_time is not None:
        t["queue_time"] = r.first_admit_time - r.arrival
    if r.first_token_time is not None:
        t["time_to_first_token"] = r.first_token_time - r.arrival
        if len(r.output_ids) > 1:
            t["time_per_output_token"] = (now - r.first_token_time) / (len(r.output_ids) - 1)
    return t
