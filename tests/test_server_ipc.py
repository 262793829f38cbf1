"""The stub's round trips to tritonserver per request (backend/diagnostics.py IpcCounts, in
the debug stats) on a burst of streamed requests at the session's real server: one send
per response the client receives, cancellation polls within their budget per pass
however many requests are pending, one histogram observation per timing per request (the
publisher thread's, off the final response's path: tests/test_metrics.py), and no error
sends."""
from __future__ import annotations

import time

import pytest

from backend.request_watch import MAX_CANCEL_POLLS
from conftest import grpc_inputs, server_stats

pytestmark = [pytest.mark.server, pytest.mark.slow]

BURST = 32  # twice the cancellation polls' budget per pass
TOKENS = 16
HISTOGRAMS = 4  # radixlm_* timings, one observation each per finished request
CANCEL_POLL_S = 0.1  # EngineLoop's default pass interval


def ipc(stats: dict) -> dict:
    return {**stats["loop"]["ipc"], "passes": stats["loop"]["cancel_poll_passes"]}


def test_round_trips_per_request_of_a_streamed_burst(triton_server, stream):
    time.sleep(0.6)  # earlier tests' metrics published (every 0.25 s)
    before = ipc(server_stats(triton_server))
    started = time.monotonic()
    ids = [f"ipc-{i}" for i in range(BURST)]
    for i, rid in enumerate(ids):
        stream.send(rid, grpc_inputs(f"Burst request {i}: count to ten.",
                                     {"temperature": 0, "max_tokens": TOKENS,
                                      "ignore_eos": True}))
    responses = stream.collect(ids, timeout_s=300)
    elapsed = time.monotonic() - started
    received = sum(len(r) for r in responses.values())
    assert all(sum(len(p["output_ids"]) for p in r) == TOKENS for r in responses.values())
    # the histograms are published a moment after the finals: wait for the publisher
    stats_calls, deadline = 1, time.monotonic() + 10
    while True:
        after = ipc(server_stats(triton_server))
        stats_calls += 1
        done = after["metric_observes"] - before["metric_observes"] >= HISTOGRAMS * BURST
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    delta = {k: after[k] - before[k] for k in after}
    per_request = {k: round(v / BURST, 2) for k, v in delta.items()}
    print(f"\nround trips per request ({BURST} streamed requests of {TOKENS} tokens, "
          f"{elapsed:.1f} s): {per_request}")
    # every stats answer but the last is a send too (each is counted before it is sent)
    assert delta["response_sends"] == received + stats_calls - 1
    assert delta["error_sends"] == 0
    # the budget: at most MAX_CANCEL_POLLS a pass, a pass at most every CANCEL_POLL_S,
    # whatever the number pending (32 here: unbounded, every pass would ask all 32)
    assert delta["cancel_polls"] <= MAX_CANCEL_POLLS * delta["passes"]
    assert delta["passes"] <= (time.monotonic() - started) / CANCEL_POLL_S + 2
    assert delta["metric_observes"] == HISTOGRAMS * BURST
