"""How fast the serving layer routes streamed tokens, without Triton or a GPU.

    python benchmarks/bench_serving_loop.py [--batch 32 128] [--step-ms 0 1.3 2.3] [--tokens 128]

``backend.serving.EngineLoop`` (routing, the outbox, the sender threads) in front of a
stand-in engine that, like the engine process, steps on its own clock: every ``--step-ms``
each request gets one token, and a step call returns all the steps finished since the
last one. Each request is a streamed output_ids-only job with a sink that only counts
(a Triton send costs far more: this is the serving layer's floor). Prints, per (batch, step time): the
wall time against the stand-in's own (steps x step time), the routing time per step,
the responses sent (fewer than tokens when queued tokens were merged) and the
cancellation polls per request (``--poll-ms``: each waits that long without the GIL, as
``is_cancelled``'s round trip to the server does). A ratio under 1
is what the serving layer alone costs the Triton rows: on the H200, 1B rows at batch 128
step in ~2.3 ms. The GIL switch interval is the stub's (``RADIXLM_SWITCH_INTERVAL_S``).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend import wire  # noqa: E402
from backend.core.handle import OutputBatch  # noqa: E402
from backend.core.outputs import StepOutput  # noqa: E402
from backend.serving import EngineLoop  # noqa: E402


class StandInEngine:
    """An ``EngineHandle`` that steps on its own clock, like the engine process: one
    token per request every ``step_s``; ``next_outputs`` returns every step finished
    since the last call (waiting for the next one when there is none), as
    ``EngineProcess.next_outputs`` returns all queued step messages."""

    def __init__(self, step_s: float, tokens: int) -> None:
        self.step_s, self.tokens = step_s, tokens
        self.lock = threading.Lock()
        self.made: dict[str, int] = {}
        self.t0: float | None = None
        self.steps_done = 0

    def submit(self, request):
        with self.lock:
            self.made[request.request_id] = 0
            if self.t0 is None:
                self.t0 = time.perf_counter()

    def abort(self, request_id):
        with self.lock:
            self.made.pop(request_id, None)

    def next_outputs(self, timeout_s):
        if not self.made:
            time.sleep(min(timeout_s, 0.001))
            return OutputBatch()
        return OutputBatch(self._step(), time.time())

    def prompt_text(self, token_ids):
        return ""

    def close(self, timeout_s=10.0):
        pass

    def _step(self):
        due = self.steps_done + 1
        if self.step_s:
            now = time.perf_counter() - self.t0
            if now < due * self.step_s:
                time.sleep(due * self.step_s - now)
            due = max(due, int((time.perf_counter() - self.t0) / self.step_s))
        outs = []
        with self.lock:
            for _ in range(due - self.steps_done):
                for rid, made in list(self.made.items()):
                    made += 1
                    done = made >= self.tokens
                    outs.append(StepOutput(request_id=rid, new_token_ids=[made], finished=done,
                                           finish_reason="length" if done else None,
                                           num_prompt_tokens=32, num_output_tokens=made,
                                           context_token_ids=[made - 1]))
                    if done:
                        del self.made[rid]
                    else:
                        self.made[rid] = made
        self.steps_done = due
        return outs

    def stats(self):
        return {}

    def check_integrity(self):
        pass


class CountingSink:
    """Counts; with ``send_s`` each send also waits that long without the GIL (as a
    Triton send waits for the server process), with ``cpu_s`` it first spins that long
    holding the GIL (as building the pb_utils tensors and response does), and notes
    when the first one returned."""
    wanted = frozenset({wire.OUTPUT_IDS})

    def __init__(self, send_s: float = 0.0, cpu_s: float = 0.0, poll_s: float = 0.0) -> None:
        self.send_s, self.cpu_s, self.poll_s = send_s, cpu_s, poll_s
        self.polls = 0
        self.responses = 0
        self.tokens = 0
        self.first_sent: float | None = None
        self.done = threading.Event()

    def send(self, outputs, final):
        if self.cpu_s:
            end = time.perf_counter() + self.cpu_s
            while time.perf_counter() < end:
                pass
        if self.send_s:
            time.sleep(self.send_s)
        if self.first_sent is None:
            self.first_sent = time.perf_counter()
        self.responses += 1
        self.tokens += len(outputs[wire.OUTPUT_IDS])
        if final:
            self.done.set()

    def send_error(self, message, cancelled=False):
        self.done.set()

    def is_cancelled(self):
        self.polls += 1
        if self.poll_s:
            time.sleep(self.poll_s)
        return False


def run(batch: int, step_s: float, tokens: int, senders: int, send_s: float = 0.0,
        cpu_s: float = 0.0, poll_s: float = 0.0) -> dict:
    engine = StandInEngine(step_s, tokens)
    loop = EngineLoop(engine, idle_wait_s=0.005, cancel_poll_s=0.1, sender_threads=senders)
    loop.start()
    job = wire.parse_request({wire.INPUT_IDS: np.arange(32, dtype=np.int64),
                              wire.STREAM: np.array([True]),
                              wire.SAMPLING_PARAMETERS: np.array(
                                  [f'{{"max_tokens": {tokens}}}'.encode()], dtype=object)}, {},
                             requested=CountingSink.wanted)
    sinks = [CountingSink(send_s, cpu_s, poll_s) for _ in range(batch)]
    t0 = time.perf_counter()
    for sink in sinks:
        loop.submit(job, sink)
    for sink in sinks:
        if not sink.done.wait(120):
            raise RuntimeError("a request did not finish")
    wall = time.perf_counter() - t0
    timings = loop.diagnostics.timer.report()
    steps = max(1, int(timings["steps"]))
    loop.stop(5)
    assert sum(s.tokens for s in sinks) == batch * tokens
    first = sorted(s.first_sent - t0 for s in sinks)
    return {"batch": batch, "step_ms": step_s * 1e3, "wall_ms": wall * 1e3,
            "first_sent_ms_p50": first[len(first) // 2] * 1e3,
            "stand_in_ms": tokens * step_s * 1e3, "route_ms_per_call": timings["route_s"] / steps * 1e3,
            "responses": sum(s.responses for s in sinks), "tokens": batch * tokens,
            "cancel_polls": sum(s.polls for s in sinks)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 1.3, 2.3])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--senders", type=int, default=int(os.environ.get("RADIXLM_SENDER_THREADS", "2")))
    ap.add_argument("--send-ms", type=float, default=0.0,
                    help="each send waits this long without the GIL (a Triton send: ~0.5 ms)")
    ap.add_argument("--send-cpu-us", type=float, default=0.0,
                    help="each send first holds the GIL this long (building the response)")
    ap.add_argument("--poll-ms", type=float, default=0.0,
                    help="each cancellation poll waits this long without the GIL (~0.05 ms)")
    args = ap.parse_args()
    sys.setswitchinterval(float(os.environ.get("RADIXLM_SWITCH_INTERVAL_S", "0.0005")))
    print(f"{'batch':>5} {'step ms':>7} {'wall ms':>8} {'stand-in ms':>11} {'ratio':>6} "
          f"{'route ms/call':>13} {'first sent ms':>13} {'responses':>9} {'tokens':>7} "
          f"{'polls/req':>9}")
    for b in args.batch:
        for ms in args.step_ms:
            r = run(b, ms / 1e3, args.tokens, args.senders, args.send_ms / 1e3,
                    args.send_cpu_us / 1e6, args.poll_ms / 1e3)
            ratio = r["stand_in_ms"] / r["wall_ms"] if r["stand_in_ms"] else float("nan")
            print(f"{b:>5} {ms:>7.2f} {r['wall_ms']:>8.1f} {r['stand_in_ms']:>11.1f} {ratio:>6.2f} "
                  f"{r['route_ms_per_call']:>13.3f} {r['first_sent_ms_p50']:>13.1f} "
                  f"{r['responses']:>9} {r['tokens']:>7} {r['cancel_polls'] / b:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
