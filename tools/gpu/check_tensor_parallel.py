"""Tensor parallelism on a multi-GPU machine: the 8B Llama shape (random weights) at
tensor-parallel sizes 1, 2 (and 4 where four GPUs are visible).

    source benchmarks/gpu/setup.sh && $BENCH_PY tools/gpu/check_tensor_parallel.py --out $OUT

* exactness, float32: greedy tokens and the chosen tokens' logprobs of a set of prompts
  (radix cache on, a KV pool small enough to retract) against size 1: the share of
  prompts whose tokens all agree, the tokens before each divergence, the largest
  logprob difference over the agreeing prefix. Random weights give near-flat logits, so
  a flip where two logits tie within float32 rounding is possible and is reported, not
  hidden; the logprob difference says how close the sums are;
* speed, bfloat16, CUDA graphs on (the collectives inside them): batch-1 decode latency
  (ms per token) and batch-64 throughput (generated tokens/s), and the same at size 2
  with graphs off, which isolates a graph-capture failure from a collective failure.

Each configuration runs in a process of its own (an engine's GPU memory is not reliably
freed in-process). Writes ``$OUT/tensor_parallel_<phases>.json`` and prints a summary;
``--phases exact`` and ``--phases speed`` split the work over two device calls.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SHAPE = "llama-8b"
EXACT_PROMPTS, EXACT_NEW = 12, 32
BATCH, PROMPT_LEN, NEW_TOKENS = int(os.environ.get("TP_CHECK_BATCH", 64)), 128, 256


def _prompts(n: int, seed: int, lo: int, hi: int, vocab: int = 128000) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    prompts[3] = list(prompts[1])  # radix hits
    prompts[5] = prompts[2][:32] + prompts[5]
    return prompts


def child(args) -> dict:
    """One engine configuration; returns its measurements."""
    from backend.core import Engine, EngineConfig, SamplingParams

    exact = args.phase == "exact"
    config = EngineConfig(model_path=args.model, load_format="dummy", device=args.device,
                          dtype="float32" if exact else "bfloat16",
                          tensor_parallel_size=args.tp, context_length=4096,
                          max_total_tokens=600 if exact else 65536,
                          max_running_requests=BATCH, enable_cuda_graph=args.graphs)
    started = time.perf_counter()
    engine = Engine(config)
    result = {"tp": args.tp, "phase": args.phase, "graphs": args.graphs,
              "start_s": round(time.perf_counter() - started, 1)}
    try:
        if exact:
            params = SamplingParams(max_new_tokens=EXACT_NEW, temperature=0.0, ignore_eos=True,
                                    logprobs=1)
            outs = engine.generate(_prompts(EXACT_PROMPTS, 1, 40, 300), params)
            result["tokens"] = [o.token_ids for o in outs]
            result["logprobs"] = [[lp.logprob for lp in o.logprobs] for o in outs]
            result["retractions"] = engine.stats()["num_retractions"]
            return result
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        engine.generate([[3000 + 5 * b + i for i in range(PROMPT_LEN)] for b in range(4)],
                        params)  # warm-up
        one = [[1000 + i for i in range(PROMPT_LEN)]]
        t = time.perf_counter()
        engine.generate(one, params)
        result["batch1_ms_per_token"] = round((time.perf_counter() - t) * 1000 / NEW_TOKENS, 3)
        many = [[2000 + 7 * b + i for i in range(PROMPT_LEN)] for b in range(BATCH)]
        t = time.perf_counter()
        engine.generate(many, params)
        result[f"batch{BATCH}_tokens_per_s"] = round(BATCH * NEW_TOKENS / (time.perf_counter() - t))
        return result
    finally:
        engine.close()


def compare(base: dict, other: dict) -> dict:
    """Agreement of ``other``'s greedy tokens and logprobs with ``base``'s."""
    same, prefix, worst = 0, [], 0.0
    for a, b, la, lb in zip(base["tokens"], other["tokens"], base["logprobs"], other["logprobs"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same += n == len(a)
        prefix.append(n)
        worst = max([worst] + [abs(x - y) for x, y in zip(la[:n], lb[:n])])
    return {"prompts_identical": f"{same}/{len(prefix)}", "tokens_before_divergence": prefix,
            "max_abs_logprob_diff": worst}


def run_child(argv: list[str], log: Path) -> dict:
    with open(log, "ab") as f:
        proc = subprocess.run([sys.executable, __file__, "--child", *argv], stdout=subprocess.PIPE,
                              stderr=f, timeout=1500)
    lines = proc.stdout.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}; see {log.name}", "argv": argv}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--model", default=str(Path(os.environ.get("BENCH_SHAPES", "/tmp/shapes"))
                                               / SHAPE))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument("--sizes", default="", help="e.g. 1,2 (default: 1, 2, 4 as GPUs allow)")
    parser.add_argument("--phases", default="exact,speed",
                        help="exact, speed or both (one device call may not fit both)")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--phase", choices=("exact", "speed"), default="exact")
    parser.add_argument("--no-graphs", dest="graphs", action="store_false")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "tensor_parallel.log"
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes else
             [s for s in (1, 2, 4) if s <= torch.cuda.device_count()])
    common = ["--model", args.model, "--device", args.device]
    runs: list[dict] = []
    phases = args.phases.split(",")
    for phase in phases:
        for size in sizes:
            runs.append(run_child([*common, "--tp", str(size), "--phase", phase], log))
            print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("tokens", "logprobs")}),
                  flush=True)
    if 2 in sizes and "speed" in phases:
        runs.append(run_child([*common, "--tp", "2", "--phase", "speed", "--no-graphs"], log))
        print(json.dumps(runs[-1]), flush=True)
    exact = {r["tp"]: r for r in runs if r.get("phase") == "exact" and "tokens" in r}
    report = {"shape": SHAPE, "gpus": torch.cuda.device_count(),
              "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",)},
              "agreement": {size: compare(exact[1], exact[size]) for size in exact if size != 1
                            and 1 in exact},
              "runs": [{k: v for k, v in r.items() if k not in ("tokens", "logprobs")}
                       for r in runs]}
    (out / f"tensor_parallel_{'_'.join(phases)}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["agreement"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
