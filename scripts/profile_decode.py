"""Where a decode step's host time goes: cProfile over decode steps on a CUDA GPU.

    python scripts/profile_decode.py --tokenizer DIR [--shape 1b] [--batch 1 64]

Also times the graph replay alone (device time per step), the floor the host must hide.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backend.core import SamplingParams  # noqa: E402
from gpu_smoke import engine, make_shape_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--overlap", type=int, default=1)
    args = ap.parse_args()
    eng = engine(make_shape_dir(args.shape, args.tokenizer), enable_overlap=bool(args.overlap))
    for b in args.batch:
        for i in range(b):
            eng.add_request([100 + i + j for j in range(32)],
                            SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True))
        for _ in range(20):
            eng.step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(100):
            eng.step()
        torch.cuda.synchronize()
        prof.disable()
        dt = (time.perf_counter() - t) / 100
        graphs = eng.runner.graphs
        size = [s for s in graphs.sizes if s >= b][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graphs.graphs[size].replay()
        end.record()
        torch.cuda.synchronize()
        print(f"\n=== batch {b}: {dt * 1000:.2f} ms/step wall, graph replay {start.elapsed_time(end) / 50:.2f} ms")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        for rid in list(eng._groups):
            eng.abort(rid)
        while eng.has_work():
            eng.step()


if __name__ == "__main__":
    main()
