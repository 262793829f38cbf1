"""backend/metrics.py with a fake metrics API: what each engine output and each stats
sample turns into, series by series. The real endpoint is checked in
test_metrics_server.py."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from backend import metric_types
from backend import metrics as m

LABELS = {"model": "llm", "model_instance": "llm_0_0"}


class FakeFactory:
    """Series by (name, sorted labels); native histograms unless told otherwise."""

    def __init__(self, histograms: bool = True) -> None:
        self.histograms = histograms
        self.values: dict[tuple, float] = {}
        self.observations: dict[tuple, list[float]] = {}
        self.calls = 0  # updates sent (each is an IPC round trip with Triton)

    def _series(self, name, labels, initial=0.0):
        key = (name, tuple(sorted(labels.items())))
        assert key not in self.values and key not in self.observations, f"created twice: {key}"
        self.values[key] = initial
        return key

    def counter(self, name, description, labels):
        assert description
        return _Series(self, self._series(name, labels))

    def gauge(self, name, description, labels):
        return _Series(self, self._series(name, labels))

    def histogram(self, name, description, labels, buckets):
        if not self.histograms:
            raise NotImplementedError
        assert list(buckets) == sorted(buckets)
        key = (name, tuple(sorted(labels.items())))
        self.observations[key] = []
        return SimpleNamespace(observe=lambda v: self._observe(key, v))

    def _observe(self, key, value):
        self.calls += 1
        self.observations[key].append(value)

    def value(self, name, **extra):
        return self.values[(name, tuple(sorted({**LABELS, **extra}.items())))]

    def observed(self, name):
        return self.observations[(name, tuple(sorted(LABELS.items())))]


class _Series:
    def __init__(self, factory, key):
        self.factory, self.key = factory, key

    def increment(self, value):
        assert value >= 0, "counters only go up"
        self.factory.calls += 1
        self.factory.values[self.key] += value

    def set(self, value):
        self.factory.calls += 1
        self.factory.values[self.key] = value


def output(prompt=10, cached=0, generated=5, reason="length", finished=True, error=None,
           timings=None):
    return SimpleNamespace(num_prompt_tokens=prompt, num_cached_tokens=cached,
                           num_output_tokens=generated, finish_reason=reason if finished else None,
                           finished=finished, error=error, timings=timings)


class FakeEngine:
    def __init__(self, **stats):
        self.stats_calls = 0
        self._stats = {"num_running": 0, "num_waiting": 0, "kv_tokens_total": 1000,
                       "kv_tokens_in_use_by_requests": 0, "radix_cache_tokens": 0, **stats}

    def stats(self):
        self.stats_calls += 1
        return dict(self._stats)


def metrics_with(factory, **kwargs) -> m.EngineMetrics:
    """The radixlm_* series alone (the vllm:* ones are tested at the end of this file)."""
    return m.EngineMetrics(factory, "llm", "llm_0_0", **{"vllm_series": False, **kwargs})


def test_every_series_exists_from_the_start_with_zero():
    factory = FakeFactory()
    metrics_with(factory)
    for name in (m.PROMPT_TOKENS, m.GENERATION_TOKENS, m.CACHED_PROMPT_TOKENS,
                 m.NUM_RUNNING, m.NUM_WAITING, m.KV_CACHE_USAGE, m.RADIX_CACHE_TOKENS):
        assert factory.value(name) == 0
    for reason in ("stop", "length", "abort", "error"):
        assert factory.value(m.REQUESTS, finish_reason=reason) == 0
    assert set(factory.observations) == {
        (name, tuple(sorted(LABELS.items()))) for name in
        (m.TIME_TO_FIRST_TOKEN, m.TIME_PER_OUTPUT_TOKEN, m.E2E_LATENCY, m.QUEUE_TIME)}
    assert factory.calls == 0


def test_finished_outputs_add_their_tokens_and_count_by_finish_reason():
    factory = FakeFactory()
    metrics = metrics_with(factory)
    metrics.observe_outputs([output(prompt=7, cached=0, generated=3, reason="length"),
                             output(prompt=9, cached=6, generated=1, reason="stop"),
                             output(prompt=100, generated=99, finished=False)])
    metrics.observe_outputs([output(prompt=4, cached=2, generated=0, reason="abort"),
                             output(prompt=5, generated=2, reason="abort", error="grammar")])
    assert factory.value(m.PROMPT_TOKENS) == 0  # nothing is sent before a flush
    metrics.flush()
    assert factory.value(m.PROMPT_TOKENS) == 7 + 9 + 4 + 5
    assert factory.value(m.CACHED_PROMPT_TOKENS) == 6 + 2
    assert factory.value(m.GENERATION_TOKENS) == 3 + 1 + 0 + 2
    assert [factory.value(m.REQUESTS, finish_reason=r) for r in ("stop", "length", "abort", "error")] \
        == [1, 1, 1, 1]
    # one increment per series per flush, however many requests finished
    assert factory.calls == 3 + 4
    metrics.flush()
    assert factory.value(m.PROMPT_TOKENS) == 25 and factory.calls == 7


def test_an_unknown_finish_reason_gets_its_own_series():
    factory = FakeFactory()
    metrics = metrics_with(factory)
    metrics.observe_outputs([output(reason="timeout")])
    metrics.flush()
    assert factory.value(m.REQUESTS, finish_reason="timeout") == 1


def test_timings_become_histogram_observations_of_successful_requests():
    factory = FakeFactory()
    metrics = metrics_with(factory)
    metrics.observe_outputs([
        output(timings={"queue_time": 0.01, "time_to_first_token": 0.2, "e2e_latency": 1.5,
                        "time_per_output_token": 0.05}),
        output(generated=1, timings={"queue_time": 0.02, "time_to_first_token": 0.3,
                                     "e2e_latency": 0.3}),  # one token: no gap to measure
        output(error="boom", timings={"e2e_latency": 9.0}),
    ])
    metrics.flush()
    assert factory.observed(m.QUEUE_TIME) == [0.01, 0.02]
    assert factory.observed(m.TIME_TO_FIRST_TOKEN) == [0.2, 0.3]
    assert factory.observed(m.E2E_LATENCY) == [1.5, 0.3]
    assert factory.observed(m.TIME_PER_OUTPUT_TOKEN) == [0.05]


def test_a_final_response_waits_for_the_counts_only_not_the_histograms_or_gauges():
    """Before a final response (on a sender thread): the counts that make its request
    show up; the four observations per request and the gauges are the publisher's."""
    factory = FakeFactory()
    metrics = metrics_with(factory)
    metrics.sample(FakeEngine(num_running=3))
    metrics.observe_outputs([output(prompt=7, generated=3, reason="length",
                                    timings={"queue_time": 0.01, "e2e_latency": 1.5}),
                             output(prompt=5, generated=2, reason="stop",
                                    timings={"time_to_first_token": 0.2})])
    metrics.before_final()
    assert factory.value(m.PROMPT_TOKENS) == 12 and factory.value(m.GENERATION_TOKENS) == 5
    assert factory.value(m.REQUESTS, finish_reason="length") == 1
    assert factory.value(m.REQUESTS, finish_reason="stop") == 1
    assert factory.calls == 2 + 2  # two token counters, two finish reasons
    assert factory.observed(m.E2E_LATENCY) == [] and factory.value(m.NUM_RUNNING) == 0
    metrics.before_final()  # nothing new: no round trip
    assert factory.calls == 4
    metrics.flush()  # the publisher: the rest, the counts not again
    assert factory.observed(m.QUEUE_TIME) == [0.01] and factory.observed(m.E2E_LATENCY) == [1.5]
    assert factory.observed(m.TIME_TO_FIRST_TOKEN) == [0.2]
    assert factory.value(m.NUM_RUNNING) == 3 and factory.value(m.PROMPT_TOKENS) == 12


def test_without_native_histograms_they_are_cumulative_bucket_counters():
    factory = FakeFactory(histograms=False)
    metrics = metrics_with(factory)
    bounds = m._HISTOGRAMS["time_to_first_token"][2]
    for ttft in (0.003, 0.2, 0.2, 100.0):
        metrics.observe_outputs([output(timings={"time_to_first_token": ttft})])
    metrics.flush()
    name = m.TIME_TO_FIRST_TOKEN
    assert factory.value(f"{name}_count") == 4
    assert factory.value(f"{name}_sum") == pytest.approx(100.403)
    assert factory.value(f"{name}_bucket", le="0.005") == 1
    assert factory.value(f"{name}_bucket", le="0.15") == 1
    assert factory.value(f"{name}_bucket", le="0.25") == 3
    assert factory.value(f"{name}_bucket", le="80") == 3
    assert factory.value(f"{name}_bucket", le="+Inf") == 4
    les = [dict(labels)["le"] for (n, labels) in factory.values if n == f"{name}_bucket"]
    assert les == [metric_types._format_le(b) for b in bounds] + ["+Inf"]


def test_gauges_come_from_engine_stats_and_are_sent_only_when_they_change():
    factory = FakeFactory()
    metrics = metrics_with(factory, sample_interval_s=0.0)
    engine = FakeEngine(num_running=3, num_waiting=2, kv_tokens_total=1000,
                        kv_tokens_in_use_by_requests=250, kv_tokens_used=900,
                        radix_cache_tokens=640)
    metrics.sample(engine)
    metrics.flush()
    assert factory.value(m.NUM_RUNNING) == 3 and factory.value(m.NUM_WAITING) == 2
    # requests' share of the pool, not the evictable prefix cache (kv_tokens_used)
    assert factory.value(m.KV_CACHE_USAGE) == 0.25
    assert factory.value(m.RADIX_CACHE_TOKENS) == 640
    assert factory.calls == 4
    engine._stats["num_waiting"] = 0
    metrics.sample(engine)
    metrics.flush()
    assert factory.value(m.NUM_WAITING) == 0 and factory.calls == 5


def test_an_instance_without_gauges_counts_but_never_asks_the_engine():
    """A second instance in front of a shared engine: its counters count what it served,
    the engine-wide gauges come from the instance that started the engine."""
    factory = FakeFactory()
    metrics = metrics_with(factory, sample_interval_s=0.0, gauges=False)
    engine = FakeEngine(num_running=3)
    metrics.sample(engine, force=True)
    metrics.observe_outputs([output(prompt=7, generated=2, reason="stop")])
    metrics.flush()
    assert engine.stats_calls == 0
    assert not [key for key in factory.values if key[0] in m._GAUGES]
    assert factory.value(m.PROMPT_TOKENS) == 7 and factory.value(m.GENERATION_TOKENS) == 2


def test_stats_are_sampled_at_most_once_per_interval():
    factory = FakeFactory()
    metrics = metrics_with(factory, sample_interval_s=60.0)
    engine = FakeEngine()
    for _ in range(100):
        metrics.sample(engine)
    assert engine.stats_calls == 1
    metrics.sample(engine, force=True)
    assert engine.stats_calls == 2


def test_an_empty_pool_reads_as_zero_usage():
    assert m.gauge_values({"kv_tokens_total": 0, "kv_tokens_in_use_by_requests": 0})[
        m.KV_CACHE_USAGE] == 0.0


def test_the_publisher_thread_sends_periodically_and_on_close():
    factory = FakeFactory()
    metrics = metrics_with(factory, sample_interval_s=0.0, publish_interval_s=0.02)
    metrics.start()
    metrics.observe_outputs([output(prompt=11, generated=4, reason="stop")])
    deadline = time.monotonic() + 5
    while factory.value(m.PROMPT_TOKENS) != 11 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert factory.value(m.PROMPT_TOKENS) == 11
    metrics.observe_outputs([output(prompt=2, generated=1, reason="stop")])
    metrics.sample(FakeEngine(num_running=1))
    metrics.close()
    assert not metrics._thread.is_alive()
    assert factory.value(m.PROMPT_TOKENS) == 13
    assert factory.value(m.REQUESTS, finish_reason="stop") == 2
    assert factory.value(m.NUM_RUNNING) == 1


def test_a_failing_metrics_api_does_not_stop_the_publisher():
    factory = FakeFactory()
    metrics = metrics_with(factory, publish_interval_s=0.01)
    broken = metrics._counters[m.PROMPT_TOKENS]
    broken.increment = lambda value: (_ for _ in ()).throw(RuntimeError("IPC failed"))
    metrics.start()
    metrics.observe_outputs([output(prompt=3)])
    time.sleep(0.1)
    metrics.observe_outputs([output(generated=8)])
    metrics.close()
    assert factory.value(m.GENERATION_TOKENS) == 5 + 8  # every other series still counts
    assert factory.value(m.REQUESTS, finish_reason="length") == 2


def test_host_tier_series_follow_the_engine_totals_as_increments():
    factory = FakeFactory()
    metrics = metrics_with(factory, sample_interval_s=0.0)
    engine = FakeEngine(cache_hit_tokens=100, cache_hit_tokens_host=30, kv_bytes_to_host=4096,
                        kv_bytes_to_device=2048, host_loads=2, host_load_seconds=0.5,
                        host_cache_tokens=77)
    metrics.sample(engine)
    metrics.flush()
    assert factory.value(m.CACHED_BY_TIER, tier="device") == 70
    assert factory.value(m.CACHED_BY_TIER, tier="host") == 30
    assert factory.value(m.KV_TRANSFER_BYTES, direction="to_host") == 4096
    assert factory.value(m.KV_TRANSFER_BYTES, direction="to_device") == 2048
    assert factory.value(m.HOST_LOADS) == 2 and factory.value(m.HOST_LOAD_SECONDS) == 0.5
    assert factory.value(m.HOST_CACHE_TOKENS) == 77
    engine._stats.update(cache_hit_tokens=110, cache_hit_tokens_host=35, host_loads=3)
    metrics.sample(engine)
    metrics.flush()  # the counters add what the totals grew by
    assert factory.value(m.CACHED_BY_TIER, tier="device") == 75
    assert factory.value(m.CACHED_BY_TIER, tier="host") == 35
    assert factory.value(m.HOST_LOADS) == 3
