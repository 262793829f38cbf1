"""Turning the engine's step outputs into each request's responses.

Response rules:
  * streaming: each response carries the request's output produced since its previous
    response (one step's tokens when the senders keep up, several steps' when they do
    not), one entry per sample; the request's last response carries ``final=True``;
  * non-streaming: one response with everything (n > 1: every sample; with best_of,
    the n samples of highest cumulative logprob);
  * scoring, stats and cancel requests: exactly one response.
A request whose output carries an error gets that error as its final response. Before
a request's final response is sent, ``before_final`` runs (the metrics are published
then, so that they count the request by the time its client sees the end).
"""
from __future__ import annotations

import time
from typing import Callable

from backend import wire, wire_outputs
from backend.core.groups import best_of
from backend.core.outputs import StepOutput
from backend.diagnostics import LoopDiagnostics
from backend.outbox import Delta, Streamed
from backend.serving_types import SampleText, SentState, Tracked, safe_call
from backend.wire_outputs import SampleOutput

# (request id, outbox item): a streamed output, or a callable that sends a final
Put = Callable[[str, "Streamed | Callable[[], None]"], None]


class Router:
    def __init__(self, put: Put, retire: Callable[[str], object], abort: Callable[[str], None],
                 before_final: Callable[[], None] | None = None) -> None:
        self._put = put  # to the outbox, in order
        self._retire = retire  # the engine is done with a request: stop tracking it
        self._abort = abort  # ask the engine to end a request
        self._before_final = before_final

    def route(self, out: StepOutput, tracked: Tracked) -> None:
        rid = out.request_id
        if out.error:
            self.finish(rid, tracked, lambda: tracked.sink.send_error(out.error))
            self._abort(rid)  # the other samples of this request, if any
            return
        if out.num_prompt_tokens:
            tracked.num_input_tokens = out.num_prompt_tokens
        if out.finished:
            tracked.finished.add(out.index)
        done = len(tracked.finished) >= tracked.num_samples
        if tracked.cancelled:
            if done:
                self.finish(rid, tracked, lambda: tracked.sink.send_error(
                    tracked.cancel_message, cancelled=True))
            return
        if isinstance(tracked.job, wire.ScoreJob):
            if out.finished:
                payload = wire_outputs.score_outputs(
                    out.choice_scores or [], out.num_prompt_tokens, out.num_cached_tokens,
                    out.finish_reason or "stop")
                self.finish(rid, tracked, lambda: tracked.sink.send(payload, True))
            return
        if tracked.job.stream:
            if out.new_token_ids or out.new_text or out.finished:
                if done:
                    self._retire(rid)
                self._put(rid, (tracked, out, done))
            return
        sample = tracked.samples.setdefault(out.index, SampleText())
        if sample.context_ids is None:
            sample.context_ids = list(out.context_token_ids)
        if out.prompt_logprobs is not None:
            sample.prompt_logprobs = out.prompt_logprobs
        sample.text.append(out.new_text)
        sample.token_ids.extend(out.new_token_ids)
        sample.logprobs.extend(out.logprobs or [])
        if out.finished:
            sample.final = out
        if done:
            payload = whole_payload(tracked)
            self.finish(rid, tracked, lambda: tracked.sink.send(payload, True))

    def finish(self, rid: str, tracked: Tracked, send: Callable[[], None]) -> None:
        self._retire(rid)

        def final() -> None:
            if self._before_final is not None:
                safe_call(self._before_final)
            tracked.close_with(send)
            LoopDiagnostics.trace_sent(tracked.trace, True)
        self._put(rid, final)

    def deliver_delta(self, delta: Delta) -> None:
        """On a sender thread: one streamed response (several steps' output, merged)."""
        tracked = delta.tracked
        if tracked.cancelled and not delta.final:
            return  # its cancelled final follows
        payload = streamed_payload(tracked, delta)
        if delta.final:
            if self._before_final is not None:
                safe_call(self._before_final)
            tracked.close_with(lambda: tracked.sink.send(payload, True))
            LoopDiagnostics.trace_sent(tracked.trace, True)
            return
        with tracked.io_lock:
            if tracked.closed:
                return
            sent = safe_call(tracked.sink.send, payload, False, default=False, ok=True)
            tracked.last_sent = time.monotonic()
        LoopDiagnostics.trace_sent(tracked.trace, False)
        if not sent:
            tracked.cancelled = True  # the client is gone: stop generating for it
            self._abort(next(iter(delta.pieces.values())).out.request_id)


def _logprobs(tracked: Tracked, entries: list) -> list | None:
    return entries if tracked.job.params.logprobs is not None else None


def streamed_payload(tracked: Tracked, delta: Delta):
    """One entry per sample: the new output of those in the delta, and what the others'
    last responses said; the first response also carries the prompt's text when asked."""
    first_response = not tracked.sent
    samples = []
    for index in range(tracked.num_samples):
        piece = delta.pieces.get(index)
        state = tracked.sent.setdefault(index, SentState())
        if piece is None:
            samples.append(SampleOutput(index, "", [], state.finish_reason, 0,
                                        state.num_cached_tokens, _logprobs(tracked, []),
                                        state.cumulative_logprob))
            continue
        out = piece.out
        state.finish_reason = out.finish_reason if out.finished else None
        state.num_cached_tokens = out.num_cached_tokens
        state.cumulative_logprob = out.cumulative_logprob
        samples.append(SampleOutput(index, "".join(piece.text), piece.token_ids,
                                    state.finish_reason, len(piece.token_ids),
                                    out.num_cached_tokens, _logprobs(tracked, piece.logprobs),
                                    out.cumulative_logprob))
    first = delta.pieces[min(delta.pieces)]
    prompt_logprobs = delta.pieces[0].prompt_logprobs if 0 in delta.pieces else None
    return wire_outputs.generation_outputs(
        samples, outputs=tracked.job.outputs, num_input_tokens=tracked.num_input_tokens,
        context_ids=first.context_ids, prompt_logprobs=prompt_logprobs,
        input_text=tracked.prompt_text if tracked.job.prepend_input and first_response else "",
        cancel_token=tracked.cancel_token)


def whole_payload(tracked: Tracked):
    """The one response of a request that is not streamed: every sample whole (with
    best_of, the n best renumbered 0..n-1), each led by the prompt when asked."""
    job = tracked.job
    indices = sorted(tracked.samples)
    if len(indices) > job.params.n:
        finals = [tracked.samples[i].final for i in indices]
        indices = [indices[k] for k in best_of([f.cumulative_logprob for f in finals],
                                               job.params.n)]
    prompt_in_text = job.prepend_input and wire.INPUT_TEXT not in job.outputs
    lead = tracked.prompt_text if prompt_in_text else ""
    samples = []
    for new_index, index in enumerate(indices):
        s = tracked.samples[index]
        final = s.final
        samples.append(SampleOutput(new_index, lead + "".join(s.text), s.token_ids,
                                    final.finish_reason, final.num_output_tokens,
                                    final.num_cached_tokens, _logprobs(tracked, s.logprobs),
                                    final.cumulative_logprob))
    first = tracked.samples[indices[0]]
    prompt_logprobs = tracked.samples[0].prompt_logprobs if 0 in tracked.samples else None
    return wire_outputs.generation_outputs(
        samples, outputs=job.outputs, num_input_tokens=tracked.num_input_tokens,
        context_ids=first.context_ids or [], prompt_logprobs=prompt_logprobs,
        input_text=tracked.prompt_text if job.prepend_input else "",
        cancel_token=tracked.cancel_token)
