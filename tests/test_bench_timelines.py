"""bench_triton's split of the time to first token: client records (times from the run's
origin) joined with the server's request timelines (wall clock) by request id."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


@pytest.fixture(scope="module")
def bench_triton():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_triton")
    finally:
        sys.path.remove(str(BENCH))


def client(origin, sent, first, end):
    return {"origin": origin, "arrival": 0.0, "sent": sent, "first": first, "end": end}


def test_the_parts_add_up_to_the_ttft_and_follow_the_request_ids(bench_triton):
    origin = 1000.0
    reqs = [client(origin, 0.001, 0.031, 0.200), client(origin, 0.002, 0.052, 0.300)]
    traces = [  # in another order than the requests, plus one of another run
        {"id": "1", "intake": 1000.006, "received": 1000.007, "made": 1000.040,
         "routed": 1000.041, "first_sent": 1000.050, "final_sent": 1000.299, "responses": 9},
        {"id": "0", "intake": 1000.003, "received": 1000.004, "made": 1000.020,
         "routed": 1000.021, "first_sent": 1000.030, "final_sent": 1000.1995, "responses": 5},
        {"id": "7", "intake": 1.0},
    ]
    parts = bench_triton.timeline_parts(reqs, traces)
    p = {k: v["p50"] for k, v in parts["ttft_parts_ms"].items()}
    # request 0: 2, 1, 16, 1, 9, 1 ms; request 1: 4, 1, 33, 1, 9, 2 ms; p50 of two: the mean
    assert p == pytest.approx({"client_to_intake": 3.0, "to_engine": 1.0, "engine": 24.5,
                               "to_stub": 1.0, "stub_send": 9.0, "to_client": 1.5}, abs=1e-6)
    assert sum(p.values()) == pytest.approx((0.030 + 0.050) / 2 * 1e3)  # the mean TTFT
    assert all(v["n"] == 2 for v in parts["ttft_parts_ms"].values())  # request 7: no client
    assert parts["responses_per_request"]["p50"] == 7.0
    assert parts["responses_per_request"]["max"] == 9.0
    assert parts["final_to_client_ms"]["p50"] == pytest.approx(0.75)

def test_requests_without_a_complete_timeline_are_left_out(bench_triton):
    reqs = [client(0.0, 0.001, 0.01, 0.02)]
    assert bench_triton.timeline_parts(reqs, []) == {}
    unrouted = [{"id": "0", "intake": 0.002, "received": 0.003}]  # never got an output
    assert bench_triton.timeline_parts(reqs, unrouted) == {}
    assert bench_triton.timeline_parts([dict(reqs[0], first=None)], unrouted) == {}


def test_a_timeline_of_another_run_does_not_join(bench_triton):
    """With several instances a stub may report a run's timelines in a later run's stats:
    request ids carry the run, so only this run's join."""
    reqs = [client(0.0, 0.001, 0.011, 0.02)]
    stale = {"id": "b8-0-0", "intake": 0.002, "received": 0.003, "made": 0.004, "routed": 0.005,
             "first_sent": 0.006, "final_sent": 0.0199, "responses": 3}
    assert bench_triton.timeline_parts(reqs, [stale], "b8-1-") == {}
    parts = bench_triton.timeline_parts(reqs, [dict(stale, id="b8-1-0")], "b8-1-")
    assert parts["ttft_parts_ms"]["engine"]["p50"] == pytest.approx(1.0)
    assert parts["responses_per_request"]["p50"] == 3.0


def test_the_engine_loop_per_step_is_the_difference_of_two_stats(bench_triton):
    before = {"engine_loop": {"step_s": 1.0, "send_s": 0.1, "idle_s": 5.0, "steps": 100}}
    after = {"engine_loop": {"step_s": 1.4, "send_s": 0.14, "idle_s": 6.0, "steps": 300}}
    assert bench_triton.engine_loop_per_step(before, after) == {
        "steps": 200, "step_ms": 2.0, "send_ms": 0.2}
    assert bench_triton.engine_loop_per_step(after, after) == {}
    assert bench_triton.engine_loop_per_step({}, {"loop": {}}) == {}  # engine in the stub
