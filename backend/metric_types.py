"""What a metrics API must provide (Triton's custom metrics through ``model.py``, a fake
in tests), and histograms written as counters for an API without native ones."""
from __future__ import annotations

import logging
from typing import Protocol, Sequence

log = logging.getLogger("radixlm.metrics")


class Counter(Protocol):
    def increment(self, value: float) -> None: ...


class Gauge(Protocol):
    def set(self, value: float) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float) -> None: ...


class MetricFactory(Protocol):
    """Creates one labelled series; ``histogram`` may raise NotImplementedError (then
    histograms are built from counters, see ``CounterHistogram``)."""

    def counter(self, name: str, description: str, labels: dict[str, str]) -> Counter: ...
    def gauge(self, name: str, description: str, labels: dict[str, str]) -> Gauge: ...
    def histogram(self, name: str, description: str, labels: dict[str, str],
                  buckets: Sequence[float]) -> Histogram: ...


class CounterHistogram:
    """A Prometheus histogram written as counters, for a metrics API without histograms:
    ``<name>_bucket{le="..."}`` (cumulative, ``le="+Inf"`` last), ``<name>_sum``,
    ``<name>_count``: the same series names and values a native histogram exposes."""

    def __init__(self, factory: MetricFactory, name: str, description: str,
                 labels: dict[str, str], buckets: Sequence[float]) -> None:
        self._bounds = list(buckets)
        les = [_format_le(b) for b in self._bounds] + ["+Inf"]
        self._buckets = [factory.counter(f"{name}_bucket", description, {**labels, "le": le})
                         for le in les]
        self._sum = factory.counter(f"{name}_sum", description, labels)
        self._count = factory.counter(f"{name}_count", description, labels)

    def observe(self, value: float) -> None:
        for bound, counter in zip(self._bounds, self._buckets):
            if value <= bound:
                counter.increment(1)
        self._buckets[-1].increment(1)
        self._sum.increment(value)
        self._count.increment(1)


def _format_le(bound: float) -> str:
    return repr(float(bound)) if bound != int(bound) else f"{int(bound)}"



def native_or_counter_histogram(factory: MetricFactory, name: str, description: str,
                                labels: dict[str, str], buckets: Sequence[float]) -> Histogram:
    """A native histogram when the factory has them, else a ``CounterHistogram``."""
    try:
        return factory.histogram(name, description, labels, buckets)
    except NotImplementedError:
        return CounterHistogram(factory, name, description, labels, buckets)


def send_update(update, value: float) -> bool:
    """One metric update; a failing one (an IPC error) costs that update only."""
    try:
        update(value)
        return True
    except Exception as exc:  # noqa: BLE001 - metrics must never take the model down
        log.warning("a metric update failed: %s", exc)
        return False
