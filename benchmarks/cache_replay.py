"""Replay request traces through the radix cache's policy alone, against the optimum.

No model: the real ``RadixCache`` (its eviction policy, its host tier) and allocators on
integer slots, driven as the scheduler drives them, one request at a time (match, pin,
load a host part, make room for the whole request, insert, unpin). For each trace and
policy it reports the hit rate (prompt tokens served from the cache / prompt tokens), per
tier, and the hit rate of the offline optimum (``cache_optimum.py``: farthest-in-future at
token granularity, pinned between a schedule a cache could follow and the optimum of a
relaxed cache; both agree on every trace here) at the same capacity: the device tier alone
for GPU-only runs, device + host for runs with the host tier.

    .venv/bin/python benchmarks/cache_replay.py [--out docs/benchmarks] [--traces cycle,...]

writes ``cache_policies.json``, ``cache_policies.md`` and ``cache_policies.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from backend.core.eviction import EvictionPolicy, make_policy  # noqa: E402
from backend.core.host_tier import HostBlockAllocator, HostSave  # noqa: E402
from backend.core.kv_allocator import KVSlotAllocator  # noqa: E402
from backend.core.radix_cache import RadixCache  # noqa: E402
from backend.core.scheduler import EVICT_SHARE  # noqa: E402
from cache_optimum import TraceRequest, hit_upper_bound, optimal_hits  # noqa: E402
from cache_traces import Trace, all_traces, held_out_traces  # noqa: E402

POLICIES = ("lru", "adaptive")
HOST_RATIO = 2  # host tier = this many times the device tier (the engine's default)


@dataclass
class ReplayResult:
    prompt_tokens: int = 0
    device_hits: int = 0
    host_hits: int = 0
    saved_tokens: int = 0  # device -> host
    loaded_tokens: int = 0  # host -> device

    @property
    def hits(self) -> int:
        return self.device_hits + self.host_hits


def replay(requests: list[TraceRequest], capacity: int, policy: str | EvictionPolicy,
           host_tokens: int = 0, check_every: int = 0,
           before_each: Callable[[int], None] | None = None) -> ReplayResult:
    """Serve ``requests`` in order through a cache of ``capacity`` device slots, with the
    policy called ``policy`` (or that policy object); ``before_each(i)`` is called before
    request i is served."""
    slots = KVSlotAllocator(capacity)
    host = HostBlockAllocator(host_tokens) if host_tokens else None
    if isinstance(policy, str):
        policy = make_policy(policy, capacity + host_tokens)
    cache = RadixCache(slots, policy, host)
    out = ReplayResult()
    for i, r in enumerate(requests):
        if before_each is not None:
            before_each(i)
        path = r.path
        match = cache.match_prefix(r.prompt[:r.hit_limit])
        cache.lock(match.deepest)
        cached = len(match.kv_indices) + match.host_len
        _make_room(cache, match.host_len + len(path) - cached)
        kv = list(match.kv_indices)
        if match.host_len:
            loaded = slots.alloc(match.host_len)
            ticket = cache.start_load(match, loaded)
            kv += loaded
        cache.record_use(match.deepest)
        kv += slots.alloc(len(path) - cached)
        if match.host_len:
            cache.finish_load(ticket)  # no device here: a load is done once planned
        present = cache.insert(path, kv)
        slots.free(kv[cached:present])
        cache.unlock(match.deepest)
        for copy in cache.take_copies():
            if isinstance(copy, HostSave):
                out.saved_tokens += len(copy.host_blocks)
            else:
                out.loaded_tokens += len(copy.host_blocks)
        out.prompt_tokens += len(r.prompt)
        out.device_hits += len(match.kv_indices)
        out.host_hits += match.host_len
        if check_every and i % check_every == 0:
            cache.check_integrity()
            assert sorted(cache.cached_slots() + slots.free_slots()) == \
                list(range(1, capacity + 1)), "slot accounting broken"
    return out


def _make_room(cache: RadixCache, n: int) -> None:
    short = n - cache.slots.available_size()
    if short > 0:  # as Scheduler.take_slots: at least a share of the pool at once
        cache.evict(max(short, cache.slots.size // EVICT_SHARE))
    if cache.slots.available_size() < n:
        raise ValueError(f"a request of {n} tokens does not fit in the cache")


def evaluate(trace: Trace, policies=POLICIES) -> list[dict]:
    """One row per (policy, tier setting), with the optimum at the same capacity."""
    rows = []
    host = HOST_RATIO * trace.capacity
    caps = (trace.capacity, trace.capacity + host)
    # the optimum lies between a schedule a cache can follow and a relaxed cache's optimum
    reached = {cap: sum(optimal_hits(trace.requests, cap)) for cap in caps}
    optimum = {cap: sum(hit_upper_bound(trace.requests, cap)) for cap in caps}
    for policy in policies:
        for host_tokens in (0, host):
            started = time.perf_counter()
            res = replay(trace.requests, trace.capacity, policy, host_tokens)
            best = optimum[trace.capacity + host_tokens]
            rows.append({
                "trace": trace.name, "policy": policy, "host_tier": bool(host_tokens),
                "requests": len(trace.requests), "prompt_tokens": res.prompt_tokens,
                "device_tokens": trace.capacity, "host_tokens": host_tokens,
                "hit_rate": round(res.hits / res.prompt_tokens, 4),
                "device_hit_rate": round(res.device_hits / res.prompt_tokens, 4),
                "host_hit_rate": round(res.host_hits / res.prompt_tokens, 4),
                "optimal_hit_rate": round(best / res.prompt_tokens, 4),
                "optimum_reached_hit_rate": round(
                    reached[trace.capacity + host_tokens] / res.prompt_tokens, 4),
                "share_of_optimum": round(res.hits / best, 4) if best else None,
                "saved_tokens": res.saved_tokens, "loaded_tokens": res.loaded_tokens,
            })
            log_row(rows[-1], time.perf_counter() - started)
    return rows


NOTES = """\
Notes:

- The optimum serves requests one at a time, holds each request's whole path (prompt
  and output) while it runs, and may evict any other cached token; it knows the future.
  Farthest-in-future eviction gives a schedule a cache can follow (at most the optimum);
  the same rule on a relaxed cache that may keep a token without the tokens before it
  is plain paging, where it is exact (at least the optimum). The two agree on every
  trace here, so the optimum column is exact; the tests check both bounds against
  exhaustive search on small traces. The policies evict whole edges (LRU) or
  edge tails (adaptive), at least 1/{evict_share} of the pool at a time, as the engine does.
- A host tier of twice the device holds what the device evicts; its hits count in the
  hit rate, and its optimum is the one for device + host capacity (two tiers with free
  moves between them can hold any set of that size).
- **multi-turn** is bounded by foresight, not by the policy: which of the chatting users
  comes next, and which conversations have ended, is random (think times with CV 0.5,
  3 to 9 turns), and the optimum knows both. An online policy only learns that a chat
  has ended from its silence. The informed bounds above measure this: a policy told the
  very laws the trace is drawn from stays near 70% of the optimum, and one also told
  which chats have ended stays below 80%. On the other traces the future is predictable
  from the past (rotation, popularity, hot set versus one-off prompts).
- The adaptive policy weighs a token by what it costs to recompute (a deeper token more:
  its attention reads every token before it), while the hit rate counts tokens alike;
  weighing tokens alike changes the shares above by at most 2 points, either way.
- The held-out traces check that the adaptive policy is not fitted to the four above
  (its constants were chosen on those and on other seeds of them): exponential think
  times, a system prompt ten times longer, a flatter Zipf law, and tenants, chats and
  scans in one stream.
"""


def markdown(report: dict) -> str:
    """The page for a report (``traces``, ``rows``) as ``main`` writes it to JSON."""
    held_out = {t["name"] for t in report["traces"] if t.get("held_out")}
    lines = ["# Radix cache eviction policies against the offline optimum", "",
             "Generated by `benchmarks/cache_replay.py` (no model: the radix cache and its "
             "allocators on integer slots). Hit rate = prompt tokens served from the cache / "
             "prompt tokens; *optimum* = farthest-in-future eviction at token granularity "
             "(`benchmarks/cache_optimum.py`), at the device capacity for GPU-only rows and "
             f"at device + host for host-tier rows (host = {HOST_RATIO}x device).", "",
             "![share of the optimum per trace and policy](cache_policies.png)", ""]
    lines += _table([r for r in report["rows"] if r["trace"] not in held_out])
    if held_out:
        lines += ["", "Held-out traces (the policy's constants were not chosen on them):", ""]
        lines += _table([r for r in report["rows"] if r["trace"] in held_out])
    if report.get("informed_bounds"):
        lines += ["", "What an online policy could reach on the chat traces if it knew the laws "
                  "that make them (`benchmarks/cache_informed_bound.py`): *laws* = the "
                  "distributions of turns per chat and of think times, each chat's turns so far "
                  "and the time since its last turn; *laws + ends* = also which chats have had "
                  "their last turn. Neither knows when a chat comes back.", "",
                  "| trace | policy knows | host tier | hit rate | optimum | % of optimum |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {b['trace']} | {b['knows']} | {'on' if b['host_tier'] else 'off'} | "
                  f"{100 * b['hit_rate']:.1f}% | {100 * b['optimal_hit_rate']:.1f}% | "
                  f"{100 * b['share_of_optimum']:.1f}% |" for b in report["informed_bounds"]]
    lines += ["", "Traces:", ""]
    lines += [f"- **{t['name']}**{' (held out)' if t.get('held_out') else ''} "
              f"({t['requests']} requests, device cache {t['capacity']} tokens): "
              f"{t['description']}." for t in report["traces"]]
    return "\n".join(lines) + "\n\n" + NOTES.format(evict_share=EVICT_SHARE)


def _table(rows: list[dict]) -> list[str]:
    lines = ["| trace | policy | host tier | hit rate | device / host | optimum | % of optimum |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        share = "-" if r["share_of_optimum"] is None else f"{100 * r['share_of_optimum']:.1f}%"
        best = f"{100 * r['optimal_hit_rate']:.1f}%"
        reached = r.get("optimum_reached_hit_rate", r["optimal_hit_rate"])
        if reached != r["optimal_hit_rate"]:  # the bounds differ: show both, share at least
            best = f"{100 * reached:.1f}-{best}"
            share = f">= {share}"
        lines.append(f"| {r['trace']} | {r['policy']} | {'on' if r['host_tier'] else 'off'} | "
                     f"{100 * r['hit_rate']:.1f}% | {100 * r['device_hit_rate']:.1f}% / "
                     f"{100 * r['host_hit_rate']:.1f}% | {best} | {share} |")
    return lines


def log_row(r: dict, seconds: float) -> None:
    print(f"{r['trace']:14s} {r['policy']:9s} host={'on ' if r['host_tier'] else 'off'} "
          f"hit {100 * r['hit_rate']:5.1f}% (device {100 * r['device_hit_rate']:5.1f}%, "
          f"host {100 * r['host_hit_rate']:5.1f}%)  optimum {100 * r['optimal_hit_rate']:5.1f}%"
          f"  -> {100 * (r['share_of_optimum'] or 0):5.1f}% of optimum  ({seconds:.1f} s)",
          flush=True)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    series = list(dict.fromkeys((r["policy"], r["host_tier"]) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(series)
    for k, (policy, host) in enumerate(series):
        values = [100 * next((r["share_of_optimum"] or 0) for r in rows if r["trace"] == t
                             and r["policy"] == policy and r["host_tier"] == host)
                  for t in traces]
        ax.bar([i + k * width for i in range(len(traces))], values, width,
               label=f"{policy}{' + host tier' if host else ''}")
    ax.axhline(80, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(traces))], traces,
                  rotation=20, ha="right")
    ax.set_ylabel("% of the optimal hit rate")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(series))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--traces", default=None,
                    help="comma-separated names (default: all, held-out ones included)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    traces = [(t, False) for t in all_traces()] + [(t, True) for t in held_out_traces()]
    if args.traces:
        traces = [(t, h) for t, h in traces if t.name in args.traces.split(",")]
    policies = args.policies.split(",")
    started = time.perf_counter()
    rows = [row for trace, _ in traces for row in evaluate(trace, policies)]
    print(f"replayed in {time.perf_counter() - started:.0f} s")
    from cache_informed_bound import CHAT_TRACES, bound  # it replays with this module

    bounds = [row for trace, _ in traces if trace.name in CHAT_TRACES
              for knows_ends in (False, True) for row in bound(trace.name, knows_ends)]
    report = {"traces": [{"name": t.name, "description": t.description,
                          "requests": len(t.requests), "capacity": t.capacity,
                          "held_out": held} for t, held in traces],
              "rows": rows, "informed_bounds": bounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_policies.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "cache_policies.md").write_text(markdown(report))
    plot(rows, out / "cache_policies.png")


if __name__ == "__main__":
    main()
