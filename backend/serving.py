"""The engine loop thread and per-request bookkeeping, independent of Triton.

``model.py`` turns each Triton request into a job (``wire.parse_request``) and a
``ResponseSink`` (its response sender); ``EngineLoop.submit`` hands the job to the
engine. One background thread owns ``engine.step()`` and routes every StepOutput to its
request; it also answers debug ``stats`` jobs between steps, when no forward pass runs,
and hands finished outputs and (time-gated) stats samples to an optional metrics
recorder (``backend.metrics.EngineMetrics``).

Responses leave through an outbox, not from the engine thread: a Triton send is an IPC
round trip to the server process (it releases the GIL while it waits), and 128 streams
sending one token each per step would otherwise stall the GPU for tens of milliseconds
per step. Sender threads drain the outbox request by request, in order; streamed tokens
that queued up while a send was in flight go out together in one response. The loop
thread polls the sinks for client cancellation between steps (at most every
``cancel_poll_s``: each poll is an IPC round trip per pending request; polled from a
thread of its own, a stopping tritonserver sometimes never delivered the final response).

If the loop thread itself dies (an exception outside a step, which step errors are not),
every pending request gets an error, later ones are refused with the reason, ``failure``
holds it and ``on_death`` is called once: the model then reports itself unusable.

Response rules:
  * streaming: each response carries the sample's output produced since its previous
    response (one step's tokens when the senders keep up, several steps' when they do
    not); the request's last response carries ``final=True``;
  * non-streaming: one response with everything (n > 1: every sample, merged);
  * scoring and stats: exactly one response.
"""
from __future__ import annotations

import collections
import io
import itertools
import logging
import os
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from backend import wire

log = logging.getLogger("radixlm.serving")
PROFILE_ENV = "RADIXLM_PROFILE_DIR"  # set: the loop thread is profiled into this folder
# N > 0: debug stats carry the timelines of the last N requests (wall-clock seconds):
# intake (handed to submit), received (the engine has it: an engine in another process
# says when; else the intake), made (its first output left the engine), routed (the loop
# thread picked it up), first_sent / final_sent (a sender's send returned), responses
TRACE_ENV = "RADIXLM_TRACE_REQUESTS"
BURST_GAP_S = 0.002  # hand-overs closer than this count as one burst in the intake stats


class ResponseSink(Protocol):
    """Where one request's responses go (a Triton response sender, or a test double)."""

    # the outputs the client asked for (None: all); a sink may leave it out
    wanted: frozenset[str] | None

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...
    def send_error(self, message: str, cancelled: bool = False) -> None: ...  # always final
    def is_cancelled(self) -> bool: ...


# ---- request bookkeeping --------------------------------------------------------------

@dataclass
class _Sample:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    context_ids: list[int] | None = None  # of the first output: what precedes it
    sent_first: bool = False
    final: object = None  # the sample's last StepOutput (finish reason, counts)


@dataclass
class _Tracked:
    job: wire.GenerateJob | wire.ScoreJob
    sink: ResponseSink
    prompt_text: str
    num_samples: int
    samples: dict[int, _Sample] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    cancelled: bool = False  # by the client: its final response is a CANCELLED error
    aborted: bool = False  # by the server shutting down: a final with finish_reason "abort"
    # Once the final response is sent, Triton frees the request's response factory and
    # any later call on the sink (an is_cancelled poll included) would touch freed
    # memory: the final send and each poll hold io_lock, and ``closed`` ends the sink.
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    trace: dict | None = None  # the request's timeline, when tracing (TRACE_ENV)

    def close_with(self, send: Callable[[], None]) -> None:
        """Send the final response (or error), unless one was already sent."""
        with self.io_lock:
            if self.closed:
                return
            self.closed = True
            _safe(send)


class _Delta:
    """Streamed output of one sample, waiting in the outbox: its first step's output and
    every later one that arrived before a sender took it."""

    __slots__ = ("tracked", "sample", "out", "text", "token_ids", "logprobs", "context_ids",
                 "final")

    def __init__(self, tracked: _Tracked, sample: _Sample, out, final: bool) -> None:
        self.tracked, self.sample = tracked, sample
        self.out = out  # the latest StepOutput (finish reason, counts)
        self.text = [out.new_text]
        self.token_ids = list(out.new_token_ids)
        self.logprobs = list(out.logprobs) if out.logprobs else []
        self.context_ids = out.context_token_ids  # what precedes the first of token_ids
        self.final = final  # the request's last response

    def add(self, out, final: bool) -> None:
        """A later step's output of the same sample."""
        self.out = out
        self.text.append(out.new_text)
        self.token_ids += out.new_token_ids
        if out.logprobs:
            self.logprobs += out.logprobs
        self.final = self.final or final


# A streamed step output on its way to the outbox: (tracked, sample, StepOutput, final).
# The outbox adds it to the sample's delta still queued, else queues a new _Delta: a
# request whose sender is behind costs a few list appends per token, not an object.
_Streamed = tuple


class _Outbox:
    """Per-request ordered queues of pending responses, drained by sender threads.

    A request is handled by one sender at a time, so its responses keep their order.
    Queued output of the same sample merges into one response; a callable item (a final
    non-streamed response, an error) runs after everything queued before it."""

    def __init__(self, deliver_delta: Callable[[_Delta], None], num_threads: int) -> None:
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

    def put(self, rid: str, item: _Streamed | Callable[[], None]) -> None:
        self.put_many([(rid, item)])

    def put_many(self, items: list[tuple[str, _Streamed | Callable[[], None]]]) -> None:
        """Queue (request id, item) pairs in order, taking the lock once: a step's outputs
        go in together rather than contending with the senders once per request."""
        woken = 0
        with self._cv:
            for rid, item in items:
                queued = self._queues.get(rid)
                if item.__class__ is tuple:  # streamed output
                    if queued is not None and _merge_streamed(queued, item):
                        continue
                    item = _Delta(*item)
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
        # put_many already merged each sample's step outputs into one delta
        deltas: list[_Delta] = []
        for item in items:
            if item.__class__ is _Delta:
                deltas.append(item)
                continue
            self._flush(deltas)
            _safe(item)
        self._flush(deltas)

    def _flush(self, deltas: list[_Delta]) -> None:
        # the request's final response goes last (with n > 1, the sample that finished
        # last may have had its delta queued before another sample's)
        for delta in sorted(deltas, key=lambda d: d.final):
            self._deliver_delta(delta)
        deltas.clear()


class EngineLoop:
    """Owns the engine's step loop in one background thread."""

    def __init__(self, engine, idle_wait_s: float = 0.05, cancel_poll_s: float = 0.1,
                 on_error: Callable[[str], None] | None = None,
                 on_info: Callable[[str], None] | None = None,
                 server_stopping: Callable[[], bool] | None = None,
                 metrics: Any = None,
                 on_death: Callable[[str], None] | None = None,
                 sender_threads: int = 2) -> None:
        """``server_stopping``, polled while requests are pending, says the server has
        begun to shut down: pending requests are then aborted so that each gets its final
        response (tritonserver only unloads the model, and so calls ``finalize``, once
        every response sender has sent its final flag)."""
        self.engine = engine
        self._metrics = metrics
        self._on_death = on_death
        self.failure: str | None = None  # why the loop thread died, once it has
        self._fault: str | None = None
        self._idle_wait_s = idle_wait_s
        self._cancel_poll_s = cancel_poll_s
        self._server_stopping = server_stopping
        self._on_error = on_error or log.error
        self._on_info = on_info or log.info
        self._lock = threading.Lock()
        self._active: dict[str, _Tracked] = {}
        self._stats_sinks: queue.SimpleQueue[ResponseSink] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixlm-engine-loop", daemon=True)
        self._outbox = _Outbox(self._deliver_delta, sender_threads)
        self._batch: list | None = None  # outbox items of the step being routed
        self._id_prefix = uuid.uuid4().hex[:12] + "-"
        self._ids = itertools.count()
        # where the loop thread's time goes (seconds; in debug stats)
        self.timings: dict[str, float] = {"step_s": 0.0, "route_s": 0.0, "idle_s": 0.0, "steps": 0}
        # the serving layer's request intake (written by its thread through note_intake)
        self.timings.update(intake_requests=0, intake_s=0.0, intake_burst_gaps=0,
                            intake_burst_gap_s=0.0)
        self._last_intake_end: float | None = None
        self._profiler = None
        self._profile_path: Path | None = None
        capacity = env_int(TRACE_ENV)
        self._traces: collections.deque | None = (collections.deque(maxlen=capacity)
                                                  if capacity > 0 else None)

    @property
    def tracing(self) -> bool:
        return self._traces is not None

    def start(self) -> None:
        self._outbox.start()
        self._thread.start()

    def note_intake(self, started: float, ended: float, requests: int) -> None:
        """Account one hand-over of ``requests`` requests (perf_counter times): the
        seconds spent parsing and submitting them, and, when it came right after the
        previous one (a burst), the gap between the two, which the server spent
        delivering the next request to this process."""
        t = self.timings
        t["intake_requests"] += requests
        t["intake_s"] += ended - started
        last, self._last_intake_end = self._last_intake_end, ended
        if last is not None and started - last < BURST_GAP_S:
            t["intake_burst_gaps"] += 1
            t["intake_burst_gap_s"] += started - last

    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    # -- called from Triton's execute thread
    def submit(self, job: wire.Job, sink: ResponseSink, label: str | None = None) -> None:
        """``label``: the request's name in traces (Triton's request id)."""
        if self.failure is not None:
            _safe(sink.send_error, f"the engine is not running ({self.failure}); "
                                   "the model is unavailable")
            return
        if self._stopping.is_set():
            _safe(sink.send_error, "the model is shutting down")
            return
        if isinstance(job, wire.StatsJob):
            self._stats_sinks.put(sink)
            return
        rid = f"{self._id_prefix}{next(self._ids)}"  # uuid4 would make a getrandom call
        prompt_text = job.prompt if isinstance(job.prompt, str) else ""
        n = job.params.n if isinstance(job, wire.GenerateJob) else 1
        tracked = _Tracked(job=job, sink=sink, prompt_text=prompt_text, num_samples=n)
        if self._traces is not None:
            tracked.trace = {"id": label or rid, "intake": time.time()}
            self._traces.append(tracked.trace)
        # Track first: the loop may produce output for rid as soon as the engine has it.
        with self._lock:
            self._active[rid] = tracked
        try:
            if isinstance(job, wire.ScoreJob):
                self.engine.add_score_request(job.prompt, job.choices, request_id=rid)
            else:
                if job.prepend_input and not isinstance(job.prompt, str):
                    tracked.prompt_text = self.engine.tokenizer.decode(job.prompt)
                self.engine.add_request(job.prompt, job.params, request_id=rid,
                                        stream=_text_per_step(job, sink))
        except ValueError as exc:
            self._retire(rid)
            message = str(exc)
            tracked.close_with(lambda: sink.send_error(message))
            return
        if self.failure is not None:  # the loop died meanwhile, maybe after failing all
            if self._retire(rid) is not None:
                reason = self.failure
                tracked.close_with(lambda: sink.send_error(f"the engine loop died ({reason})"))

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

    def inject_fault(self, message: str) -> None:
        """Make the loop thread raise ``message`` (fault-injection tests of the death path)."""
        self._fault = message

    # -- the loop thread
    def _run(self) -> None:
        profile_dir = os.environ.get(PROFILE_ENV)
        if profile_dir:  # a diagnosis aid: cProfile of this thread, written at every stats
            import cProfile  # request and when the thread ends
            self._profile_path = Path(profile_dir) / f"engine_loop_{os.getpid()}.txt"
            self._profiler = cProfile.Profile()
            self._profiler.enable()
            try:
                self._run_loop()
            finally:
                self._profiler.disable()
                self._dump_profile()
            return
        self._run_loop()

    def _dump_profile(self) -> None:
        """Write the loop thread's profile so far (only when RADIXLM_PROFILE_DIR is set)."""
        if self._profiler is not None:
            write_profile(self._profiler, self._profile_path)

    def _run_loop(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the loop is gone
            self._die(f"{type(exc).__name__}: {exc}", traceback.format_exc())
            return
        self._drain()

    def _loop(self) -> None:
        last_poll = 0.0
        while not self._stopping.is_set():
            if self._fault is not None:
                raise RuntimeError(self._fault)
            if self._metrics is not None:
                _safe(self._metrics.sample, self.engine)
            self._answer_stats()
            now = time.monotonic()
            if now - last_poll >= self._cancel_poll_s:
                self._abort_cancelled()
                if self._server_stopping is not None and self.num_active() \
                        and _safe(self._server_stopping, default=False):
                    self._abort_pending()
                last_poll = now
            if not self.engine.has_work():
                started = time.perf_counter()
                self.engine.wait_for_work(self._idle_wait_s)
                self.timings["idle_s"] += time.perf_counter() - started
                continue
            self._step()

    def _die(self, reason: str, details: str) -> None:
        self.failure = reason
        self._on_error(f"radixlm: the engine loop died: {reason}\n{details}")
        self._fail_all(f"the engine loop died ({reason})")
        while True:
            try:
                sink = self._stats_sinks.get_nowait()
            except queue.Empty:
                break
            _safe(sink.send_error, f"the engine loop died ({reason})")
        self._outbox.close(10.0)
        if self._on_death is not None:
            _safe(self._on_death, reason)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug in the engine must not kill the server
            self._on_error("engine step failed:\n" + traceback.format_exc())
            self._fail_all(f"engine error: {exc}")
            return
        stepped = time.perf_counter()
        if self._metrics is not None and outputs:
            _safe(self._metrics.observe_outputs, outputs)
        with self._lock:  # one look-up pass for the whole step
            found = [(out, self._active.get(out.request_id)) for out in outputs]
        if self._traces is not None and found:
            self._trace_routed(found)
        self._batch = []
        try:
            for out, tracked in found:
                if tracked is None:
                    continue
                try:
                    self._route(out, tracked)
                except Exception:
                    self._on_error("sending a response failed:\n" + traceback.format_exc())
        finally:
            batch, self._batch = self._batch, None
            self._outbox.put_many(batch)
        self.timings["step_s"] += stepped - started
        self.timings["route_s"] += time.perf_counter() - stepped
        self.timings["steps"] += 1

    def _trace_routed(self, found: list) -> None:
        routed = time.time()
        # an engine in another process says when its outputs left and its requests arrived
        made = getattr(self.engine, "last_made_at", None) or routed
        received = getattr(self.engine, "received_at", None) or {}
        for out, tracked in found:
            trace = tracked.trace if tracked is not None else None
            if trace is not None and "routed" not in trace:
                trace["made"], trace["routed"] = made, routed
                trace["received"] = received.pop(out.request_id, trace["intake"])
            elif trace is None and received:
                received.pop(out.request_id, None)  # no longer tracked: not kept either

    @staticmethod
    def _trace_sent(tracked: _Tracked, final: bool) -> None:
        trace = tracked.trace
        if trace is not None:
            now = time.time()
            trace.setdefault("first_sent", now)
            trace["responses"] = trace.get("responses", 0) + 1
            if final:
                trace["final_sent"] = now

    def _answer_stats(self) -> None:
        while True:
            try:
                sink = self._stats_sinks.get_nowait()
            except queue.Empty:
                return
            stats = dict(self.engine.stats())
            try:
                self.engine.check_integrity()
                stats["integrity_ok"], stats["integrity_error"] = True, None
            except AssertionError as exc:
                stats["integrity_ok"], stats["integrity_error"] = False, str(exc) or "failed"
            stats["num_pending_requests"] = self.num_active()
            stats["loop"] = {k: round(v, 4) for k, v in self.timings.items()}
            stats["loop"]["queued_responses"] = self._outbox.pending()
            if self._traces is not None:  # each timeline is reported once
                traces = []
                while self._traces:
                    traces.append(dict(self._traces.popleft()))  # a copy: senders write on
                stats["trace"] = traces
            if self._profiler is not None:
                self._dump_profile()
                self._profiler.enable()
            _safe(sink.send, wire.stats_outputs(stats), True)

    def _abort_cancelled(self) -> None:
        with self._lock:
            candidates = [(rid, t) for rid, t in self._active.items() if not t.cancelled]
        for rid, tracked in candidates:
            if not tracked.io_lock.acquire(blocking=False):
                continue  # a sender is busy with it: ask next round, do not wait here
            try:
                if tracked.closed:
                    continue
                cancelled = _safe(tracked.sink.is_cancelled, default=True)
            finally:
                tracked.io_lock.release()
            if cancelled:
                tracked.cancelled = True
                self.engine.abort(rid)

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

    def _put(self, rid: str, item: _Streamed | Callable[[], None]) -> None:
        """To the outbox; while the loop thread routes a step, with the step's batch
        (only the loop thread puts)."""
        if self._batch is not None:
            self._batch.append((rid, item))
        else:
            self._outbox.put(rid, item)

    def _route(self, out, tracked: _Tracked) -> None:
        if getattr(out, "error", None):
            self._finish(out.request_id, tracked, lambda: tracked.sink.send_error(out.error))
            self.engine.abort(out.request_id)  # the other samples of this request, if any
            return
        if out.finished:
            tracked.finished.add(out.index)
        done = len(tracked.finished) >= tracked.num_samples
        if tracked.cancelled:
            if done:
                self._finish(out.request_id, tracked,
                             lambda: tracked.sink.send_error("request cancelled", cancelled=True))
            return
        if isinstance(tracked.job, wire.ScoreJob):
            if out.finished:
                payload = wire.score_outputs(getattr(out, "choice_scores", None) or [],
                                             out.num_prompt_tokens, out.num_cached_tokens)
                payload[wire.FINISH_REASON] = np.array([(out.finish_reason or "stop").encode()],
                                                       dtype=np.object_)
                self._finish(out.request_id, tracked, lambda: tracked.sink.send(payload, True))
            return
        sample = tracked.samples.setdefault(out.index, _Sample())
        if sample.context_ids is None:
            sample.context_ids = list(out.context_token_ids)
        if tracked.job.stream:
            if out.new_token_ids or out.new_text or out.finished:
                if done:
                    self._retire(out.request_id)
                self._put(out.request_id, (tracked, sample, out, done))
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
        payloads = [self._generation_payload(tracked, s.final, s, "".join(s.text), s.token_ids,
                                             s.context_ids, s.logprobs)
                    for _, s in sorted(tracked.samples.items())]
        merged = wire.merge_samples(payloads)
        self._finish(out.request_id, tracked, lambda: tracked.sink.send(merged, True))

    def _generation_payload(self, tracked: _Tracked, out, sample: _Sample, text: str,
                            token_ids: list[int], context_ids: list[int], logprobs: list):
        if tracked.job.prepend_input and not sample.sent_first:
            text = tracked.prompt_text + text
        sample.sent_first = True
        return wire.generation_outputs(
            text=text, token_ids=token_ids, context_ids=context_ids,
            finish_reason=out.finish_reason if out.finished else None,
            num_input_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens, index=out.index,
            logprobs=logprobs if tracked.job.params.logprobs else None,
            wanted=getattr(tracked.sink, "wanted", None))

    def _deliver_delta(self, delta: _Delta) -> None:
        """On a sender thread: one streamed response (several steps' output, merged)."""
        tracked = delta.tracked
        if tracked.cancelled and not delta.final:
            return  # its cancelled final follows
        payload = self._generation_payload(tracked, delta.out, delta.sample, "".join(delta.text),
                                           delta.token_ids, delta.context_ids, delta.logprobs)
        if delta.final:
            tracked.close_with(lambda: tracked.sink.send(payload, True))
            self._trace_sent(tracked, True)
            return
        with tracked.io_lock:
            if tracked.closed:
                return
            sent = _safe(tracked.sink.send, payload, False, default=False, ok=True)
        self._trace_sent(tracked, False)
        if not sent:
            tracked.cancelled = True  # the client is gone: stop generating for it
            self.engine.abort(delta.out.request_id)

    def _retire(self, rid: str) -> _Tracked | None:
        """The engine is done with ``rid``: stop tracking it (its final may still be queued)."""
        with self._lock:
            return self._active.pop(rid, None)

    def _finish(self, rid: str, tracked: _Tracked, send: Callable[[], None]) -> None:
        self._retire(rid)

        def final() -> None:
            tracked.close_with(send)
            self._trace_sent(tracked, True)
        self._put(rid, final)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            failed, self._active = self._active, {}
        for rid, tracked in failed.items():
            self.engine.abort(rid)
            self._put(rid, lambda t=tracked: t.close_with(lambda: t.sink.send_error(message)))

    def _drain(self, budget_s: float = 10.0) -> None:
        """Shutdown: abort everything and step until the engine has sent the aborts."""
        self._abort_pending()
        deadline = time.monotonic() + budget_s
        while self.num_active() and time.monotonic() < deadline:
            # an engine in another process has work whose outputs are still on the way
            if not self.engine.has_work() and not self.engine.wait_for_work(0.1):
                break
            self._step()
        self._fail_all("the model is shutting down")
        self._answer_stats()
        self._outbox.close(max(1.0, deadline - time.monotonic()))


def write_profile(profiler, path: Path) -> None:
    """A cProfile profile so far as text at ``path``, by own time and by cumulative time
    (reading it stops the profiler: enable it again to go on)."""
    import pstats
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out.getvalue())
    except OSError as exc:
        log.warning("cannot write the profile %s: %s", path, exc)


def _merge_streamed(queued: list, item: _Streamed) -> bool:
    """Add a streamed output to its sample's delta among the trailing deltas of a
    request's queue; False when there is none (a callable comes after it, or none yet)."""
    sample = item[1]
    for prev in reversed(queued):
        if prev.__class__ is not _Delta:
            return False
        if prev.sample is sample:
            prev.add(item[2], item[3])
            return True
    return False


def _text_per_step(job: wire.GenerateJob, sink: ResponseSink) -> bool:
    """Whether the engine should detokenize every step (its ``stream`` flag): only for a
    streamed request whose client reads text_output. Otherwise the text is decoded once,
    when the request finishes (stop strings still see every step's text: the engine
    keeps decoding incrementally for them)."""
    wanted = getattr(sink, "wanted", None)
    return job.stream and (wanted is None or wire.TEXT_OUTPUT in wanted)


def env_int(name: str) -> int:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else 0
    except ValueError:
        log.warning("%s=%r is not an integer; ignored", name, value)
        return 0


def _safe(fn: Callable, *args, default: Any = None, ok: Any = None) -> Any:
    """Call a sink (or metrics) method; a client that went away must not take the loop
    down."""
    try:
        result = fn(*args)
        return ok if ok is not None else result
    except Exception as exc:
        log.warning("%s failed: %s", getattr(fn, "__qualname__", "a sink call"), exc)
        return default

