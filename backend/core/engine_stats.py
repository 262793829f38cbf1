"""What the engine reports about itself, and the check that its KV is all accounted for.

``Engine.stats()`` is read by the metrics (``backend/metrics.py``: the gauges and the
host-tier counters), the ``debug: stats`` request and the benchmarks; its keys are a
published contract (docs/metrics.md). ``Engine.check_integrity()`` asserts the slot
accounting across the scheduler and the tree. Both only read the parts the engine
wires together (scheduler, radix cache, KV mover, counters), so they live here, apart
from ``engine.py``, which drives the step and changes them.
"""
from __future__ import annotations

import dataclasses

from .host_memory import KVMover
from .outputs import EngineCounters
from .radix_cache import RadixCache
from .scheduler import Scheduler


def engine_stats(scheduler: Scheduler, kv_mover: KVMover, counters: EngineCounters,
                 context_len: int) -> dict:
    """Queue lengths, KV use by owner, the counters' totals and the host tier's figures."""
    slots, cache = scheduler.slots, scheduler.cache
    return {
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "kv_tokens_total": slots.size,
        "kv_tokens_used": slots.size - slots.available_size(),
        "kv_tokens_in_use_by_requests": cache.protected_size + sum(
            r.num_computed - r.tree_owned_len for r in scheduler.running),
        "radix_cache_tokens": cache.total_size(),
        "num_retractions": scheduler.num_retractions,
        "context_len": context_len,
        **dataclasses.asdict(counters),
        **_host_tier_stats(cache, kv_mover),
    }


def _host_tier_stats(cache: RadixCache, mover: KVMover) -> dict:
    """The host tier's size, use and traffic (totals since start)."""
    host = cache.host
    return {
        "host_cache_tokens_total": host.size if host is not None else 0,
        "host_cache_tokens": cache.host_size,
        "host_loads_in_flight": cache.tiers.loads_in_flight,
        "host_saved_tokens": cache.tiers.saved_tokens,
        "host_loaded_tokens": cache.tiers.loaded_tokens,
        "kv_bytes_to_host": mover.bytes_to_host,
        "kv_bytes_to_device": mover.bytes_to_device,
        "host_loads": mover.loads,
        "host_load_seconds": mover.load_seconds,
    }


def check_kv_accounting(scheduler: Scheduler) -> None:
    """Every KV slot is exactly one of: free, in the radix tree, or owned by a running
    request; every host block is free or in the tree (the tree's own invariants too).
    With nothing running and no load in flight, nothing is locked and every table row
    but the dummy is free. Raises AssertionError on a leak or a double owner."""
    slots, cache, rows = scheduler.slots, scheduler.cache, scheduler.rows
    cache.check_integrity()
    free, cached, owned = slots.free_slots(), cache.cached_slots(), scheduler.owned_slots()
    every = sorted(free + cached + owned)
    assert every == list(range(1, slots.size + 1)), (
        f"slot accounting broken: {len(free)} free + {len(cached)} cached + {len(owned)} owned "
        f"!= {slots.size} (or duplicates)")
    if not scheduler.running and not cache.tiers.loads_in_flight:
        assert cache.protected_size == 0, "tree nodes still locked with nothing running"
        assert rows.available_size() == rows.num_rows - 1
