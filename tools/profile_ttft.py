"""Where the time to first token goes, in-process, on a CUDA GPU.

    python tools/profile_ttft.py --model /tmp/shapes/llama-1b [--batch 1 32] \
        [--prompt-len 32 512] [--shared-prefix N] [--quantization fp8] [--out DIR]

For each (batch, prompt length): submit that many fresh prompts (random tokens: no cache
hits) to an idle engine and step it until every request has its first token. With
``--shared-prefix N`` the prompts of one repetition start with the same N tokens (fresh
for each repetition), as the suite's few-shot row does: ``--batch 64 --prompt-len 1056
--shared-prefix 1024``. Per case:
  * TTFT: wall time from the first add_request to the step that returned the last
    first token, over several repetitions (median), and the steps it took with the wall
    time of each;
  * Triton compiles per repetition (new entries in Triton's kernel cache folder): a
    first launch with a new specialisation compiles for hundreds of milliseconds;
  * torch.profiler over one repetition: device busy time (union of kernel intervals)
    against the wall time, and the kernels by total device time;
  * cProfile of the host over one repetition (functions by cumulative time).
Writes DIR/profile_ttft.json and DIR/profile_ttft.txt when --out is given.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.core import Engine, EngineConfig, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import busy_us  # noqa: E402


def triton_cache_entries() -> int:
    """Compiled kernel variants in Triton's on-disk cache (one folder per compile)."""
    import os

    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in root.iterdir()) if root.is_dir() else 0


def first_tokens(eng, prompts, params, step_times=None) -> float:
    """Seconds from the first add_request until every request has produced a token."""
    t0 = time.perf_counter()
    rids = {eng.add_request(p, params, stream=False) for p in prompts}
    waiting = set(rids)
    while waiting:
        t = time.perf_counter()
        outs = eng.step()
        if step_times is not None:
            step_times.append((time.perf_counter() - t) * 1e3)
        for o in outs:
            if o.new_token_ids:
                waiting.discard(o.request_id)
    ttft = time.perf_counter() - t0
    for rid in rids:
        eng.abort(rid)
    while eng.has_work():
        eng.step()
    return ttft


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="the first N tokens of a repetition's prompts are the same")
    ap.add_argument("--quantization", default="none", help="EngineConfig.quantization (fp8)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    on_cuda = args.device == "cuda"
    eng = Engine(EngineConfig(model_path=args.model, device=args.device,
                              dtype="bfloat16" if on_cuda else "float32", load_format="dummy",
                              max_total_tokens=200_000, max_running_requests=256,
                              quantization=args.quantization))
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    vocab = min(eng.runner.vocab_size, 120_000)

    def tokens(n):
        return [rng.randrange(100, vocab) for _ in range(n)]

    def prompts(b, n):
        shared = tokens(min(args.shared_prefix, n))
        return [shared + tokens(n - len(shared)) for _ in range(b)]

    first_tokens(eng, prompts(2, 40), params)  # first use of the sampling path etc.
    results, text = [], io.StringIO()
    for b in args.batch:
        for n in args.prompt_len:
            runs, steps, compiles = [], [], []
            for rep in range(args.reps):
                st: list[float] = []
                before = triton_cache_entries()
                runs.append(first_tokens(eng, prompts(b, n), params, st) * 1e3)
                compiles.append(triton_cache_entries() - before)
                steps.append(st)
            acts = [torch.profiler.ProfilerActivity.CPU]
            if on_cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as prof:
                wall = first_tokens(eng, prompts(b, n), params) * 1e3
            events = prof.events()
            busy = busy_us(events) / 1e3 if on_cuda else 0.0
            kernels = sorted(((e.key, e.device_time_total / 1e3, e.count)
                              for e in prof.key_averages() if e.device_time_total > 0),
                             key=lambda k: -k[1])[:12]
            pr = cProfile.Profile()
            pr.enable()
            first_tokens(eng, prompts(b, n), params)
            pr.disable()
            host = io.StringIO()
            pstats.Stats(pr, stream=host).sort_stats("cumulative").print_stats(30)
            row = {"batch": b, "prompt_len": n, "shared_prefix": args.shared_prefix,
                   "quantization": args.quantization, "ttft_ms_median": statistics.median(runs),
                   "ttft_ms_runs": [round(r, 3) for r in runs],
                   "triton_compiles": compiles, "steps": [len(s) for s in steps], "step_ms": [[round(x, 3) for x in s] for s in steps],
                   "profiled_wall_ms": round(wall, 3), "device_busy_ms": round(busy, 3),
                   "kernels_ms": [(k, round(t, 3), c) for k, t, c in kernels]}
            results.append(row)
            head = (f"b={b} prompt={n} shared={args.shared_prefix} {args.quantization}: "
                    f"TTFT median {row['ttft_ms_median']:.2f} ms "
                    f"(runs {row['ttft_ms_runs']}), compiles {compiles}, steps {row['steps']}, "
                    f"step ms {row['step_ms'][0]}; "
                    f"profiled: wall {wall:.2f} ms, device busy {busy:.2f} ms")
            print(head, flush=True)
            text.write(head + "\n" + "\n".join(f"   {t:9.3f} ms x{c:4d}  {k[:90]}" for k, t, c in kernels)
                       + "\n" + host.getvalue() + "\n")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_ttft.json").write_text(json.dumps(results, indent=1))
        (out / "profile_ttft.txt").write_text(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
