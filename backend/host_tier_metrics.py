"""The two-tier cache's series (docs/metrics.md): what the host-memory tier of the radix
cache holds and moves, from the engine's running totals."""
from __future__ import annotations

import threading
from typing import Any, Mapping

from backend.metric_types import MetricFactory, send_update

CACHED_BY_TIER = "radixlm_cached_prompt_tokens_by_tier_total"
KV_TRANSFER_BYTES = "radixlm_kv_transfer_bytes_total"
HOST_LOADS = "radixlm_host_cache_loads_total"
HOST_LOAD_SECONDS = "radixlm_host_cache_load_seconds_total"
HOST_CACHE_TOKENS = "radixlm_host_cache_tokens"


class HostTierMetrics:
    """The two-tier cache's series (docs/metrics.md), from the engine's running totals in
    ``Engine.stats()``: what each sample added since the last is sent as increments."""

    # series name, labels -> the stats total it follows
    _TOTALS = {
        (CACHED_BY_TIER, ("tier", "device")): None,  # cache_hit_tokens - cache_hit_tokens_host
        (CACHED_BY_TIER, ("tier", "host")): "cache_hit_tokens_host",
        (KV_TRANSFER_BYTES, ("direction", "to_host")): "kv_bytes_to_host",
        (KV_TRANSFER_BYTES, ("direction", "to_device")): "kv_bytes_to_device",
        (HOST_LOADS, None): "host_loads",
        (HOST_LOAD_SECONDS, None): "host_load_seconds",
    }
    _TEXT = {
        CACHED_BY_TIER: "Prompt tokens of finished requests served from each cache tier.",
        KV_TRANSFER_BYTES: "KV bytes copied between the device and the host tier.",
        HOST_LOADS: "Loads of cached KV from the host tier back to the device.",
        HOST_LOAD_SECONDS: "Device time spent loading KV from the host tier, seconds.",
    }

    def __init__(self, factory: MetricFactory, labels: Mapping[str, str]) -> None:
        self._counters = {key: factory.counter(key[0], self._TEXT[key[0]],
                                               {**labels, **dict([key[1]] if key[1] else [])})
                          for key in self._TOTALS}
        self._gauge = factory.gauge(HOST_CACHE_TOKENS, "Tokens held by the host-memory tier "
                                    "of the radix cache.", dict(labels))
        self._lock = threading.Lock()
        self._last: dict[tuple, float] = {key: 0.0 for key in self._TOTALS}
        self._pending: dict[tuple, float] = {}
        self._tokens: float | None = None
        self._sent_tokens = 0.0  # a new gauge reads 0

    def observe(self, stats: Mapping[str, Any]) -> None:
        """Called on the engine loop thread with a stats sample."""
        totals = {key: float(stats.get(field, 0) if field else
                             stats.get("cache_hit_tokens", 0) - stats.get("cache_hit_tokens_host", 0))
                  for key, field in self._TOTALS.items()}
        with self._lock:
            for key, total in totals.items():
                if total > self._last[key]:
                    self._pending[key] = self._pending.get(key, 0.0) + total - self._last[key]
                    self._last[key] = total
            self._tokens = float(stats.get("host_cache_tokens", 0))

    def flush(self) -> None:
        """Called on the publisher thread."""
        with self._lock:
            pending, self._pending = self._pending, {}
            tokens, self._tokens = self._tokens, None
        for key, value in pending.items():
            send_update(self._counters[key].increment, value)
        if tokens is not None and tokens != self._sent_tokens and send_update(self._gauge.set, tokens):
            self._sent_tokens = tokens
