"""The engine loop thread and per-request bookkeeping, independent of Triton.

``model.py`` turns each Triton request into a job (``wire.parse_request``) and a
``ResponseSink`` (its response sender); ``EngineLoop.submit`` hands the job to the
engine. One background thread owns ``engine.step()``: it routes every StepOutput to its
sink, polls sinks for client cancellation between steps (at most every ``cancel_poll_s``:
each poll costs an IPC round trip per pending request) and aborts cancelled requests in
the engine, and answers debug ``stats`` jobs between steps, when no forward pass runs.
It also hands finished outputs and (time-gated) stats samples to an optional metrics
recorder (``backend.metrics.EngineMetrics``).

If the thread itself dies (an exception outside a step, which step errors are not), every
pending request gets an error, later ones are refused with the reason, ``failure`` holds
it and ``on_death`` is called once: the model then reports itself unusable.

Response rules:
  * streaming: one response per step per sample with only the new output; the
    request's last response carries ``final=True``;
  * non-streaming: one response per sample with everything (n == 1: exactly one);
  * scoring and stats: exactly one response.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from backend import wire

log = logging.getLogger("radixlm.serving")


class ResponseSink(Protocol):
    """Where one request's responses go (a Triton response sender, or a test double)."""

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


class EngineLoop:
    """Owns the engine's step loop in one background thread."""

    def __init__(self, engine, idle_wait_s: float = 0.05, cancel_poll_s: float = 0.1,
                 on_error: Callable[[str], None] | None = None,
                 on_info: Callable[[str], None] | None = None,
                 server_stopping: Callable[[], bool] | None = None,
                 metrics: Any = None,
                 on_death: Callable[[str], None] | None = None) -> None:
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

    def start(self) -> None:
        self._thread.start()

    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    # -- called from Triton's execute thread
    def submit(self, job: wire.Job, sink: ResponseSink) -> None:
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
        rid = uuid.uuid4().hex
        prompt_text = job.prompt if isinstance(job.prompt, str) else ""
        n = job.params.n if isinstance(job, wire.GenerateJob) else 1
        tracked = _Tracked(job=job, sink=sink, prompt_text=prompt_text, num_samples=n)
        # Track first: the loop may produce output for rid as soon as the engine has it.
        with self._lock:
            self._active[rid] = tracked
        try:
            if isinstance(job, wire.ScoreJob):
                self.engine.add_score_request(job.prompt, job.choices, request_id=rid)
            else:
                if job.prepend_input and not isinstance(job.prompt, str):
                    tracked.prompt_text = self.engine.tokenizer.decode(job.prompt)
                self.engine.add_request(job.prompt, job.params, request_id=rid)
        except ValueError as exc:
            with self._lock:
                self._active.pop(rid, None)
            _safe(sink.send_error, str(exc))
            return
        if self.failure is not None:  # the loop died meanwhile, maybe after failing all
            with self._lock:
                missed = self._active.pop(rid, None)
            if missed is not None:
                _safe(sink.send_error, f"the engine loop died ({self.failure})")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort what is pending, send each request its final response, end the thread."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def inject_fault(self, message: str) -> None:
        """Make the loop thread raise ``message`` (fault-injection tests of the death path)."""
        self._fault = message

    # -- the loop thread
    def _run(self) -> None:
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
                self.engine.wait_for_work(self._idle_wait_s)
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
        if self._on_death is not None:
            _safe(self._on_death, reason)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug in the engine must not kill the server
            self._on_error("engine step failed:\n" + traceback.format_exc())
            self._fail_all(f"engine error: {exc}")
            return
        if self._metrics is not None and outputs:
            _safe(self._metrics.observe_outputs, outputs)
        for out in outputs:
            try:
                self._route(out)
            except Exception:
                self._on_error("sending a response failed:\n" + traceback.format_exc())

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
            _safe(sink.send, wire.stats_outputs(stats), True)

    def _abort_cancelled(self) -> None:
        with self._lock:
            candidates = [(rid, t) for rid, t in self._active.items() if not t.cancelled]
        for rid, tracked in candidates:
            if _safe(tracked.sink.is_cancelled, default=True):
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

    def _route(self, out) -> None:
        with self._lock:
            tracked = self._active.get(out.request_id)
        if tracked is None:
            return
        if getattr(out, "error", None):
            self._finish(out.request_id, lambda: tracked.sink.send_error(out.error))
            self.engine.abort(out.request_id)  # the other samples of this request, if any
            return
        if out.finished:
            tracked.finished.add(out.index)
        done = len(tracked.finished) >= tracked.num_samples
        if tracked.cancelled:
            if done:
                self._finish(out.request_id,
                             lambda: tracked.sink.send_error("request cancelled", cancelled=True))
            return
        if isinstance(tracked.job, wire.ScoreJob):
            if out.finished:
                payload = wire.score_outputs(getattr(out, "choice_scores", None) or [],
                                             out.num_prompt_tokens, out.num_cached_tokens)
                payload[wire.FINISH_REASON] = np.array([(out.finish_reason or "stop").encode()],
                                                       dtype=np.object_)
                self._finish(out.request_id, lambda: tracked.sink.send(payload, True))
            return
        sample = tracked.samples.setdefault(out.index, _Sample())
        if sample.context_ids is None:
            sample.context_ids = list(out.context_token_ids)
        if tracked.job.stream:
            if out.new_token_ids or out.new_text or out.finished:
                payload = self._generation_payload(tracked, out, sample, out.new_text,
                                                   out.new_token_ids, out.context_token_ids,
                                                   out.logprobs or [])
                self._send(out.request_id, tracked, payload, done)
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
        self._send(out.request_id, tracked, wire.merge_samples(payloads), True)

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
            logprobs=logprobs if tracked.job.params.logprobs else None)

    def _send(self, rid: str, tracked: _Tracked, payload, final: bool) -> None:
        if final:
            self._finish(rid, lambda: tracked.sink.send(payload, True))
        elif not _safe(tracked.sink.send, payload, False, default=False, ok=True):
            tracked.cancelled = True  # the client is gone: stop generating for it
            self.engine.abort(rid)

    def _finish(self, rid: str, send: Callable[[], None]) -> None:
        with self._lock:
            self._active.pop(rid, None)
        _safe(send)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            failed, self._active = self._active, {}
        for rid, tracked in failed.items():
            self.engine.abort(rid)
            _safe(tracked.sink.send_error, message)

    def _drain(self, budget_s: float = 10.0) -> None:
        """Shutdown: abort everything and step until the engine has sent the aborts."""
        self._abort_pending()
        deadline = time.monotonic() + budget_s
        while self.num_active() and time.monotonic() < deadline and self.engine.has_work():
            self._step()
        self._fail_all("the model is shutting down")
        self._answer_stats()


def _safe(fn: Callable, *args, default: Any = None, ok: Any = None) -> Any:
    """Call a sink (or metrics) method; a client that went away must not take the loop
    down."""
    try:
        result = fn(*args)
        return ok if ok is not None else result
    except Exception as exc:
        log.warning("%s failed: %s", getattr(fn, "__qualname__", "a sink call"), exc)
        return default
