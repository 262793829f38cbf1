"""The two-tier radix cache on the GPU, one engine configuration per process, JSON lines out.

    python benchmarks/gpu/bench_cache_tiers.py --model /tmp/shapes/llama-1b --out results.jsonl \
        [--modes multiturn,load] [--configs tiers,lru-gpu] [--budget-s 240]
    python benchmarks/gpu/bench_cache_tiers.py --model /tmp/shapes/tiny-llama --device cpu --quick

Modes:
  multiturn  the chats of ``benchmarks/chat_trace.py`` (the spec of the model's shape:
             llama-1b 48 users x 10 turns, 24 in flight; llama-8b 32 x 6, 16 in flight;
             others llama-1b's): a shared system prompt, histories growing to ~6k tokens,
             every turn resending the whole history. The GPU KV pool is a quarter of the
             histories' mean total, the host tier 8 pools. Per configuration: throughput
             (prompt + output tokens / s, output tokens / s), time to first token, hit
             rate per tier, KV bytes moved each way, load time; and where the time
             goes: steps and ms a step, mean running and waiting requests, retractions,
             prompt tokens computed. ``--in-flight N`` overrides the spec's turns in
             flight (an item of its own: ``chats_x4_inflightN``).
  load       one prompt of L tokens: time to first token when its KV is recomputed against
             when it is loaded back from the host tier (and the copy's own device time),
             for L from 128 to 32k tokens (every length loaded: host_load_min_tokens 0);
             ``crossover_tokens`` is the shortest L from which loading wins.
Configurations (``--configs``, each in its own process: ``--child NAME``): ``tiers`` (the
defaults: adaptive eviction, and a host tier of 8 pools), ``lru-gpu`` (LRU, no host tier:
the cache before the tier), ``adaptive-gpu`` (adaptive, no host tier; not run unless
named). The parent gives each its share of the budget (``WEIGHTS``), prints each
configuration's numbers and the tiers / lru-gpu ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common as C  # noqa: E402
from chat_trace import HOST_RATIO, SPECS, WORKING_SET_X, ChatTrace  # noqa: E402
from common import log  # noqa: E402

CONFIGS = {
    "tiers": {"host_cache_ratio": HOST_RATIO},
    "lru-gpu": {"radix_eviction_policy": "lru", "host_cache_ratio": 0},
    "adaptive-gpu": {"host_cache_ratio": 0},
}
# shares of the budget: tiers pins its host memory at start and runs the load mode too
WEIGHTS = {"tiers": 3, "lru-gpu": 2, "adaptive-gpu": 2}
LOAD_LENGTHS = (128, 512, 2048, 8192, 32768)
LOAD_NEED_S = 30  # the load mode on a GPU, engine start included (the chats run first)
QUICK_LOAD_LENGTHS = (16, 64, 256)


def chat_spec(args):
    spec = SPECS["quick"] if args.quick else SPECS.get(args.name or C.model_label(args.model),
                                                       SPECS["llama-1b"])
    return dataclasses.replace(spec, in_flight=args.in_flight) if args.in_flight else spec


def chats_workload(args) -> str:
    """The multiturn item's name: the working set, and the turns in flight if not the spec's."""
    return f"chats_x{WORKING_SET_X:g}" + (f"_inflight{args.in_flight}" if args.in_flight else "")


def engine_config(args, name: str, pool: int, running: int, **settings):
    from backend.core import EngineConfig

    on_cuda = args.device.startswith("cuda")
    return EngineConfig(model_path=args.model, device=args.device, load_format="dummy",
                        dtype="bfloat16" if on_cuda else "float32", max_total_tokens=pool,
                        max_running_requests=running, max_prefill_tokens=8192,
                        **{**CONFIGS[name], **settings})


def run_chats(eng, spec, seed: int) -> dict:
    """Drive the chats to the end; returns the run's numbers."""
    from backend.core import SamplingParams

    trace = ChatTrace(spec, seed, (C.VOCAB_LO, C.VOCAB_HI))
    flying: dict[str, dict] = {}
    ttft, prompt_tokens, output_tokens, requests = [], 0, 0, 0
    running, waiting = [], []  # queue lengths after each step: where a run's time goes
    before = eng.stats()
    t0 = time.perf_counter()
    while not trace.finished:
        for turn in trace.next_turns():
            params = SamplingParams(max_new_tokens=turn.max_new_tokens, temperature=0.0,
                                    ignore_eos=True)
            rid = eng.add_request(turn.prompt, params)
            flying[rid] = {"turn": turn, "out": [], "t": time.perf_counter()}
            prompt_tokens += len(turn.prompt)
            requests += 1
        outs = eng.step()
        running.append(len(eng.scheduler.running))
        waiting.append(len(eng.scheduler.waiting))
        for o in outs:
            r = flying.get(o.request_id)
            if r is None:
                continue
            if o.new_token_ids and not r["out"]:
                ttft.append(time.perf_counter() - r["t"])
            r["out"] += o.new_token_ids
            if o.finished:
                del flying[o.request_id]
                output_tokens += len(r["out"])
                trace.done(r["turn"], r["out"])
    wall = time.perf_counter() - t0
    after = eng.stats()
    d = {k: after[k] - before[k] for k in ("prompt_tokens", "cache_hit_tokens",
                                           "cache_hit_tokens_host", "kv_bytes_to_host",
                                           "kv_bytes_to_device", "host_loads",
                                           "host_load_seconds", "schedule_seconds", "steps",
                                           "num_retractions")}
    eng.check_integrity()
    return {"wall_s": round(wall, 3), "requests": requests,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tok_per_s": round((prompt_tokens + output_tokens) / wall, 1),
            "output_tok_per_s": round(output_tokens / wall, 1),
            "ttft_ms": C.pcts(ttft, 1000.0),
            "cache_hit_rate": round(d["cache_hit_tokens"] / max(d["prompt_tokens"], 1), 4),
            "host_hit_rate": round(d["cache_hit_tokens_host"] / max(d["prompt_tokens"], 1), 4),
            "kv_GB_to_host": round(d["kv_bytes_to_host"] / 1e9, 3),
            "kv_GB_to_device": round(d["kv_bytes_to_device"] / 1e9, 3),
            "host_loads": d["host_loads"], "host_load_s": round(d["host_load_seconds"], 3),
            "schedule_ms_per_step": round(d["schedule_seconds"] / max(d["steps"], 1) * 1000, 3),
            "steps": d["steps"], "ms_per_step": round(wall / max(d["steps"], 1) * 1000, 3),
            "retractions": d["num_retractions"],
            "recomputed_tokens": d["prompt_tokens"] - d["cache_hit_tokens"],
            "mean_running": round(sum(running) / max(len(running), 1), 2),
            "mean_waiting": round(sum(waiting) / max(len(waiting), 1), 2),
            "kv_pool_tokens": after["kv_tokens_total"],
            "host_tokens": after["host_cache_tokens_total"]}


def mode_multiturn(args, name: str, rec) -> None:
    spec = chat_spec(args)
    from backend.core import Engine

    # the quick spec's prompts are all shorter than a load's threshold
    settings = {"host_load_min_tokens": 0} if args.quick else {}
    eng = Engine(engine_config(args, name, spec.pool_tokens(), spec.in_flight, **settings))
    warm = dataclasses.replace(spec, users=spec.in_flight, turns=2)
    run_chats(eng, warm, seed=1)  # kernels compile here, untimed
    eng.cache.reset()
    m = run_chats(eng, spec, seed=2)
    m.update(working_set_tokens=spec.mean_working_set(), working_set_x=WORKING_SET_X,
             host_ratio=HOST_RATIO, spec=dataclasses.asdict(spec))
    rec.write("multiturn", chats_workload(args), m)


def mode_load(args, name: str, rec) -> None:
    import torch

    from backend.core import Engine, SamplingParams

    lengths = QUICK_LOAD_LENGTHS if args.quick else LOAD_LENGTHS
    room = 2 * max(lengths) + 64
    # every length is loaded (no threshold), into a host tier of two pools
    eng = Engine(engine_config(args, name, room, 4, host_cache_tokens=2 * room,
                               host_load_min_tokens=0))
    if eng.cache.host is None:
        rec.write("load", "by_length", status="skipped", error="no host tier in this configuration")
        return
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    for n in (lengths[0],) + tuple(lengths):  # the first round warms the kernels up
        recompute = []
        for rep in range(3):
            eng.cache.reset()
            prompt = C.random_prompts(1, n + 1, C.hash_seed("recompute", n, rep))[0]
            sync()
            t = time.perf_counter()
            eng.generate([prompt], one)
            recompute.append(time.perf_counter() - t)
        loads, copies = [], []
        for rep in range(3):
            eng.cache.reset()
            prompt = C.random_prompts(1, n + 1, C.hash_seed("load", n, rep))[0]
            eng.generate([prompt], one)  # cached on the device
            eng.cache.evict(eng.slots.size)  # ... and saved to the host
            eng.kv_mover.run(eng.cache.take_copies())
            sync()
            copy_s = eng.kv_mover.load_seconds
            t = time.perf_counter()
            out = eng.generate([prompt], one)[0]
            loads.append(time.perf_counter() - t)
            copies.append(eng.kv_mover.load_seconds - copy_s)
            assert out.num_cached_tokens == n, (out.num_cached_tokens, n)
        med = lambda v: sorted(v)[len(v) // 2] * 1000  # noqa: E731
        rows.append({"tokens": n, "recompute_ttft_ms": round(med(recompute), 3),
                     "load_ttft_ms": round(med(loads), 3), "load_copy_ms": round(med(copies), 3)})
    rows = rows[1:]
    wins = [r["tokens"] for r in rows if r["load_ttft_ms"] < r["recompute_ttft_ms"]]
    rec.write("load", "by_length", {"rows": rows, "crossover_tokens": min(wins) if wins else None,
                                    "token_bytes": eng.kv_mover.token_bytes,
                                    "pinned": eng.runner.host_pool.buffer.is_pinned(),
                                    "reloaded_kv_exact": reloaded_kv_exact(eng, lengths[-1])})


def reloaded_kv_exact(eng, n: int) -> bool:
    """A prompt's KV read back after a round trip to the host tier equals the KV it had,
    bit for bit, and greedy tokens from it equal those from the device-resident copy."""
    import torch

    from backend.core import SamplingParams

    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    eng.cache.reset()
    prompt = C.random_prompts(1, n + 1, C.hash_seed("exact", n))[0]
    eng.generate([prompt], greedy)
    on_device = eng.generate([prompt], greedy)[0].token_ids  # served from the device tier
    slots = eng.cache.match_prefix(prompt[:n]).kv_indices
    pool = eng.runner.kv_pool
    index = torch.tensor(slots, device=pool.k_buffer[0].device)
    before = [(k[index].clone(), v[index].clone()) for k, v in zip(pool.k_buffer, pool.v_buffer)]
    eng.cache.evict(eng.slots.size)
    reloaded = eng.generate([prompt], greedy)[0]  # served from the host tier
    assert reloaded.num_cached_tokens == n
    slots = eng.cache.match_prefix(prompt[:n]).kv_indices
    index = torch.tensor(slots, device=pool.k_buffer[0].device)
    same = all(torch.equal(k[index], kb) and torch.equal(v[index], vb)
               for (kb, vb), k, v in zip(before, pool.k_buffer, pool.v_buffer))
    return same and reloaded.token_ids == on_device


MODES = {"multiturn": mode_multiturn, "load": mode_load}


def child(args) -> int:
    budget = C.Budget(args.budget_s)
    label = args.name or C.model_label(args.model)
    rec = C.Recorder(args.out, "engine", label, f"cache-{args.child}", CONFIGS[args.child],
                     C.load_done(args.done), extra={"quick": args.quick, "device": args.device})
    for mode in args.modes.split(","):
        if mode == "load" and args.child != "tiers":
            continue
        if rec.is_done(mode, f"chats_x{WORKING_SET_X:g}" if mode == "multiturn" else "by_length"):
            continue
        if mode == "load" and not budget.allows(LOAD_NEED_S):
            rec.write(mode, "by_length", status="skipped",
                      error=f"{budget.left():.0f}s left of this configuration's budget")
            continue
        try:
            MODES[mode](args, args.child, rec)
        except Exception as exc:  # noqa: BLE001
            rec.write(mode, "all", status="error", error=C.error_text(exc))
    return 0


def summary(out: str, label: str, workload: str) -> None:
    """The latest multiturn line per configuration, and tiers / lru-gpu."""
    latest = {}
    for line in Path(out).read_text().splitlines():
        r = json.loads(line)
        if r.get("mode") == "multiturn" and r.get("workload") != workload:
            continue
        if r.get("model") == label and r.get("mode") in ("multiturn", "load") and r["status"] == "ok":
            latest[(r["config"], r["mode"])] = r["metrics"]
    for (config, mode), m in sorted(latest.items()):
        if mode == "multiturn":
            log(f"{config:18s} {m['total_tok_per_s']:10.1f} tok/s  ttft p50 "
                f"{m['ttft_ms']['p50']:.1f} ms p90 {m['ttft_ms']['p90']:.1f} ms  hit "
                f"{m['cache_hit_rate']:.3f} (host {m['host_hit_rate']:.3f}); {m['steps']} steps "
                f"of {m['ms_per_step']:.2f} ms, running {m['mean_running']:.1f} waiting "
                f"{m['mean_waiting']:.1f}, {m['retractions']} retractions, "
                f"{m['recomputed_tokens']} prompt tokens computed")
        else:
            log(f"{config:18s} load vs recompute: {m['rows']} crossover {m['crossover_tokens']}")
    a, b = latest.get(("cache-tiers", "multiturn")), latest.get(("cache-lru-gpu", "multiturn"))
    if a and b:
        log(f"tiers / lru-gpu: throughput x{a['total_tok_per_s'] / b['total_tok_per_s']:.2f}, "
            f"ttft p50 x{b['ttft_ms']['p50'] / a['ttft_ms']['p50']:.2f} lower, "
            f"p90 x{b['ttft_ms']['p90'] / a['ttft_ms']['p90']:.2f} lower")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(ap)
    ap.add_argument("--modes", default="multiturn,load")
    ap.add_argument("--configs", default="tiers,lru-gpu")
    ap.add_argument("--in-flight", type=int, default=0,
                    help="turns in flight instead of the shape's spec (its own item name)")
    ap.add_argument("--child", choices=sorted(CONFIGS), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    budget = C.Budget(args.budget_s)
    names = [n for n in args.configs.split(",") if n]
    for i, name in enumerate(names):
        share = budget.left() * WEIGHTS[name] / sum(WEIGHTS[n] for n in names[i:])
        command = [sys.executable, __file__, "--child", name, "--model", args.model,
                   "--out", args.out, "--device", args.device, "--modes", args.modes,
                   "--budget-s", str(share)] + (["--quick"] if args.quick else []) + \
                  (["--name", args.name] if args.name else []) + \
                  (["--in-flight", str(args.in_flight)] if args.in_flight else []) + \
                  (["--done", *args.done] if args.done else [])
        log(f"bench_cache_tiers: {name} ({share:.0f}s)")
        try:
            subprocess.run(command, timeout=share + 30, check=False)
        except subprocess.TimeoutExpired:
            log(f"bench_cache_tiers: {name} ran past its share of the budget")
    summary(args.out, args.name or C.model_label(args.model), chats_workload(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
