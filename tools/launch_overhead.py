"""Host time per kernel launch on this machine: what a step that is not a CUDA graph pays
per op, before the device does anything.

    python tools/launch_overhead.py [--device cuda] [--n 2000] [--out DIR]

Times back-to-back launches (no synchronisation inside the timed loop) of:
  * a trivial @triton.jit kernel through ``kernel[grid](...)``;
  * the engine's own Triton RMSNorm (``kernels.fused.rmsnorm``) on a 32 x 2048 bf16 row block;
  * a torch elementwise add and a torch matmul of the same block (cuBLAS);
and prints microseconds per launch (host wall / launches). Writes DIR/launch_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _touch(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def per_launch_us(fn, n: int, sync) -> float:
    for _ in range(20):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    sync()
    return host / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from backend.core.kernels import fused

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(32, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, device=dev, dtype=torch.bfloat16)
    m = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    flat = torch.zeros(1024, device=dev, dtype=torch.float32)
    rows = {
        "triton trivial kernel": lambda: _touch[(1,)](flat, 1024, BLOCK=1024),
        "triton rms_norm (engine)": lambda: fused.rmsnorm(x, w, 1e-5),
        "torch add": lambda: torch.add(x, x),
        "torch matmul (cuBLAS)": lambda: torch.matmul(x, m),
    }
    results = {}
    for name, fn in rows.items():
        results[name] = round(per_launch_us(fn, args.n, sync), 2)
        print(f"{name:<28} {results[name]:>8.2f} us/launch")
    info = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "us_per_launch": results}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "launch_overhead.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
