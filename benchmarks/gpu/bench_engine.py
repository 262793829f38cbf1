"""In-process engine benchmark: one engine configuration per process, JSON lines out.

    python benchmarks/gpu/bench_engine.py --model /tmp/shapes/llama-1b --out results.jsonl \
        [--modes offline,hbm,prefix,online,json] [--no-radix-cache] [--no-overlap] \
        [--no-cuda-graph] [--prefix-workloads few-shot] [--engine-arg quantization=fp8 \
        --config-name fp8] [--budget-s 200] [--done earlier.jsonl ...]
    python benchmarks/gpu/bench_engine.py --model models/default --device cpu --quick

Modes (each item appends one line to --out; an item that would not fit the budget is
recorded as ``skipped``, one that fails as ``error``, and the next item still runs):
  offline  batches submitted at once (the anchor rows); output tok/s, TTFT/TPOT
  hbm      device copy bandwidth, then steady decode at batch 1 and 64: bytes of weights
           and KV read per step / step time, as a fraction of the copy bandwidth; also the
           scheduler's CPU time per step (Scheduler.schedule, timed from outside)
  prefix   few-shot 64 x (1024 shared + 32)/64, multi-turn chat, tree-of-thought, each also
           with 8-token answers ("-short"); an untimed pass, then a timed one: tok/s,
           cache hit rate and its ratio to the best possible (workloads.BestHitTracker)
  online   Poisson arrivals at several rates for 32/128 and 256/32; TTFT, TPOT, latency
           p50/p90/p99, throughput
  json     JSON-schema-constrained decoding (jump-forward as configured): tok/s, validity
Requests are driven from this thread: arrivals due are added between ``step()`` calls, as
a server loop would pick them up; times are taken when ``step()`` hands tokens back.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402
# The driver and the modes live in engine_*.py (files of about 300 lines); the names below
# stay importable from here, where tools/, vllm_peer.py and the tests look for them.
from engine_driver import ChildEngine, drive, greedy, reset_cache, sync  # noqa: E402,F401
from engine_hbm import copy_bandwidth, mode_hbm, steady_decode  # noqa: E402,F401
from engine_json import mode_json  # noqa: E402
from engine_modes import (mode_offline, mode_online, mode_prefix,  # noqa: E402,F401
                          selected_prefix_workloads)


MODES = {"offline": mode_offline, "hbm": mode_hbm, "prefix": mode_prefix,
         "online": mode_online, "json": mode_json}



def config_name(args) -> str:
    if args.config_name:
        return args.config_name
    parts = [p for flag, p in ((args.no_radix_cache, "cache-off"), (args.no_overlap, "overlap-off"),
                               (args.no_cuda_graph, "no-graph"),
                               (args.engine_process, "engine-process")) if flag]
    return "+".join(parts) or "default"


def warmup_batches(quick: bool) -> list[tuple[list[list[int]], int]]:
    """The untimed warm-up, as (prompts, output tokens) batches submitted one after the
    other: the shapes the modes use, then prompts behind a cached 1,024-token prefix (prefix
    hits take the extend kernel's prefix path). vllm_peer.py warms vLLM with the same."""
    shapes = [(1, 8, 4), (4, 8, 4)] if quick else [(1, 32, 8), (32, 32, 8), (128, 32, 8),
                                                   (64, 256, 8), (8, 512, 8)]
    out = [(C.random_prompts(b, n_in, C.hash_seed("warm", b, n_in)), n_out) for b, n_in, n_out in shapes]
    shared = C.random_prompts(1, 64 if quick else 1024, C.hash_seed("warm-prefix"))[0]
    for j in range(2):
        tails = C.random_prompts(4, 8, C.hash_seed("warm-tail", j))
        out.append(([shared + tl for tl in tails], 4))
    return out


def warmup(eng, SP, args, torch):
    """Trigger kernel compilation for the shapes the modes use (untimed)."""
    t = time.perf_counter()
    for prompts, n_out in warmup_batches(args.quick):
        drive(eng, [0.0] * len(prompts), prompts, greedy(SP, n_out))
    reset_cache(eng)
    sync(torch, args.device)
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(ap)
    ap.add_argument("--modes", default="offline,hbm,prefix,online,json")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--no-radix-cache", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--rep-gap-s", type=float, default=0.0,
                    help="offline rows: idle this long before each run (bench_triton's runs "
                         "start after ~1 s of idle while the client processes start)")
    ap.add_argument("--rep-gap-spin", action="store_true",
                    help="spend --rep-gap-s spinning on the host instead of asleep")
    ap.add_argument("--config-name", default=None, help="label (default from the flags)")
    ap.add_argument("--prefix-workloads", default=None,
                    help="comma list of prefix workloads (default all: few-shot, multi-turn, "
                         "tree-of-thought and their -short forms)")
    ap.add_argument("--online-shapes", default=None,
                    help="comma list of online shapes (default all: in32_out128,in256_out32)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the engine in a child process, as the Triton backend runs it "
                         "(offline and online modes)")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="extra EngineConfig field, KEY=VALUE (repeatable)")
    args = ap.parse_args(argv)
    budget = C.Budget(args.budget_s)
    label = args.name or C.model_label(args.model)
    cfg_name = config_name(args)
    log(f"bench_engine: model={label} config={cfg_name} modes={args.modes} budget={args.budget_s}s")

    import torch
    from backend.core import Engine, EngineConfig, SamplingParams

    flags = {"radix_cache": not args.no_radix_cache, "overlap": not args.no_overlap,
             "cuda_graph": not args.no_cuda_graph}
    rec = C.Recorder(args.out, "engine", label, cfg_name, flags, C.load_done(args.done),
                     extra={"quick": args.quick, "device": args.device})
    modes = [m for m in args.modes.split(",") if m]
    on_cuda = args.device.startswith("cuda")
    ctx = {"rec": rec, "args": args, "budget": budget, "SP": SamplingParams, "torch": torch,
           "label": label, "min_item_s": 2.0 if args.quick else 8.0}

    copy_bw = None
    if "hbm" in modes and on_cuda:  # before the engine takes 85% of the memory
        copy_bw = copy_bandwidth(torch, args.device, 2 << 30)
        ctx["copy_bw"] = copy_bw
        log(f"device copy bandwidth {copy_bw / 1e12:.3f} TB/s")

    kw = dict(model_path=args.model, device=args.device,
              dtype=args.dtype or ("bfloat16" if on_cuda else "float32"), load_format="dummy",
              enable_radix_cache=not args.no_radix_cache, schedule_policy="lpm",
              max_total_tokens=None if on_cuda else 32768, max_running_requests=256,
              max_prefill_tokens=8192, enable_cuda_graph=not args.no_cuda_graph,
              enable_overlap=not args.no_overlap,
              attention_backend="auto", enable_jump_forward=True)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for item in args.engine_arg:
        k, _, v = item.partition("=")
        kw[k] = _parse_value(v)
    missing = [k for k in kw if k not in fields]
    if missing:
        log(f"warning: EngineConfig has no field(s) {missing}; ignored")
    kw = {k: v for k, v in kw.items() if k in fields}
    try:
        t = time.perf_counter()
        if args.engine_process:
            from backend.engine_process import EngineProcess

            modes = [m for m in modes if m in ("offline", "online")]
            eng = ChildEngine(EngineProcess(EngineConfig(**kw)))
            ctx["torch"] = torch = None  # CUDA lives in the child: no context here
        else:
            eng = Engine(EngineConfig(**kw))
        sync(torch, args.device)
        init_s = time.perf_counter() - t
        warm_s = warmup(eng, SamplingParams, args, torch)
        gc.collect()  # as the serving processes do: what is loaded stays out of the collector
        gc.freeze()
        pool_tokens = eng.stats()["kv_tokens_total"]
        st = {"init_s": round(init_s, 2), "warmup_s": round(warm_s, 2),
              "kv_pool_tokens": pool_tokens, "engine_config": kw}
        if torch is not None:
            st["torch"] = torch.__version__
        if on_cuda and torch is not None:
            st.update(gpu=torch.cuda.get_device_name(), mem_allocated_GiB=round(torch.cuda.memory_allocated() / 2**30, 2),
                      mem_reserved_GiB=round(torch.cuda.memory_reserved() / 2**30, 2))
        rec.write("startup", "engine", st)
        log(f"engine ready: init {init_s:.1f}s, warmup {warm_s:.1f}s, KV pool {pool_tokens} tokens")
    except Exception as exc:  # noqa: BLE001
        rec.write("startup", "engine", status="error", error=C.error_text(exc))
        return 1
    ctx["eng"] = eng
    for mode in modes:
        if mode not in MODES:
            log(f"unknown mode {mode}; known: {sorted(MODES)}")
            continue
        t = time.perf_counter()
        log(f"mode {mode}: start ({budget.left():.0f}s of budget left)")
        try:
            MODES[mode](ctx)
        except Exception as exc:  # noqa: BLE001
            rec.write(mode, "all", status="error", error=C.error_text(exc))
        log(f"mode {mode}: {time.perf_counter() - t:.1f}s")
        gc.collect()
    if isinstance(eng, ChildEngine):
        eng.proc.close()
    log(f"bench_engine done in {budget.elapsed():.1f}s")
    return 0


def _parse_value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


if __name__ == "__main__":
    sys.exit(main())
