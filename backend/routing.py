"""Turning the engine's step outputs into each request's responses.

Response rules:
  * streaming: each response carries the sample's output produced since its previous
    response (one step's tokens when the senders keep up, several steps' when they do
    not); the request's last response carries ``final=True``;
  * non-streaming: one response with everything (n > 1: every sample, merged);
  * scoring and stats: exactly one response.
A request whose output carries an error gets that error as its final response.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from backend import wire
from backend.core.outputs import StepOutput
from backend.diagnostics import LoopDiagnostics
from backend.outbox import Delta, Streamed
from backend.serving_types import SampleText, Tracked, safe_call

# (request id, outbox item): a streamed output, or a callable that sends a final
Put = Callable[[str, "Streamed | Callable[[], None]"], None]


class Router:
    def __init__(self, put: Put, retire: Callable[[str], object], abort: Callable[[str], None]) -> None:
        self._put = put  # to the outbox, in order
        self._retire = retire  # the engine is done with a request: stop tracking it
        self._abort = abort  # ask the engine to end a request

    def route(self, out: StepOutput, tracked: Tracked) -> None:
        rid = out.request_id
        if out.error:
            self.finish(rid, tracked, lambda: tracked.sink.send_error(out.error))
            self._abort(rid)  # the other samples of this request, if any
            return
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
                payload = wire.score_outputs(out.choice_scores or [], out.num_prompt_tokens,
                                             out.num_cached_tokens)
                payload[wire.FINISH_REASON] = np.array([(out.finish_reason or "stop").encode()],
                                                       dtype=np.object_)
                self.finish(rid, tracked, lambda: tracked.sink.send(payload, True))
            return
        sample = tracked.samples.setdefault(out.index, SampleText())
        if sample.context_ids is None:
            sample.context_ids = list(out.context_token_ids)
        if tracked.job.stream:
            if out.new_token_ids or out.new_text or out.finished:
                if done:
                    self._retire(rid)
                self._put(rid, (tracked, sample, out, done))
            return
        sample.text.append(out.new_text)
        sample.token_ids.extend(out.new_token_ids)
        sample.logprobs.extend(out.logprobs or [])
        if out.finished:
            sample.final = out
        if not done:
            return
        # a non-streamed request gets one response: with n > 1 samples, one entry per
        # sample in index order (output_ids concatenated, split by num_output_tokens)
        payloads = [generation_payload(tracked, s.final, s, "".join(s.text), s.token_ids,
                                       s.context_ids, s.logprobs)
                    for _, s in sorted(tracked.samples.items())]
        merged = wire.merge_samples(payloads)
        self.finish(rid, tracked, lambda: tracked.sink.send(merged, True))

    def finish(self, rid: str, tracked: Tracked, send: Callable[[], None]) -> None:
        self._retire(rid)

        def final() -> None:
            tracked.close_with(send)
            LoopDiagnostics.trace_sent(tracked.trace, True)
        self._put(rid, final)

    def deliver_delta(self, delta: Delta) -> None:
        """On a sender thread: one streamed response (several steps' output, merged)."""
        tracked = delta.tracked
        if tracked.cancelled and not delta.final:
            return  # its cancelled final follows
        payload = generation_payload(tracked, delta.out, delta.sample, "".join(delta.text),
                                     delta.token_ids, delta.context_ids, delta.logprobs)
        if delta.final:
            tracked.close_with(lambda: tracked.sink.send(payload, True))
            LoopDiagnostics.trace_sent(tracked.trace, True)
            return
        with tracked.io_lock:
            if tracked.closed:
                return
            sent = safe_call(tracked.sink.send, payload, False, default=False, ok=True)
        LoopDiagnostics.trace_sent(tracked.trace, False)
        if not sent:
            tracked.cancelled = True  # the client is gone: stop generating for it
            self._abort(delta.out.request_id)


def generation_payload(tracked: Tracked, out: StepOutput, sample: SampleText, text: str,
                       token_ids: list[int], context_ids: list[int], logprobs: list):
    if tracked.job.prepend_input and not sample.sent_first:
        text = tracked.prompt_text + text
    sample.sent_first = True
    return wire.generation_outputs(
        text=text, token_ids=token_ids, context_ids=context_ids,
        finish_reason=out.finish_reason if out.finished else None,
        num_input_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens, index=out.index,
        logprobs=logprobs if tracked.job.params.logprobs else None, wanted=tracked.wanted)
