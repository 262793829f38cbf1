"""Shared-prefix workloads through the engine, radix cache on vs off.

Prints a table and writes JSON (and a PNG when matplotlib is present):

    .venv/bin/python benchmarks/bench_prefix.py [--model models/default] [--device cpu]
        [--out benchmarks/results/prefix_cpu.json]

For each workload it reports output tokens/s, total wall time, the cache hit rate
(prompt tokens served from the radix cache / prompt tokens) and that rate's ratio to the
best possible one (an infinite cache serving requests in the ideal order).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from backend.core import Engine, EngineConfig, SamplingParams  # noqa: E402
from workloads import BestHitTracker, few_shot, multi_turn, tree_of_thought  # noqa: E402


def run_workload(engine: Engine, workload) -> dict:
    tracker = BestHitTracker()
    prev, i = None, 0
    prompt_tokens = cached = out_tokens = best = 0
    start = time.perf_counter()
    while (reqs := workload.next_round(prev, i)) is not None:
        best += tracker.round([r.prompt for r in reqs])
        params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True)
                  for r in reqs]
        outs = engine.generate([r.prompt for r in reqs], params)
        for r, o in zip(reqs, outs):
            tracker.finished(r.prompt, o.token_ids)
            prompt_tokens += o.num_prompt_tokens
            cached += o.num_cached_tokens
            out_tokens += len(o.token_ids)
        prev, i = [o.token_ids for o in outs], i + 1
    wall = time.perf_counter() - start
    engine.check_integrity()
    return {"workload": workload.name, "description": workload.description,
            "wall_s": round(wall, 3), "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
            "output_tok_per_s": round(out_tokens / wall, 1),
            "total_tok_per_s": round((out_tokens + prompt_tokens) / wall, 1),
            "cache_hit_rate": round(cached / prompt_tokens, 4),
            "best_hit_rate": round(best / prompt_tokens, 4),
            "hit_rate_vs_best": round(cached / best, 4) if best else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "default"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "prefix_cpu.json"))
    args = ap.parse_args()

    def workloads(vocab):
        s = args.scale
        return [few_shot(vocab, num_questions=int(12 * s), shots_tokens=256, new_tokens=8),
                multi_turn(vocab, num_sessions=int(4 * s), turns=3, system_tokens=96, new_tokens=8),
                tree_of_thought(vocab, branching=2, depth=3, root_tokens=192, new_tokens=8)]

    rows = []
    for cache in (True, False):
        engine = Engine(EngineConfig(model_path=args.model, device=args.device, dtype=args.dtype,
                                     enable_radix_cache=cache, max_total_tokens=65536,
                                     max_running_requests=64, max_prefill_tokens=2048))
        for w in workloads(engine.runner.vocab_size):
            row = run_workload(engine, w)
            row["radix_cache"] = cache
            rows.append(row)
            engine.cache.reset()  # each workload starts cold

    print(f"{'workload':<16}{'cache':<7}{'out tok/s':>10}{'wall s':>9}{'hit rate':>10}{'best':>8}{'vs best':>9}")
    for r in rows:
        vs = f"{r['hit_rate_vs_best']:.2f}" if r["hit_rate_vs_best"] is not None else "-"
        print(f"{r['workload']:<16}{'on' if r['radix_cache'] else 'off':<7}{r['output_tok_per_s']:>10}"
              f"{r['wall_s']:>9}{r['cache_hit_rate']:>10.3f}{r['best_hit_rate']:>8.3f}{vs:>9}")
    speedups = {}
    for r in rows:
        if r["radix_cache"]:
            off = next(o for o in rows if o["workload"] == r["workload"] and not o["radix_cache"])
            speedups[r["workload"]] = round(off["wall_s"] / r["wall_s"], 2)
    print("speed-up of cache on over off (wall time):", speedups)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "device": args.device, "dtype": args.dtype,
                               "machine": platform.platform(), "rows": rows,
                               "speedup_cache_on_vs_off": speedups}, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
