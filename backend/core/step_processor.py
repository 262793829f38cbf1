"""The host side of a step's results: the bookkeeping of new tokens (finish checks, stop
strings, text, grammar and jump-forward, radix-cache inserts) and the outputs it yields.
Batch assembly, forward and sampling live in ``forward_step.py``."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .detokenizer import STATELESS_CONTEXT_IDS
from .forward_step import InFlight
from .output_processor import TextState
from .outputs import RequestOutput, StepOutput, TokenLogprob
from .request import Req
from .scheduler import ScheduledItem

if TYPE_CHECKING:
    from .engine import Engine


class StepProcessor:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._wanted: set[str] = set()  # groups whose whole results generate() collects
        self._results: dict[str, RequestOutput] = {}

    def attach(self, reqs: list[Req], stream: bool = True) -> None:
        tok = self.engine.tokenizer
        for r in reqs:
            r.detok = TextState(tok, r.origin_input_ids, r.params.stop, r.params.skip_special_tokens,
                                incremental=stream)

    # ------------------------------------------------------------------ a step's results
    def process(self, flight: InFlight) -> list[StepOutput]:
        """Read a launched step's results (the host's one wait) and account for them."""
        tokens = flight.token_ids()
        if flight.prompt_rows:
            values = flight.prompt_logprobs.tolist()
            for (r, _, t), v in zip(flight.prompt_rows, values):
                r.partial_prompt_logprobs.append(TokenLogprob(t, v))
        lp = None
        res = flight.result
        if res is not None and res.logprobs is not None:
            lp = (res.logprobs.tolist(), _maybe_list(res.top_ids), _maybe_list(res.top_logprobs))
        outputs: list[StepOutput] = []
        for it in flight.items:
            if not it.samples and not it.req.finished:
                self.engine.scheduler.cache_unfinished(it.req)
        for i, it in enumerate(flight.sampled):
            if it.req.finished:  # ended (abort, limit) while this step was in flight
                continue
            outputs += self._on_token(it, tokens[i], _row_logprobs(lp, i))
        return outputs

    def _on_token(self, it: ScheduledItem, tok: int, lp) -> list[StepOutput]:
        r, eng = it.req, self.engine
        p = r.params
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
            if p.prompt_logprobs_start is not None:
                r.prompt_logprobs = r.partial_prompt_logprobs
        out, i = r.output_ids, it.out_index
        context = _detok_context(r, i)
        # the token replaces its placeholder; a later step's placeholder (overlap) stays
        # after it unless this request ends here
        out[i] = tok
        n_out = i + 1
        if lp is not None and p.logprobs > 0:
            top = dict(zip(lp[1], lp[2])) if lp[1] is not None and p.logprobs > 1 else None
            r.logprobs.append(TokenLogprob(tok, lp[0], top))
        grammar = r.grammar
        if grammar is not None and not grammar.accept(tok):
            r.error = f"token {tok} violates the request's grammar"
            del out[n_out:]
            return self._finish(r, "abort", [tok], "", context)
        new_ids, text = [tok], ""
        if tok in p.stop_token_ids or (tok in eng.eos_token_ids and not p.ignore_eos) or (
                grammar is not None and grammar.is_terminated()):
            reason = "stop"  # the stop token's own text is not returned
        else:
            detok = r.detok
            text = detok.add(new_ids)
            if grammar is not None and not detok.stopped:
                del out[n_out:]  # (no overlap with a grammar: nothing after it anyway)
                new_ids, text = self._jump_forward(r, new_ids, text)
                n_out = len(out)
            if detok.stopped:
                reason = "stop"
            elif n_out >= p.max_new_tokens or len(r.origin_input_ids) + n_out >= eng.context_len:
                reason = "length"
            else:
                reason = None
        if reason is not None:
            del out[n_out:]
            return self._finish(r, reason, new_ids, text, context)
        if it.num_new > 1 and it.out_index == 0:
            eng.scheduler.cache_unfinished(r)  # the prompt is now shareable (n > 1 samples)
        if eng._score_choices and r.group_id in eng._score_choices:
            return []
        return [self._output(r, new_ids, text, context, n_out)]

    def _jump_forward(self, r: Req, new_ids: list[int], text: str) -> tuple[list[int], str]:
        """Append the text the grammar forces as tokens, computed next step. Only this
        step's new tokens (not yet streamed, no KV yet) may be re-tokenized together with
        the forced text, so what was streamed is never taken back, ids or text.
        Returns the step's new ids and text."""
        room = r.params.max_new_tokens - len(r.output_ids)
        drop, added = self.engine.grammar.jump_forward(r.grammar, r.output_ids,
                                                       lookback=len(new_ids), max_added=room)
        if not added:
            return new_ids, text
        if drop:
            del r.output_ids[-drop:]
            del r.logprobs[len(r.output_ids):]
        r.output_ids.extend(added)
        text += r.detok.jump(r.output_ids)
        return new_ids[:len(new_ids) - drop] + list(added), text

    def finish(self, r: Req, reason: str) -> list[StepOutput]:
        """End a request from outside the token path (abort, out of memory). Tokens still
        in flight are dropped, with the KV of any that was already fed back."""
        real = next((i for i, t in enumerate(r.output_ids) if t < 0), len(r.output_ids))
        if real < len(r.output_ids):
            del r.output_ids[real:]
            keep = len(r.origin_input_ids) + real
            if r.num_computed > keep:
                self.engine.runner.kv_pool.free(r.kv_indices[keep:])
                del r.kv_indices[keep:]
        return self._finish(r, reason, [], "", _detok_context(r))

    def _finish(self, r: Req, reason: str, new_ids, text: str, context) -> list[StepOutput]:
        eng = self.engine
        if reason != "abort":
            text += r.detok.finish()
        r.finish_reason = reason
        eng.scheduler.finish(r)
        c = eng.counters
        c["prompt_tokens"] += len(r.origin_input_ids)
        c["cache_hit_tokens"] += r.num_cached_tokens
        c["generated_tokens"] += len(r.output_ids)
        c["finished_requests"] += 1
        gid = r.group_id
        if gid in eng._score_choices:
            out = eng.score_output(gid)
            return [out] if out is not None else []
        out = self._output(r, new_ids, text, context, len(r.output_ids))
        out.timings = _timings(r)
        group = eng._groups.get(gid, [])
        if all(s.finished for s in group):
            if gid in self._wanted:
                self._results[gid] = self._collect(group)
            eng._forget(gid)
        return [out]

    @staticmethod
    def _output(r: Req, new_ids: list[int], text: str, context: list[int],
                n_out: int) -> StepOutput:
        """``new_ids`` and ``context`` are the caller's own lists (not copied); ``n_out``
        the request's output length, placeholders of later steps not counted."""
        if new_ids:
            logprobs = r.logprobs[-len(new_ids):] if r.params.logprobs else None
            prompt_logprobs = r.prompt_logprobs if n_out == len(new_ids) else None
        else:
            logprobs = prompt_logprobs = None
        return StepOutput(r.group_id, r.index, new_ids, text, r.finish_reason is not None,
                          r.finish_reason, len(r.origin_input_ids), r.num_cached_tokens,
                          n_out, logprobs, prompt_logprobs, context, r.error)

    # ------------------------------------------------------------------ offline results
    def keep_results(self, gids: list[str]) -> None:
        self._wanted.update(gids)

    def take_results(self) -> dict[str, RequestOutput]:
        out, self._results = self._results, {}
        self._wanted.difference_update(out)
        return out

    @staticmethod
    def _collect(group: list[Req]) -> RequestOutput:
        outs = [RequestOutput(
            request_id=r.group_id, prompt=r.origin_input_ids, token_ids=list(r.output_ids),
            text=r.detok.text, finish_reason=r.finish_reason,
            num_prompt_tokens=len(r.origin_input_ids), num_cached_tokens=r.num_cached_tokens,
            logprobs=list(r.logprobs) if r.params.logprobs else None,
            prompt_logprobs=r.prompt_logprobs, error=r.error) for r in group]
        head = outs[0]
        if len(outs) > 1:
            head.samples = outs
        return head


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
    return r.detok.prompt_ids[-(k - end):] + out[:end]


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


def _maybe_list(t):
    return t.tolist() if t is not None else None


def _row_logprobs(lp, i: int):
    if lp is None:
        return None
    return (lp[0][i], lp[1][i] if lp[1] is not None else None, lp[2][i] if lp[2] is not None else None)
