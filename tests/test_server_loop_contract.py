"""The serving loop's side of the vLLM-style contract (backend/serving.py, routing.py)
against a scripted engine: best_of picks by cumulative logprob, a cancel_token cancels
its request, heartbeats keep a cancel-watching relay informed, the prefix cache can be
flushed, and metrics are published before a request's final response."""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from backend import wire
from backend.serving import EngineLoop
from loop_helpers import EVERY_OUTPUT, RecordingSink, ScriptedEngine, entries, generate


@pytest.fixture
def loop():
    loop = EngineLoop(ScriptedEngine(), idle_wait_s=0.005, cancel_poll_s=0.0, heartbeat_s=0.02)
    loop.start()
    yield loop
    loop.stop(timeout_s=5)


def test_best_of_returns_the_n_likeliest_samples_renumbered(loop):
    sink = RecordingSink()
    job = generate(stream=False, max_new_tokens=2, n=2, best_of=3)
    loop.submit(dataclasses.replace(job, params=dataclasses.replace(
        job.params, cumulative_logprob=True)), sink)
    assert sink.closed.wait(5)
    (out, final), = sink.responses
    # the likeliest are samples 2 (tokens 201, 202) and 1 (101, 102), in that order
    assert entries(out) == [(0, [201, 202], "length"), (1, [101, 102], "length")]
    assert out[wire.CUMULATIVE_LOGPROB].tolist() == [-2.0, -4.0]


def test_a_cancel_token_cancels_its_request(loop):
    sink, canceller = RecordingSink(), RecordingSink()
    loop.submit(generate(stream=False, max_new_tokens=100_000,
                         outputs=EVERY_OUTPUT | {wire.CANCEL_TOKEN}), sink)
    while not sink.responses:  # a heartbeat: an empty response that carries the token
        time.sleep(0.002)
    heartbeat, final = sink.responses[0]
    assert not final and heartbeat[wire.OUTPUT_IDS].tolist() == []
    assert heartbeat[wire.FINISH_REASON].tolist() == [b"None"]
    token = heartbeat[wire.CANCEL_TOKEN][0].decode()
    assert len(token) == 32
    loop.submit(wire.CancelJob("not-a-token"), RecordingSink())
    loop.submit(wire.CancelJob(token), canceller)
    assert sink.closed.wait(5) and canceller.closed.wait(5)
    assert sink.errors == [("request cancelled", True)]
    assert len(loop.engine.aborted) == 1 and loop.num_active() == 0
    (reply, final), = canceller.responses
    assert final and reply[wire.TEXT_OUTPUT].tolist() == [b""]


def test_requests_that_did_not_ask_for_a_cancel_token_get_no_heartbeats(loop):
    sink = RecordingSink()
    loop.submit(generate(stream=False, max_new_tokens=30), sink)
    assert sink.closed.wait(5)
    assert len(sink.responses) == 1


def test_debug_flush_cache_flushes_and_answers_with_the_stats(loop):
    sink = RecordingSink()
    loop.submit(wire.StatsJob(flush_cache=True), sink)
    assert sink.closed.wait(5)
    stats = json.loads(sink.responses[0][0][wire.STATS][0])
    assert stats["flushed_kv_tokens"] == 7 and "num_running" in stats


class OrderedMetrics:
    """Records whether each final response found the metrics flushed."""

    def __init__(self) -> None:
        self.flushes = 0
        self.observed = 0
        self.lock = threading.Lock()

    def observe_outputs(self, outputs, made_at=None):
        with self.lock:
            self.observed += sum(o.finished for o in outputs)

    def observe_request(self, n):
        pass

    def sample(self, engine, force=False):
        pass

    def before_final(self):
        with self.lock:
            self.flushes += 1
            self.published = self.observed


class FinalChecker(RecordingSink):
    def __init__(self, metrics) -> None:
        super().__init__()
        self.metrics = metrics
        self.published_at_final = None

    def send(self, outputs, final):
        if final:
            self.published_at_final = self.metrics.published
        super().send(outputs, final)


@pytest.mark.parametrize("stream", [True, False])
def test_metrics_are_published_before_the_final_response_is_sent(stream):
    metrics = OrderedMetrics()
    loop = EngineLoop(ScriptedEngine(), idle_wait_s=0.005, cancel_poll_s=0.0, metrics=metrics)
    loop.start()
    try:
        sink = FinalChecker(metrics)
        loop.submit(generate(stream=stream, max_new_tokens=3), sink)
        assert sink.closed.wait(5)
        assert sink.published_at_final == 1  # the request itself was counted and sent
    finally:
        loop.stop(timeout_s=5)
