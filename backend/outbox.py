"""Responses on their way out: per-request ordered queues drained by sender threads.

A Triton send is an IPC round trip to the server process (it releases the GIL while it
waits), and 128 streams sending one token each per step would otherwise stall the loop
for tens of milliseconds per step. Sender threads drain the outbox request by request,
in order; streamed tokens that queued up while a send was in flight go out together in
one response.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from backend.serving_types import Tracked, safe_call


class Piece:
    """One sample's streamed output within a delta: its first step's output and every
    later one that arrived before a sender took the delta."""

    __slots__ = ("out", "text", "token_ids", "logprobs", "context_ids", "prompt_logprobs")

    def __init__(self, out) -> None:
        self.out = out  # the latest StepOutput (finish reason, counts)
        self.text = [out.new_text]
        self.token_ids = list(out.new_token_ids)
        self.logprobs = list(out.logprobs) if out.logprobs else []
        self.context_ids = out.context_token_ids  # what precedes the first of token_ids
        self.prompt_logprobs = out.prompt_logprobs  # with a sample's first output only

    def add(self, out) -> None:
        self.out = out
        self.text.append(out.new_text)
        self.token_ids += out.new_token_ids
        if out.logprobs:
            self.logprobs += out.logprobs


class Delta:
    """Streamed output of one request waiting in the outbox, one piece per sample that
    produced some: it goes out as one response with an entry for every sample."""

    __slots__ = ("tracked", "pieces", "final")

    def __init__(self, tracked: Tracked, out, final: bool) -> None:
        self.tracked = tracked
        self.pieces = {out.index: Piece(out)}
        self.final = final  # the request's last response

    def add(self, out, final: bool) -> None:
        """A later step's output of the same request."""
        piece = self.pieces.get(out.index)
        if piece is None:
            self.pieces[out.index] = Piece(out)
        else:
            piece.add(out)
        self.final = self.final or final


# A streamed step output on its way to the outbox: (tracked, StepOutput, final). The
# outbox adds it to the request's delta still queued, else queues a new Delta: a request
# whose sender is behind costs a few list appends per token, not an object.
Streamed = tuple


class Outbox:
    """Per-request ordered queues of pending responses, drained by sender threads.

    A request is handled by one sender at a time, so its responses keep their order.
    Queued streamed output of a request merges into one response; a callable item (a
    final non-streamed response, an error) runs after everything queued before it."""

    def __init__(self, deliver_delta: Callable[[Delta], None], num_threads: int) -> None:
        self._deliver_delta = deliver_delta
        self._cv = threading.Condition()
        self._queues: dict[str, list] = {}
        self._ready: collections.deque[str] = collections.deque()
        self._busy: set[str] = set()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"radixlm-sender-{i}", daemon=True)
                         for i in range(num_threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def put(self, rid: str, item: Streamed | Callable[[], None]) -> None:
        self.put_many([(rid, item)])

    def put_many(self, items: list[tuple[str, Streamed | Callable[[], None]]]) -> None:
        """Queue (request id, item) pairs in order, taking the lock once: a step's outputs
        go in together rather than contending with the senders once per request."""
        woken = 0
        with self._cv:
            for rid, item in items:
                queued = self._queues.get(rid)
                if item.__class__ is tuple:  # streamed output
                    if queued is not None and merge_streamed(queued, item):
                        continue
                    item = Delta(*item)
                if queued is None:
                    self._queues[rid] = [item]
                    if rid not in self._busy:
                        self._ready.append(rid)
                        woken += 1
                else:
                    queued.append(item)
            if woken:
                self._cv.notify(woken)

    def pending(self) -> int:
        with self._cv:
            return len(self._queues) + len(self._busy)

    def close(self, timeout_s: float) -> None:
        """Send what is queued (up to ``timeout_s``), then stop the sender threads."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while (self._queues or self._busy) and time.monotonic() < deadline:
                self._cv.wait(0.05)
            self._closed = True
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._closed:
                    self._cv.wait()
                if not self._ready:
                    return
                rid = self._ready.popleft()
                items = self._queues.pop(rid)
                self._busy.add(rid)
            try:
                self._deliver(items)
            finally:
                # not kept while this thread waits for more: the items hold requests,
                # and Triton cannot unload the model until each request is released
                items = None
                with self._cv:
                    self._busy.discard(rid)
                    if rid in self._queues:  # more arrived while sending
                        self._ready.append(rid)
                    self._cv.notify_all()

    def _deliver(self, items: list) -> None:
        # put_many already merged a request's consecutive step outputs into one delta
        for item in items:
            if item.__class__ is Delta:
                self._deliver_delta(item)
            else:
                safe_call(item)


def merge_streamed(queued: list, item: Streamed) -> bool:
    """Add a streamed output to the request's delta at the end of its queue; False when
    there is none (a callable comes last, or nothing is queued)."""
    if queued and queued[-1].__class__ is Delta:
        queued[-1].add(item[1], item[2])
        return True
    return False
