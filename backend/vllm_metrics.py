"""The ``vllm:*`` series of Triton's vLLM backend (names, buckets and meaning as it
reports them), for dashboards and autoscalers built for that backend; docs/metrics.md
lists them next to our ``radixlm_*`` ones.

What differs from ``radixlm_*``: tokens count as they are produced (prompt tokens at a
sample's first output, generated tokens every step), the time per output token is
observed once per token (the gap between a sample's responses, split over the tokens
they brought), and a request's ``n`` is observed once per request. ``VllmSeries.record``
runs on the engine loop thread and only appends; ``publish`` sends (metrics.py calls it
before every final response, and from its publisher thread).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from backend.metric_types import native_or_counter_histogram

PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
NUM_RUNNING = "vllm:num_requests_running"
NUM_WAITING = "vllm:num_requests_waiting"
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"  # the vLLM backend's name
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # vLLM's own name since its v1 engine
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = "vllm:time_per_output_token_seconds"
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
REQUEST_PARAMS_N = "vllm:request_params_n"

FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's label values (finished_reason)

_COUNTERS = {PROMPT_TOKENS: "Number of prefill tokens processed.",
             GENERATION_TOKENS: "Number of generation tokens processed."}
_GAUGES = {NUM_RUNNING: "Number of requests currently running.",
           NUM_WAITING: "Number of requests waiting to be processed.",
           GPU_CACHE_USAGE: "KV-cache usage. 1 means 100 percent usage.",
           KV_CACHE_USAGE: "KV-cache usage. 1 means 100 percent usage."}
_LATENCY = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_QUEUE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
          120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_HISTOGRAMS = {
    TIME_TO_FIRST_TOKEN: ("Histogram of time to first token in seconds.",
                          (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                           1.0, 2.5, 5.0, 7.5, 10.0)),
    TIME_PER_OUTPUT_TOKEN: ("Histogram of time per output token in seconds.",
                            (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                             1.0, 2.5)),
    E2E_LATENCY: ("Histogram of end to end request latency in seconds.", _LATENCY),
    QUEUE_TIME: ("Histogram of time spent in WAITING phase for request.", _QUEUE),
    REQUEST_PARAMS_N: ("Histogram of the n request parameter.", (1, 2, 5, 10, 20)),
}
_TOKEN_HISTOGRAMS = {REQUEST_PROMPT_TOKENS: "Number of prefill tokens processed.",
                     REQUEST_GENERATION_TOKENS: "Number of generation tokens processed."}


def buckets_1_2_5(largest: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``largest`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > largest:
                return out
            out.append(value)
        scale *= 10


@dataclass
class _Pending:
    """What ``record`` noted since the last ``publish``."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    successes: dict[str, int] = field(default_factory=dict)
    observations: list[tuple[str, float]] = field(default_factory=list)


class VllmSeries:
    def __init__(self, factory, labels: dict[str, str], max_model_len: int,
                 gauges: bool = True) -> None:
        self._counters = {name: factory.counter(name, text, dict(labels))
                          for name, text in _COUNTERS.items()}
        self._success = {r: factory.counter(REQUEST_SUCCESS, "Count of successfully "
                                            "processed requests.",
                                            {**labels, "finished_reason": r})
                         for r in FINISHED_REASONS}
        self._gauges = {name: factory.gauge(name, text, dict(labels))
                        for name, text in _GAUGES.items()} if gauges else {}
        specs = {**_HISTOGRAMS, **{name: (text, buckets_1_2_5(max_model_len))
                                   for name, text in _TOKEN_HISTOGRAMS.items()}}
        self._histograms = {name: native_or_counter_histogram(factory, name, text,
                                                              dict(labels), buckets)
                            for name, (text, buckets) in specs.items()}
        self._last_output: dict[tuple[str, int], float] = {}  # sample -> made_at
        self._pending = _Pending()

    # -- the engine loop thread (callers hold metrics.py's lock)
    def record(self, outputs: Iterable[Any], made_at: float) -> None:
        pending, last = self._pending, self._last_output
        for out in outputs:
            if out.error or out.choice_scores is not None:
                continue
            key = (out.request_id, out.index)
            new = len(out.new_token_ids)
            pending.generation_tokens += new
            seen = last.get(key)
            if seen is None:  # the sample's first output
                pending.prompt_tokens += out.num_prompt_tokens
                ttft = (out.timings or {}).get("time_to_first_token")
                if ttft is not None:
                    pending.observations.append((TIME_TO_FIRST_TOKEN, ttft))
            elif new:
                gap = max(made_at - seen, 0.0) / new
                pending.observations += [(TIME_PER_OUTPUT_TOKEN, gap)] * new
            if out.finished:
                last.pop(key, None)
                self._record_finished(out)
            else:
                last[key] = made_at

    def _record_finished(self, out) -> None:
        pending = self._pending
        reason = out.finish_reason or "abort"
        pending.successes[reason] = pending.successes.get(reason, 0) + 1
        timings = out.timings or {}
        pending.observations += [
            (E2E_LATENCY, timings.get("e2e_latency")), (QUEUE_TIME, timings.get("queue_time")),
            (REQUEST_PROMPT_TOKENS, out.num_prompt_tokens),
            (REQUEST_GENERATION_TOKENS, out.num_output_tokens)]

    def record_request(self, n: int) -> None:
        self._pending.observations.append((REQUEST_PARAMS_N, n))

    def take(self) -> _Pending:
        pending, self._pending = self._pending, _Pending()
        return pending

    # -- publishing
    def publish(self, pending: _Pending, send) -> None:
        """Send ``pending`` (from ``take``) through ``send(update, value)``."""
        if pending.prompt_tokens:
            send(self._counters[PROMPT_TOKENS].increment, pending.prompt_tokens)
        if pending.generation_tokens:
            send(self._counters[GENERATION_TOKENS].increment, pending.generation_tokens)
        for reason, count in pending.successes.items():
            if reason in self._success:
                send(self._success[reason].increment, count)
        for name, value in pending.observations:
            if value is not None:
                send(self._histograms[name].observe, value)

    def publish_gauges(self, gauge_values: Mapping[str, float], send) -> dict:
        """Send the changed gauges; returns those sent."""
        return {name: value for name, value in gauge_values.items()
                if name in self._gauges and send(self._gauges[name].set, value)}


def gauge_values(stats: Mapping[str, Any]) -> dict[str, float]:
    total = stats.get("kv_tokens_total") or 0
    usage = stats.get("kv_tokens_in_use_by_requests", 0) / total if total else 0.0
    return {NUM_RUNNING: float(stats.get("num_running", 0)),
            NUM_WAITING: float(stats.get("num_waiting", 0)),
            GPU_CACHE_USAGE: usage, KV_CACHE_USAGE: usage}
