"""The serving loop, independent of Triton: requests in through an ``EngineHandle``,
responses out through each request's ``ResponseSink``.

``model.py`` turns each Triton request into a job (``wire.parse_request``) and a sink
(its response sender); ``EngineLoop.submit`` hands the job to the engine handle. One
background thread takes each ``OutputBatch`` from the handle (with the engine in this
process, taking it runs the step) and routes every output to its request
(``routing.Router``); responses leave through the outbox's sender threads
(``outbox.Outbox``). Between batches it answers debug ``stats`` jobs, polls the sinks for
client cancellation (at most every ``cancel_poll_s``: each poll is an IPC round trip per
pending request), and hands finished outputs and (time-gated) stats samples to an
optional metrics recorder (``backend.metrics.EngineMetrics``).

If the loop thread itself dies (an exception outside a step, which step errors are not,
or the engine process gone), every pending request gets an error, later ones are refused
with the reason, ``failure`` holds it and ``on_death`` is called once: the model then
reports itself unusable.
"""
from __future__ import annotations

import itertools
import logging
import queue
import secrets
import sys
import threading
import time
import traceback
from typing import Any, Callable

from backend import wire, wire_outputs
from backend.core.handle import (EngineDied, EngineHandle, GenerateRequest, OutputBatch,
                                 ScoreRequest)
from backend.diagnostics import LoopDiagnostics
from backend.outbox import Outbox, Streamed
from backend.routing import Router
from backend.serving_types import ResponseSink, Tracked, safe_call

log = logging.getLogger("radixlm.serving")


class EngineLoop:
    """Owns the serving loop thread in front of one engine handle."""

    def __init__(self, engine: EngineHandle, idle_wait_s: float = 0.05, cancel_poll_s: float = 0.1,
                 on_error: Callable[[str], None] | None = None,
                 on_info: Callable[[str], None] | None = None,
                 server_stopping: Callable[[], bool] | None = None, metrics: Any = None,
                 on_death: Callable[[str], None] | None = None, sender_threads: int = 2,
                 heartbeat_s: float = 1.0) -> None:
        """``server_stopping``, polled while requests are pending, says the server has
        begun to shut down: pending requests are then aborted so that each gets its final
        response (tritonserver only unloads the model, and so calls ``finalize``, once
        every response sender has sent its final flag)."""
        self.engine = engine
        self._metrics = metrics
        self._on_death = on_death
        self.failure: str | None = None  # why the loop thread died, once it has
        self._idle_wait_s = idle_wait_s
        self._cancel_poll_s = cancel_poll_s
        self._server_stopping = server_stopping
        self._on_error = on_error or log.error
        self._on_info = on_info or log.info
        self._lock = threading.Lock()
        self._active: dict[str, Tracked] = {}
        # (sink, flush the prefix cache first) of debug requests, answered between batches
        self._stats_sinks: queue.SimpleQueue[tuple[ResponseSink, bool]] = queue.SimpleQueue()
        self._cancel_tokens: dict[str, str] = {}  # cancel_token -> request id
        self._heartbeat_s = heartbeat_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixlm-engine-loop", daemon=True)
        self._router = Router(self._put, self._retire, engine.abort,
                              before_final=metrics.flush if metrics is not None else None)
        self._outbox = Outbox(self._router.deliver_delta, sender_threads)
        self._batch: list | None = None  # outbox items of the batch being routed
        self._id_prefix = f"{id(self):x}-{time.monotonic_ns():x}-"
        self._ids = itertools.count()
        self.diagnostics = LoopDiagnostics()

    @property
    def tracing(self) -> bool:
        return self.diagnostics.tracing

    def start(self) -> None:
        self._outbox.start()
        self._thread.start()

    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

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
        prompt_text = job.prompt if isinstance(job.prompt, str) else ""
        n = job.params.num_samples if isinstance(job, wire.GenerateJob) else 1
        tracked = Tracked(job=job, sink=sink, prompt_text=prompt_text, num_samples=n,
                          wanted=sink.wanted, trace=self.diagnostics.new_trace(label or rid),
                          last_sent=time.monotonic())
        if timeout_s is not None and timeout_s > 0:
            tracked.deadline = time.monotonic() + timeout_s
            tracked.cancel_message = f"request timed out (its limit: {timeout_s:g} s)"
        if isinstance(job, wire.ScoreJob):
            request = ScoreRequest(rid, job.prompt, job.choices)
        else:
            if job.prepend_input and not isinstance(job.prompt, str):
                try:
                    tracked.prompt_text = self.engine.prompt_text(job.prompt)
                except (OverflowError, ValueError, TypeError):
                    pass  # ids outside the vocabulary: the engine refuses them by name
            if wire.CANCEL_TOKEN in job.outputs:
                tracked.cancel_token = secrets.token_hex(16)
            request = GenerateRequest(rid, job.prompt, job.params, _text_per_step(job, sink))
            if self._metrics is not None:
                safe_call(self._metrics.observe_request, job.params.n)
        # Track first: the loop may produce output for rid as soon as the engine has it.
        with self._lock:
            self._active[rid] = tracked
            if tracked.cancel_token is not None:
                self._cancel_tokens[tracked.cancel_token] = rid
        try:
            self.engine.submit(request)
        except EngineDied as exc:  # the loop thread notices too, and fails the rest
            message = f"the engine is not running ({exc})"
            if self._retire(rid) is not None:
                tracked.close_with(lambda: sink.send_error(message))
            return
        if self.failure is not None:  # the loop died meanwhile, maybe after failing all
            if self._retire(rid) is not None:
                reason = self.failure
                tracked.close_with(lambda: sink.send_error(f"the engine loop died ({reason})"))

    def _cancel(self, token: str, sink: ResponseSink) -> None:
        """A cancel request: abort the request that sent ``token`` (an ensemble relays its
        client's cancellation so), then answer with one empty response."""
        with self._lock:
            rid = self._cancel_tokens.get(token)
            tracked = self._active.get(rid) if rid is not None else None
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
        last_poll = 0.0
        while not self._stopping.is_set():
            self.diagnostics.check_fault()
            if self._metrics is not None:
                safe_call(self._metrics.sample, self.engine)
            self._answer_stats()
            now = time.monotonic()
            if now - last_poll >= self._cancel_poll_s:
                self._abort_cancelled()
                self._send_heartbeats(now)
                if self._server_stopping is not None and self.num_active() \
                        and safe_call(self._server_stopping, default=False):
                    self._abort_pending()
                last_poll = now
            self._take_batch(self._idle_wait_s)

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
        with self._lock:  # one look-up pass for the whole batch
            found = [(out, self._active.get(out.request_id)) for out in outputs]
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

    def _abort_cancelled(self) -> None:
        """Abort each request whose client left (its sink says so) or whose time is up."""
        now = time.monotonic()
        with self._lock:
            candidates = [(rid, t) for rid, t in self._active.items() if not t.cancelled]
        for rid, tracked in candidates:
            if tracked.deadline is not None and now >= tracked.deadline:
                tracked.cancelled = True
                self.engine.abort(rid)
                continue
            if not tracked.io_lock.acquire(blocking=False):
                continue  # a sender is busy with it: ask next round, do not wait here
            try:
                if tracked.closed:
                    continue
                cancelled = safe_call(tracked.sink.is_cancelled, default=True)
            finally:
                tracked.io_lock.release()
            if cancelled:
                tracked.cancelled = True
                self.engine.abort(rid)

    def _send_heartbeats(self, now: float) -> None:
        """An empty response to every request that asked for a cancel_token and has sent
        nothing for heartbeat_s: the ensemble's postprocessing step only runs on a
        response, and a run is its one chance to see that its client cancelled."""
        with self._lock:
            due = [(rid, t) for rid, t in self._active.items() if t.cancel_token is not None
                   and now - t.last_sent >= self._heartbeat_s and not t.cancelled]
        for rid, tracked in due:
            tracked.last_sent = now
            payload = _heartbeat_payload(tracked)
            self._put(rid, lambda t=tracked, p=payload: _send_open(t, p))

    def _abort_pending(self) -> None:
        with self._lock:
            candidates = [(rid, t) for rid, t in self._active.items()
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

    def _retire(self, rid: str) -> Tracked | None:
        """The engine is done with ``rid``: stop tracking it (its final may still be queued)."""
        with self._lock:
            tracked = self._active.pop(rid, None)
            if tracked is not None and tracked.cancel_token is not None:
                self._cancel_tokens.pop(tracked.cancel_token, None)
            return tracked

    def _fail_all(self, message: str) -> None:
        with self._lock:
            failed, self._active = self._active, {}
            self._cancel_tokens.clear()
        for rid, tracked in failed.items():
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


def _text_per_step(job: wire.GenerateJob, sink: ResponseSink) -> bool:
    """Whether the engine should detokenize every step (its ``stream`` flag): only for a
    streamed request whose client reads text_output. Otherwise the text is decoded once,
    when the request finishes (stop strings still see every step's text: the engine
    keeps decoding incrementally for them)."""
    wanted = sink.wanted
    return job.stream and (wanted is None or wire.TEXT_OUTPUT in wanted)
