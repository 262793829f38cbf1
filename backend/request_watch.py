"""What the serving loop checks on its pending requests between batches, at most every
``poll_s``: time limits, client cancellation, and heartbeats (``EngineLoop`` calls
``RequestWatch.check`` with a snapshot of the pending requests).

Asking Triton whether a client cancelled is an IPC round trip to the server process per
request (~30-70 us), and nothing cheaper says so: tritonserver accepts, and drops, the
responses of a cancelled request, so a send that succeeds proves nothing. A pass
therefore polls at most ``max_polls`` requests, those asked longest ago (or, never asked,
submitted longest ago) first. The polling rate stays at most ``max_polls / poll_s``
whatever the batch, and each of P pending requests is asked at least every
ceil(P / max_polls) passes: with the defaults (16 a pass, a pass every 0.1 s) at most
160 round trips a second, and at 128 pending a client that left is noticed within 0.8 s
(up to 16 pending: every pass, as before the budget). Time limits cost no round trip and
are checked for every request every pass.
"""
from __future__ import annotations

from typing import Callable

from backend import wire_outputs
from backend.serving_types import Tracked, safe_call

MAX_CANCEL_POLLS = 16  # is_cancelled round trips per pass


class RequestWatch:
    def __init__(self, abort: Callable[[str], None], put: Callable[[str, Callable[[], None]], None],
                 poll_s: float, heartbeat_s: float, max_polls: int = MAX_CANCEL_POLLS,
                 on_pass: Callable[[], None] | None = None) -> None:
        """``abort``: ask the engine to end a request; ``put``: queue a send for a request
        (in order with its other responses); ``on_pass``: called once per pass (the
        diagnostics count passes)."""
        self._abort = abort
        self._put = put
        self._poll_s = poll_s
        self._heartbeat_s = heartbeat_s
        self._max_polls = max(1, max_polls)
        self._on_pass = on_pass
        self._last_pass = float("-inf")

    def due(self, now: float) -> bool:
        return now - self._last_pass >= self._poll_s

    def check(self, pending: list[tuple[str, Tracked]], now: float) -> None:
        """One pass over ``pending`` ((request id, tracked) of every pending request)."""
        self._last_pass = now
        if self._on_pass is not None:
            self._on_pass()
        self._abort_cancelled(pending, now)
        self._send_heartbeats(pending, now)

    def _abort_cancelled(self, pending: list[tuple[str, Tracked]], now: float) -> None:
        """Abort each request whose time is up, and each of those polled whose client
        left (its sink says so)."""
        unexpired = []
        for rid, tracked in pending:
            if tracked.cancelled:
                continue
            if tracked.deadline is not None and now >= tracked.deadline:
                tracked.cancelled = True
                self._abort(rid)
            else:
                unexpired.append((rid, tracked))
        if len(unexpired) > self._max_polls:
            unexpired.sort(key=lambda item: item[1].last_polled)
        polls = 0
        for rid, tracked in unexpired:
            if polls >= self._max_polls:
                return
            if not tracked.io_lock.acquire(blocking=False):
                continue  # a sender is busy with it: ask next round, do not wait here
            try:
                if tracked.closed:
                    continue
                polls += 1
                tracked.last_polled = now
                cancelled = safe_call(tracked.sink.is_cancelled, default=True)
            finally:
                tracked.io_lock.release()
            if cancelled:
                tracked.cancelled = True
                self._abort(rid)

    def _send_heartbeats(self, pending: list[tuple[str, Tracked]], now: float) -> None:
        """An empty response to every request that asked for a cancel_token and has sent
        nothing for heartbeat_s: the ensemble's postprocessing step only runs on a
        response, and a run is its one chance to see that its client cancelled."""
        for rid, tracked in pending:
            if tracked.cancel_token is None or tracked.cancelled \
                    or now - tracked.last_sent < self._heartbeat_s:
                continue
            tracked.last_sent = now
            payload = _heartbeat_payload(tracked)
            self._put(rid, lambda t=tracked, p=payload: _send_open(t, p))


def _heartbeat_payload(tracked: Tracked) -> dict:
    samples = [wire_outputs.SampleOutput(i, "", [], None, 0)
               for i in range(tracked.job.params.n)]
    return wire_outputs.generation_outputs(samples, outputs=tracked.job.outputs,
                                           num_input_tokens=tracked.num_input_tokens,
                                           context_ids=[], cancel_token=tracked.cancel_token)


def _send_open(tracked: Tracked, payload: dict) -> None:
    """A non-final response, unless the request's final one went out already."""
    with tracked.io_lock:
        if not tracked.closed:
            safe_call(tracked.sink.send, payload, False)
