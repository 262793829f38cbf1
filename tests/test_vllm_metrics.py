"""backend/vllm_metrics.py through EngineMetrics with a fake metrics API: the vLLM
backend's ``vllm:*`` series, their names, buckets and per-token timing."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from backend import metrics as m
from backend import vllm_metrics as v
from test_metrics import FakeEngine, FakeFactory

VLLM_LABELS = {"model": "llm", "version": "1", "model_instance": "llm_0_0"}


def vllm_value(factory, name, **extra):
    return factory.values[(name, tuple(sorted({**VLLM_LABELS, **extra}.items())))]


def vllm_observed(factory, name):
    return factory.observations[(name, tuple(sorted(VLLM_LABELS.items())))]


def step(rid, index=0, tokens=1, prompt=6, finished=False, reason=None, timings=None,
         generated=0):
    return SimpleNamespace(request_id=rid, index=index, new_token_ids=[7] * tokens,
                           num_prompt_tokens=prompt, num_cached_tokens=0,
                           num_output_tokens=generated, finished=finished,
                           finish_reason=reason, error=None, choice_scores=None,
                           timings=timings)


def test_vllm_series_count_tokens_as_produced_and_time_every_token():
    factory = FakeFactory()
    metrics = m.EngineMetrics(factory, "llm", "llm_0_0", max_model_len=100)
    metrics.observe_request(1)
    metrics.observe_outputs([step("a", timings={"time_to_first_token": 0.5})], made_at=10.0)
    metrics.observe_outputs([step("a")], made_at=10.2)
    metrics.observe_outputs([step("a", tokens=2)], made_at=10.6)  # two tokens in one step
    metrics.flush()

    assert vllm_value(factory, v.PROMPT_TOKENS) == 6  # once, at the first output
    assert vllm_value(factory, v.GENERATION_TOKENS) == 4
    assert vllm_observed(factory, v.TIME_TO_FIRST_TOKEN) == [0.5]
    assert vllm_observed(factory, v.TIME_PER_OUTPUT_TOKEN) == pytest.approx([0.2, 0.2, 0.2])
    metrics.observe_outputs([step("a", finished=True, reason="length", generated=5,
                                  timings={"e2e_latency": 1.5, "queue_time": 0.1})],
                            made_at=11.0)
    metrics.flush()
    assert vllm_value(factory, v.REQUEST_SUCCESS, finished_reason="length") == 1
    assert vllm_observed(factory, v.E2E_LATENCY) == [1.5]
    assert vllm_observed(factory, v.QUEUE_TIME) == [0.1]
    assert vllm_observed(factory, v.REQUEST_PROMPT_TOKENS) == [6]
    assert vllm_observed(factory, v.REQUEST_GENERATION_TOKENS) == [5]
    assert vllm_observed(factory, v.REQUEST_PARAMS_N) == [1]
    assert len(vllm_observed(factory, v.TIME_PER_OUTPUT_TOKEN)) == 4  # 5 tokens, 4 gaps


def test_vllm_series_keep_the_vllm_backends_names_buckets_and_gauges():

    factory = FakeFactory()
    metrics = m.EngineMetrics(factory, "llm", "llm_0_0", max_model_len=2048,
                              sample_interval_s=0.0)
    names = {name for name, _ in factory.values} | {name for name, _ in factory.observations}
    assert {"vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:request_success_total", "vllm:num_requests_running",
            "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
            "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
            "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens", "vllm:request_params_n"} <= names
    assert v.buckets_1_2_5(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    metrics.sample(FakeEngine(num_running=2, num_waiting=1, kv_tokens_total=100,
                              kv_tokens_in_use_by_requests=25))
    metrics.flush()
    assert vllm_value(factory, v.NUM_RUNNING) == 2 and vllm_value(factory, v.NUM_WAITING) == 1
    assert vllm_value(factory, v.GPU_CACHE_USAGE) == vllm_value(factory, v.KV_CACHE_USAGE) == 0.25


def test_report_custom_metrics_false_leaves_the_vllm_series_out():
    factory = FakeFactory()
    m.EngineMetrics(factory, "llm", "llm_0_0", vllm_series=False)
    assert not [name for name, _ in [*factory.values, *factory.observations]
                if name.startswith("vllm:")]
