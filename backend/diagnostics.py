"""Diagnosis aids of the serving loop and the engine process, behind one narrow hook each
(``LoopDiagnostics``, ``EngineDiagnostics``): where the loop threads' time goes, request
timelines (``RADIXLM_TRACE_REQUESTS``), cProfile of a loop thread (``RADIXLM_PROFILE_DIR``),
and fault injection for tests (``RADIXLM_FAULT_INJECTION``). Timelines and profiles
cost nothing unless their setting is on; the time counters are a few additions a step.
"""
from __future__ import annotations

import collections
import io
import logging
import os
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("radixlm.diagnostics")

PROFILE_ENV = "RADIXLM_PROFILE_DIR"  # set: the loop thread is profiled into this folder
# N > 0: debug stats carry the timelines of the last N requests (wall-clock seconds):
# intake (handed to submit), received (the engine has it), made (its first output left
# the engine), routed (the loop thread picked it up), first_sent / final_sent (a
# sender's send returned), responses
TRACE_ENV = "RADIXLM_TRACE_REQUESTS"
# "1": a request with parameter debug="fail_engine_loop" kills the engine loop (tests of
# the failure path; never set it in production)
FAULT_INJECTION_ENV = "RADIXLM_FAULT_INJECTION"
FAIL_ENGINE_LOOP = "fail_engine_loop"
BURST_GAP_S = 0.002  # hand-overs closer than this count as one burst in the intake stats


def env_int(name: str) -> int:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else 0
    except ValueError:
        log.warning("%s=%r is not an integer; ignored", name, value)
        return 0


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


class ThreadProfile:
    """cProfile of one thread when ``RADIXLM_PROFILE_DIR`` is set, written to
    ``<dir>/<name>_<pid>.txt`` at every ``dump`` and when the thread ends."""

    def __init__(self, name: str) -> None:
        folder = os.environ.get(PROFILE_ENV)
        self.path = Path(folder) / f"{name}_{os.getpid()}.txt" if folder else None
        self._profiler = None

    def run(self, fn: Callable[[], None]) -> None:
        if self.path is None:
            fn()
            return
        import cProfile
        self._profiler = cProfile.Profile()
        self._profiler.enable()
        try:
            fn()
        finally:
            self._profiler.disable()
            write_profile(self._profiler, self.path)

    def dump(self) -> None:
        if self._profiler is not None:
            write_profile(self._profiler, self.path)
            self._profiler.enable()


class StepTimer:
    """Seconds a loop spends per phase, and its step count."""

    def __init__(self, *phases: str) -> None:
        self.seconds = dict.fromkeys(phases, 0.0)
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def report(self) -> dict:
        return {**{f"{k}_s": round(v, 4) for k, v in self.seconds.items()}, "steps": self.steps}


class IpcCounts:
    """Round trips from the stub to the server process, by kind: every ``pb_utils`` call
    that waits for tritonserver (``backend.triton_io`` counts them; reading a request's
    inputs, parameters or response sender is no round trip, its data is in shared memory
    already). Plain ints: senders bump them concurrently, and a rare lost increment is
    no matter for a diagnosis."""

    __slots__ = ("response_sends", "error_sends", "cancel_polls", "metric_increments",
                 "metric_sets", "metric_observes")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def report(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class LoopDiagnostics:
    """The serving loop's: time per phase, request intake, timelines, profile, faults,
    the stub's round trips to the server (``ipc``) and the cancellation polls' passes."""

    def __init__(self, ipc: IpcCounts | None = None) -> None:
        self.timer = StepTimer("step", "route", "idle")
        self.ipc = ipc if ipc is not None else IpcCounts()
        self.cancel_poll_passes = 0
        self.intake = {"intake_requests": 0, "intake_s": 0.0, "intake_burst_gaps": 0,
                       "intake_burst_gap_s": 0.0}
        self._last_intake_end: float | None = None
        capacity = env_int(TRACE_ENV)
        self._traces = collections.deque(maxlen=capacity) if capacity > 0 else None
        self.profile = ThreadProfile("engine_loop")
        self.fault_injection = os.environ.get(FAULT_INJECTION_ENV) == "1"
        self._fault: str | None = None

    @property
    def tracing(self) -> bool:
        return self._traces is not None

    def note_intake(self, started: float, ended: float, requests: int) -> None:
        """One hand-over of ``requests`` requests (perf_counter times): the seconds spent
        parsing and submitting them, and, when it came right after the previous one (a
        burst), the gap between the two, which the server spent delivering the next
        request to this process."""
        t = self.intake
        t["intake_requests"] += requests
        t["intake_s"] += ended - started
        last, self._last_intake_end = self._last_intake_end, ended
        if last is not None and started - last < BURST_GAP_S:
            t["intake_burst_gaps"] += 1
            t["intake_burst_gap_s"] += started - last

    def new_trace(self, label: str) -> dict | None:
        if self._traces is None:
            return None
        trace = {"id": label, "intake": time.time()}
        self._traces.append(trace)
        return trace

    @staticmethod
    def trace_routed(traces: list[tuple[str, dict]], made_at: float,
                     arrivals: dict[str, float] | None) -> None:
        """(request id, timeline) of the requests whose outputs were just routed."""
        routed = time.time()
        arrivals = arrivals or {}
        for rid, trace in traces:
            if "routed" not in trace:
                trace["made"], trace["routed"] = made_at or routed, routed
                trace["received"] = arrivals.get(rid, trace["intake"])

    @staticmethod
    def trace_sent(trace: dict | None, final: bool) -> None:
        if trace is not None:
            now = time.time()
            trace.setdefault("first_sent", now)
            trace["responses"] = trace.get("responses", 0) + 1
            if final:
                trace["final_sent"] = now

    def report(self) -> dict:
        """For debug stats: the loop's times, and each timeline not reported before."""
        out = {"loop": {**self.timer.report(), **{k: round(v, 4) for k, v in self.intake.items()},
                        "cancel_poll_passes": self.cancel_poll_passes, "ipc": self.ipc.report()}}
        if self._traces is not None:
            traces = []
            while self._traces:
                traces.append(dict(self._traces.popleft()))  # a copy: senders write on
            out["trace"] = traces
        self.profile.dump()
        return out

    # -- fault injection (tests of the loop's death)
    def wants_fault(self, parameters: dict, debug_key: str) -> bool:
        return self.fault_injection and parameters.get(debug_key) == FAIL_ENGINE_LOOP

    def inject_fault(self, message: str) -> None:
        self._fault = message

    def check_fault(self) -> None:
        if self._fault is not None:
            raise RuntimeError(self._fault)


class EngineDiagnostics:
    """The engine process's: time per phase of its loop, when traced requests arrived,
    the loop's profile."""

    def __init__(self) -> None:
        self.timer = StepTimer("step", "send", "idle")
        self._arrivals: dict[str, float] | None = {} if env_int(TRACE_ENV) > 0 else None
        self.profile = ThreadProfile("engine_process")

    def arrived(self, request_id: str) -> None:
        if self._arrivals is not None:
            self._arrivals[request_id] = time.time()

    def arrivals_of(self, outputs) -> dict[str, float] | None:
        """When the requests whose first output is among ``outputs`` arrived (taken: each
        is reported once; a refused request has one output too, its final)."""
        if not self._arrivals:
            return None
        found = {o.request_id: self._arrivals.pop(o.request_id) for o in outputs
                 if o.request_id in self._arrivals}
        return found or None
