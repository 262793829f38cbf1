"""Host time per step of the two-tier radix cache, without a model: the scheduler, the
radix cache and its tiers, and the KV copies between CPU tensors, driven by the chat
trace of ``chat_trace.py`` (the one ``gpu/bench_cache_tiers.py`` runs on a GPU).

    python benchmarks/bench_tier_host.py [--spec llama-1b] [--users 24] [--out PATH]

Each step runs as the engine runs it: finished loads are reported, ``schedule()`` plans
the step, the plan's host copies run, and the step's results are accounted for (each
sampling request gets one token; chunks and finished turns go into the tree). The
forward pass is left out: what is timed is what the host does around it, which on a GPU
must stay well below the forward's own time for the host tier to pay. Phases:

  admission   ordering the waiting queue (a prefix match per waiting request)
  eviction    freeing device slots (choosing victims, planning saves to the host)
  schedule    the rest of ``schedule()`` (admissions, loads planned, decode slots)
  copies      running the plan's saves and loads (KVMover, here on CPU tensors)
  account     the step's results: chunks and finished turns inserted into the tree

Prints ms per step per phase and writes them as JSON (default
``docs/benchmarks/tier_host_cpu.json``). Times are the process's CPU time (thread
time: the machine may be shared), not wall time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_trace import HOST_RATIO, SPECS, ChatTrace, Turn  # noqa: E402

from backend.core import scheduler as scheduler_module  # noqa: E402
from backend.core.config import EngineConfig  # noqa: E402
from backend.core.eviction import make_policy  # noqa: E402
from backend.core.host_memory import HostKVPool, KVMover  # noqa: E402
from backend.core.host_tier import HostBlockAllocator  # noqa: E402
from backend.core.kv_allocator import KVSlotAllocator, TableRowAllocator  # noqa: E402
from backend.core.memory_pool import KVPool  # noqa: E402
from backend.core.radix_cache import RadixCache  # noqa: E402
from backend.core.request import Req  # noqa: E402
from backend.core.sampling_params import SamplingParams  # noqa: E402
from backend.core.scheduler import Scheduler  # noqa: E402

# 16 layers as the 1B shape (the copies' work per layer is the shape's), 4 bytes a layer
# and token (their bytes are not: on a GPU they move asynchronously, here by memcpy)
LAYERS, HEADS, HEAD_DIM, DTYPE = 16, 1, 1, torch.float16
PHASES = ("admission", "eviction", "schedule", "copies", "account")


class PhaseClock:
    """Seconds spent per phase; ``wrap`` times a callable (exclusive of nothing: the
    caller subtracts nested phases)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.thread_time() - started
                self.calls[phase] += 1
        return timed


def build(spec, host_ratio: float, policy: str, config_overrides: dict):
    pool = spec.pool_tokens()
    host_tokens = int(host_ratio * pool)
    config = EngineConfig(model_path="unused", max_total_tokens=pool,
                          max_running_requests=spec.in_flight, max_prefill_tokens=8192,
                          radix_eviction_policy=policy, host_cache_ratio=host_ratio,
                          **config_overrides)
    slots = KVSlotAllocator(pool)
    host = HostBlockAllocator(host_tokens) if host_tokens else None
    cache = RadixCache(slots, make_policy(policy, pool + host_tokens), host,
                       config.host_load_min_tokens)
    sched = Scheduler(config, slots, TableRowAllocator(spec.in_flight), cache,
                      context_len=1 << 20)
    kv_pool = KVPool(pool, LAYERS, HEADS, HEAD_DIM, DTYPE, "cpu")
    host_pool = (HostKVPool(host_tokens, LAYERS, HEADS, HEAD_DIM, DTYPE, pin=False)
                 if host_tokens else None)
    return sched, KVMover(kv_pool, host_pool, torch.device("cpu"))


def run(spec, host_ratio: float, policy: str, seed: int, config_overrides: dict) -> dict:
    sched, mover = build(spec, host_ratio, policy, config_overrides)
    cache = sched.cache
    clock = PhaseClock()
    # nested phases are timed inside schedule(): subtracted from it below
    scheduler_module.admission_order = clock.wrap("admission", scheduler_module.admission_order)
    cache.tiers.evict = clock.wrap("eviction", cache.tiers.evict)
    trace = ChatTrace(spec, seed)
    turns: dict[str, Turn] = {}
    prompt_tokens = cached = host_cached = steps = 0
    tick = 0
    started = time.thread_time()
    while not trace.finished:
        for turn in trace.next_turns():
            tick += 1
            rid = f"r{tick}"
            params = SamplingParams(max_new_tokens=turn.max_new_tokens, temperature=0.0,
                                    ignore_eos=True)
            sched.add(Req(rid=rid, group_id=rid, index=0, origin_input_ids=turn.prompt,
                          params=params))
            turns[rid] = turn
            prompt_tokens += len(turn.prompt)
        t0 = time.thread_time()
        for ticket in mover.finished_loads():
            sched.load_done(ticket)
        t1 = time.thread_time()
        plan = sched.schedule()
        t2 = time.thread_time()
        mover.run(plan.host_copies)
        t3 = time.thread_time()
        finished = []
        for req in plan.out_of_room:
            finished.append(req)
        for it in plan.items:
            req = it.req
            if not it.samples:
                sched.cache_unfinished(req)
                continue
            req.output_ids.append(100 + (tick + len(req.output_ids)) % 30000)
            if len(req.output_ids) >= req.params.max_new_tokens:
                finished.append(req)
        for req in finished:
            req.finish_reason = "length"
            sched.finish(req)
            cached += req.num_cached_tokens
            host_cached += req.num_host_cached_tokens
            trace.done(turns.pop(req.rid), req.output_ids)
        t4 = time.thread_time()
        clock.seconds["copies"] += (t1 - t0) + (t3 - t2)
        clock.seconds["schedule"] += t2 - t1
        clock.seconds["account"] += t4 - t3
        steps += bool(plan.items)
        if not plan.items and not plan.host_copies and not mover.loads_pending:
            raise RuntimeError("no progress: nothing scheduled, nothing loading")
    wall = time.thread_time() - started
    sched.cache.check_integrity()
    clock.seconds["schedule"] -= clock.seconds["admission"] + clock.seconds["eviction"]
    per_step = {p: round(clock.seconds[p] / steps * 1000, 3) for p in PHASES}
    per_step["total"] = round(sum(clock.seconds[p] for p in PHASES) / steps * 1000, 3)
    return {"steps": steps, "wall_s": round(wall, 2), "ms_per_step": per_step,
            "evictions": clock.calls["eviction"], "host_loads": mover.loads,
            "host_saved_tokens": cache.tiers.saved_tokens,
            "host_loaded_tokens": cache.tiers.loaded_tokens,
            "prompt_tokens": prompt_tokens,
            "cache_hit_rate": round(cached / prompt_tokens, 4),
            "host_hit_rate": round(host_cached / prompt_tokens, 4),
            "pool_tokens": sched.slots.size,
            "host_tokens": cache.host.size if cache.host is not None else 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="llama-1b", choices=sorted(SPECS))
    ap.add_argument("--users", type=int, default=None, help="fewer users (a quicker run)")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--host-ratio", type=float, default=HOST_RATIO, help="0: no host tier")
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="an EngineConfig setting, NAME=INT")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks/tier_host_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = SPECS[args.spec]
    if args.users:
        spec = dataclasses.replace(spec, users=args.users,
                                   in_flight=min(spec.in_flight, args.users))
    if args.turns:
        spec = dataclasses.replace(spec, turns=args.turns)
    overrides = {k: int(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    result = run(spec, args.host_ratio, args.policy, args.seed, overrides)
    result.update(spec=dataclasses.asdict(spec), spec_name=args.spec, policy=args.policy,
                  host_ratio=args.host_ratio, engine_args=overrides)
    m = result["ms_per_step"]
    print(f"{args.spec} users {spec.users} turns {spec.turns} in flight {spec.in_flight}, "
          f"pool {result['pool_tokens']} host {result['host_tokens']} tokens, policy "
          f"{args.policy}: {result['steps']} steps in {result['wall_s']} s")
    print("ms/step  " + "  ".join(f"{p} {m[p]:.3f}" for p in (*PHASES, "total")))
    print(f"hit rate {result['cache_hit_rate']:.3f} (host {result['host_hit_rate']:.3f}), "
          f"{result['evictions']} evictions, {result['host_loads']} loads, "
          f"{result['host_saved_tokens']} tokens saved, {result['host_loaded_tokens']} loaded")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
