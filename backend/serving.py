"""The serving loop, independent of Triton: requests in through an ``EngineHandle``,
responses out through each request's ``ResponseSink``.

``model.py`` turns each Triton request into a job (``wire.RequestParser``) and a sink
(its response sender); ``EngineLoop.submit`` hands the job to the engine handle. One
background thread takes each ``OutputBatch`` from the handle (with the engine in this
process, taking it runs the step) and routes every output to its request
(``routing.Router``); responses leave through the outbox's sender threads
(``outbox.Outbox``). Between batches it answers debug ``stats`` jobs, has the pending
requests checked for time limits and client cancellation (``request_watch``: at most
every ``cancel_poll_s``, within a budget of round trips), and hands finished outputs and
(time-gated) stats samples to an optional metrics recorder
(``backend.metrics.EngineMetrics``).

If the loop thread itself dies (an exception outside a step, which step errors are not,
or the engine process gone), every pending request gets an error, later ones are refused
with the reason, ``failure`` holds it and ``on_death`` is called once: the model then
reports itself unusable.
"""
from __future__ import annotations

import itertools
import logging
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable

from backend import wire, wire_outputs
from backend.core.handle import EngineDied, EngineHandle, OutputBatch
from backend.diagnostics import IpcCounts, LoopDiagnostics
from backend.outbox import Outbox, Streamed
from backend.request_watch import MAX_CANCEL_POLLS, RequestWatch
from backend.routing import Router
from backend.serving_types import PendingRequests, ResponseSink, safe_call, track

log = logging.getLogger("radixlm.serving")


class EngineLoop:
    """Owns the serving loop thread in front of one engine handle."""

    def __init__(self, engine: EngineHandle, idle_wait_s: float = 0.05, cancel_poll_s: float = 0.1,
                 on_error: Callable[[str], None] | None = None,
                 on_info: Callable[[str], None] | None = None,
                 server_stopping: Callable[[], bool] | None = None, metrics: Any = None,
                 on_death: Callable[[str], None] | None = None, sender_threads: int = 2,
                 heartbeat_s: float = 1.0, max_cancel_polls: int = MAX_CANCEL_POLLS,
                 ipc_counts: IpcCounts | None = None) -> None:
        """``server_stopping``, polled while requests are pending, says the server has
        begun to shut down: pending requests are then aborted so that each gets its final
        response (tritonserver only unloads the model, and so calls ``finalize``, once
        every response sender has sent its final flag). ``max_cancel_polls``: cancellation
        round trips per pass (``request_watch``). ``ipc_counts``: where the Triton
        adapter counts its round trips (reported with the debug stats)."""
        self.engine = engine
        self._metrics = metrics
        self._on_death = on_death
        self.failure: str | None = None  # why the loop thread died, once it has
        self._idle_wait_s = idle_wait_s
        self._server_stopping = server_stopping
        self._on_error = on_error or log.error
        self._on_info = on_info or log.info
        self._pending = PendingRequests()
        # (sink, flush the prefix cache first) of debug requests, answered between batches
        self._stats_sinks: queue.SimpleQueue[tuple[ResponseSink, bool]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixlm-engine-loop", daemon=True)
        self._router = Router(self._put, self._pending.retire, engine.abort,
                              before_final=metrics.before_final if metrics is not None else None)
        self._outbox = Outbox(self._router.deliver_delta, sender_threads)
        self._batch: list | None = None  # outbox items of the batch being routed
        self._id_prefix = f"{id(self):x}-{time.monotonic_ns():x}-"
        self._ids = itertools.count()
        self.diagnostics = LoopDiagnostics(ipc_counts)
        self._watch = RequestWatch(engine.abort, self._put, cancel_poll_s, heartbeat_s,
                                   max_cancel_polls, on_pass=self._count_poll_pass)

    @property
    def tracing(self) -> bool:
        return self.diagnostics.tracing

    def start(self) -> None:
        self._outbox.start()
        self._thread.start()

    def num_active(self) -> int:
        return len(self._pending)

    def pending_responses(self) -> int:
        return self._outbox.pending()

    # -- called from Triton's execute thread
    def submit(self, job: wire.Job, sink: ResponseSink, label: str | None = None,
               timeout_s: float | None = None) -> None:
        """``label``: the request's name in traces (Triton's request id). ``timeout_s``:
        the request is cancelled (its final response an error) after that long."""
        if self.failure is not None:
            safe_call(sink.send_error, f"the engine is not running ({self.failure}); "
                                       "the model is unavailable")
            return
        if self._stopping.is_set():
            safe_call(sink.send_error, "the model is shutting down")
            return
        if isinstance(job, wire.StatsJob):
            self._stats_sinks.put((sink, job.flush_cache))
            return
        if isinstance(job, wire.CancelJob):
            self._cancel(job.token, sink)
            return
        rid = f"{self._id_prefix}{next(self._ids)}"
        tracked, request = track(job, sink, rid, self.engine.prompt_text, timeout_s)
        tracked.trace = self.diagnostics.new_trace(label or rid)
        if self._metrics is not None and isinstance(job, wire.GenerateJob):
            safe_call(self._metrics.observe_request, job.params.n)
        # Track first: the loop may produce output for rid as soon as the engine has it.
        self._pending.add(rid, tracked)
        try:
            self.engine.submit(request)
        except EngineDied as exc:  # the loop thread notices too, and fails the rest
            message = f"the engine is not running ({exc})"
            if self._pending.retire(rid) is not None:
                tracked.close_with(lambda: sink.send_error(message))
            return
        if self.failure is not None:  # the loop died meanwhile, maybe after failing all
            if self._pending.retire(rid) is not None:
                reason = self.failure
                tracked.close_with(lambda: sink.send_error(f"the engine loop died ({reason})"))

    def _cancel(self, token: str, sink: ResponseSink) -> None:
        """A cancel request: abort the request that sent ``token`` (an ensemble relays its
        client's cancellation so), then answer with one empty response."""
        rid, tracked = self._pending.by_token(token) or (None, None)
        if tracked is not None and not tracked.cancelled:
            tracked.cancelled = True
            self.engine.abort(rid)
        safe_call(sink.send, wire_outputs.empty_outputs(), True)

    def note_intake(self, started: float, ended: float, requests: int) -> None:
        self.diagnostics.note_intake(started, ended, requests)

    def inject_fault(self, message: str) -> None:
        """Make the loop thread raise ``message`` (fault-injection tests of the death path)."""
        self.diagnostics.inject_fault(message)

    def stop(self, timeout_s: float = 30.0, report_after_s: float = 5.0) -> None:
        """Abort what is pending, send each request its final response, end the thread.
        A thread still running after ``report_after_s`` has its stack logged: a stuck
        shutdown then says where it is stuck."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(min(report_after_s, timeout_s))
        if self._thread.is_alive():
            frame = sys._current_frames().get(self._thread.ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            self._on_error(f"radixlm: the engine loop is still stopping after "
                           f"{report_after_s:g} s:\n{stack}")
            self._thread.join(max(0.0, timeout_s - report_after_s))

    # -- the loop thread
    def _run(self) -> None:
        try:
            self.diagnostics.profile.run(self._loop)
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the loop is gone
            self._die(f"{type(exc).__name__}: {exc}", traceback.format_exc())
            return
        self._drain()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self.diagnostics.check_fault()
            if self._metrics is not None:
                safe_call(self._metrics.sample, self.engine)
            self._answer_stats()
            now = time.monotonic()
            if self._watch.due(now):
                pending = self._pending.items()
                self._watch.check(pending, now)
                if self._server_stopping is not None and pending \
                        and safe_call(self._server_stopping, default=False):
                    self._abort_pending()
            self._take_batch(self._idle_wait_s)

    def _count_poll_pass(self) -> None:
        self.diagnostics.cancel_poll_passes += 1

    def _take_batch(self, timeout_s: float) -> OutputBatch:
        started = time.perf_counter()
        batch = self.engine.next_outputs(timeout_s)
        taken = time.perf_counter()
        timer = self.diagnostics.timer
        if not batch.outputs and batch.step_error is None:
            timer.add("idle", taken - started)
            return batch
        self._route_batch(batch)
        timer.add("step", taken - started)
        timer.add("route", time.perf_counter() - taken)
        timer.steps += 1
        return batch

    def _route_batch(self, batch: OutputBatch) -> None:
        outputs = batch.outputs
        if self._metrics is not None and outputs:
            safe_call(self._metrics.observe_outputs, outputs, batch.made_at)
        found = self._pending.find(outputs)
        if self.diagnostics.tracing:
            self.diagnostics.trace_routed([(o.request_id, t.trace) for o, t in found
                                           if t is not None and t.trace is not None],
                                          batch.made_at, batch.arrivals)
        self._batch = []
        try:
            for out, tracked in found:
                if tracked is None:
                    continue
                try:
                    self._router.route(out, tracked)
                except Exception:
                    self._on_error("sending a response failed:\n" + traceback.format_exc())
        finally:
            items, self._batch = self._batch, None
            self._outbox.put_many(items)
        if batch.step_error is not None:  # a bug in the engine must not kill the server
            self._on_error(f"engine step failed: {batch.step_error}")
            self._fail_all(batch.step_error)

    def _die(self, reason: str, details: str) -> None:
        self.failure = reason
        self._on_error(f"radixlm: the engine loop died: {reason}\n{details}")
        self._fail_all(f"the engine loop died ({reason})")
        while True:
            try:
                sink, _ = self._stats_sinks.get_nowait()
            except queue.Empty:
                break
            safe_call(sink.send_error, f"the engine loop died ({reason})")
        self._outbox.close(10.0)
        if self._on_death is not None:
            safe_call(self._on_death, reason)

    def _answer_stats(self) -> None:
        while True:
            try:
                sink, flush = self._stats_sinks.get_nowait()
            except queue.Empty:
                return
            freed = self.engine.flush_cache() if flush else None
            stats = dict(self.engine.stats())
            if freed is not None:
                stats["flushed_kv_tokens"] = freed
            try:
                self.engine.check_integrity()
                stats["integrity_ok"], stats["integrity_error"] = True, None
            except AssertionError as exc:
                stats["integrity_ok"], stats["integrity_error"] = False, str(exc) or "failed"
            stats["num_pending_requests"] = self.num_active()
            stats.update(self.diagnostics.report())
            stats["loop"]["queued_responses"] = self._outbox.pending()
            safe_call(sink.send, wire_outputs.stats_outputs(stats), True)

    def _abort_pending(self) -> None:
        candidates = [(rid, t) for rid, t in self._pending.items()
                      if not (t.cancelled or t.aborted)]
        if candidates:
            self._on_info(f"radixlm: aborting {len(candidates)} pending request(s): "
                          "the server is stopping")
        for rid, tracked in candidates:
            tracked.aborted = True
            self.engine.abort(rid)

    def _put(self, rid: str, item: Streamed | Callable[[], None]) -> None:
        """To the outbox; while the loop thread routes a batch, with the batch's items
        (only the loop thread puts)."""
        if self._batch is not None:
            self._batch.append((rid, item))
        else:
            self._outbox.put(rid, item)

    def _fail_all(self, message: str) -> None:
        for rid, tracked in self._pending.take_all().items():
            self.engine.abort(rid)
            self._put(rid, lambda t=tracked: t.close_with(lambda: t.sink.send_error(message)))

    def _drain(self, budget_s: float = 10.0, quiet_s: float = 1.0) -> None:
        """Shutdown: abort everything and take batches until the engine has sent the
        aborts (or nothing came for ``quiet_s``)."""
        self._abort_pending()
        deadline = time.monotonic() + budget_s
        last_output = time.monotonic()
        try:
            while self.num_active() and time.monotonic() < deadline \
                    and time.monotonic() - last_output < quiet_s:
                if self._take_batch(0.1).outputs:
                    last_output = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the engine is gone: fail what is left
            self._on_error(f"radixlm: stopping the engine loop: {exc}")
        self._fail_all("the model is shutting down")
        self._answer_stats()
        self._outbox.close(max(1.0, deadline - time.monotonic()))

