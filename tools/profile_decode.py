"""Where a decode step's time goes, overlap scheduling on and off, on a CUDA GPU.

    python tools/profile_decode.py --model /tmp/shapes/llama-8b [--batch 1 32] [--out DIR]
        [--quantization fp8] [--overlap on] [--prompt-len 1056 --shared-prefix 1024]
        [--engine-arg enable_cascade_attention=false]

For each setting (overlap off, overlap on) and batch size: steady greedy decode, then
  * wall ms per step over 100 steps;
  * torch.profiler over 30 steps: device busy time per step (union of kernel intervals),
    so wall - busy is the device left idle; and the kernels by total device time;
  * cProfile of the host over the same kind of steps (top functions by own time).
Both engines live in this process with a fixed KV pool, on the same random weights.
Writes DIR/profile_decode.json and DIR/profile_decode.txt (tables) when --out is given.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.core import Engine, EngineConfig, SamplingParams  # noqa: E402


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def busy_us(events) -> float:
    """Union of device kernel/memcpy intervals (microseconds)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def fill(eng: Engine, batch: int, n_in: int, shared: int = 0) -> list[str]:
    """``batch`` greedy requests of ``n_in`` prompt tokens, decoding: distinct prompts, or
    with ``shared`` > 0 the same first ``shared`` tokens (cached first by one request, as
    the few-shot workload's untimed pass does), so that their KV slots are shared."""
    prefix = [1000 + j % 1000 for j in range(shared)]
    if shared:
        eng.add_request(prefix + [7], SamplingParams(max_new_tokens=1, temperature=0.0))
        while eng.has_work():
            eng.step()
    rids = [eng.add_request(prefix + [100 + (i * 7 + j) % 1000 for j in range(n_in - shared)],
                            SamplingParams(max_new_tokens=4096, temperature=0.0, ignore_eos=True))
            for i in range(batch)]
    for _ in range(30):
        eng.step()
    sync()
    return rids


def drain(eng: Engine, rids: list[str]) -> None:
    for rid in rids:
        eng.abort(rid)
    while eng.has_work():
        eng.step()


def device_gaps(eng: Engine, steps: int) -> dict:
    """Device time per step and device idle time between steps, from CUDA events recorded
    when a launch begins (before its first copy) and when it has been enqueued."""
    fs = eng.forward_step
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    launch = fs.launch

    def timed_launch(items):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        flight = launch(items)
        end.record()
        marks.append((start, end))
        return flight

    run_wrapped(eng, timed_launch, steps)
    busy = sorted(s.elapsed_time(e) for s, e in marks)
    gaps = sorted(marks[k][1].elapsed_time(marks[k + 1][0]) for k in range(len(marks) - 1))
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"launch_to_done_ms_p50": round(pct(busy, 0.5), 3),
            "gap_ms_mean": round(sum(gaps) / len(gaps), 3), "gap_ms_p50": round(pct(gaps, 0.5), 3),
            "gap_ms_p90": round(pct(gaps, 0.9), 3)}


def launch_syncs(eng: Engine, steps: int) -> list[str]:
    """Where a step's launch makes the host wait for the device (torch's sync debug mode
    flags each implicit synchronization): a launch that syncs cannot overlap anything.
    Returns the distinct project source lines that triggered one."""
    import warnings

    fs = eng.forward_step
    launch = fs.launch
    sites: set[str] = set()

    def checked_launch(items):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(items)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                for w in caught:  # a C++ warning points at the Python line that called in
                    if "/backend/" in w.filename:  # (torch's own notice about the mode is not one)
                        where = f"{w.filename.split('/backend/')[-1]}:{w.lineno}"
                        sites.add(f"{where}: {str(w.message).splitlines()[0][:120]}")

    run_wrapped(eng, checked_launch, steps)
    return sorted(sites)


def run_wrapped(eng: Engine, wrapped_launch, steps: int) -> None:
    """``steps`` engine steps with ``forward_step.launch`` replaced by ``wrapped_launch``."""
    fs = eng.forward_step
    launch = fs.launch
    fs.launch = wrapped_launch
    try:
        for _ in range(steps):
            eng.step()
        sync()
    finally:
        fs.launch = launch


def profile_one(eng: Engine, batch: int, n_in: int, report: list[str], shared: int = 0) -> dict:
    rids = fill(eng, batch, n_in, shared)
    gaps = device_gaps(eng, 60) if DEVICE == "cuda" else {}
    if DEVICE == "cuda":
        gaps["launch_sync_sites"] = launch_syncs(eng, 10)
    t = time.perf_counter()
    for _ in range(100):
        eng.step()
    sync()
    wall_ms = (time.perf_counter() - t) * 10

    steps = 30
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        prof_wall_ms = (time.perf_counter() - t) * 1000 / steps
    events = prof.events()
    busy_ms = busy_us(events) / 1000 / steps
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)

    cp = cProfile.Profile()
    cp.enable()
    for _ in range(steps):
        eng.step()
    sync()
    cp.disable()
    buf = io.StringIO()
    pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(16)
    drain(eng, rids)
    res = {"batch": batch, "prompt_len": n_in, "shared_prefix": shared,
           "wall_ms_per_step": round(wall_ms, 3),
           "profiled_wall_ms_per_step": round(prof_wall_ms, 3),
           "device_busy_ms_per_step": round(busy_ms, 3),
           "device_idle_fraction": round(max(0.0, 1 - busy_ms / prof_wall_ms), 3), **gaps}
    report.append(f"\n===== {json.dumps(res)}\n{table}\n--- host (cProfile, {steps} steps)\n"
                  + "\n".join(buf.getvalue().splitlines()[:40]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--kv-tokens", type=int, default=150_000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument("--quantization", default="none", help="EngineConfig.quantization (fp8, ...)")
    ap.add_argument("--overlap", choices=("off", "on", "both"), default="both")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="the first N prompt tokens the same for every request (their KV "
                         "shared through the radix cache, as in the few-shot workload)")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="extra EngineConfig field, KEY=VALUE (repeatable)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
    from bench_engine import _parse_value
    extra = {k: _parse_value(v) for k, _, v in (a.partition("=") for a in args.engine_arg)}
    assert 0 <= args.shared_prefix < args.prompt_len, "--shared-prefix must be below --prompt-len"
    global DEVICE
    DEVICE = args.device
    results, report = [], []
    overlaps = {"off": (False,), "on": (True,), "both": (False, True)}[args.overlap]
    for overlap in overlaps:
        eng = Engine(EngineConfig(model_path=args.model, device=args.device,
                                  dtype="bfloat16" if args.device == "cuda" else "float32",
                                  load_format="dummy", max_total_tokens=args.kv_tokens,
                                  max_running_requests=256, max_prefill_tokens=8192,
                                  enable_overlap=overlap, quantization=args.quantization,
                                  **extra))
        for b in args.batch:
            r = profile_one(eng, b, args.prompt_len, report, args.shared_prefix)
            r["overlap"] = overlap
            r["quantization"] = args.quantization
            r["engine_args"] = args.engine_arg
            results.append(r)
            print(json.dumps(r), flush=True)
        del eng
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    text = "\n".join(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_decode.json").write_text(json.dumps(results, indent=1))
        (out / "profile_decode.txt").write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
