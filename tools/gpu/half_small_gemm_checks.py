"""The few-row bf16 products (``half_small_gemm`` in backend/core/kernels/small_gemm.py) on
the GPU, against ``F.linear`` (cuBLAS).

For each projection of the Llama-3.1-8B and Llama-3.2-1B shapes and each batch size in
``--rows``: checks the kernel against the float32 product of the same bf16 operands, then
times, in microseconds a projection, ``F.linear`` and the kernel with the default tiles
and with the best tiles of a sweep. Each timing runs the product over enough copies of
the weight to exceed twice the L2 cache, so that a weight comes from HBM as in a decode
step (one copy would stay in L2 for the projections under 50 MB). Prints a table; writes
``$OUT/half_small_gemm.json``; exits 1 if a check fails.

    python3 tools/gpu/half_small_gemm_checks.py --out $OUT [--rows 2,8,16,32,64,128] [--budget-s 240]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from backend.core.kernels.small_gemm import (SmallGemmTiles, choose_half_tiles,  # noqa: E402
                                             half_small_gemm)

SHAPES = {"8b/qkv": (6144, 4096), "8b/o": (4096, 4096), "8b/gate_up": (28672, 4096),
          "8b/down": (4096, 14336), "8b/lm_head": (128256, 4096),
          "1b/qkv": (3072, 2048), "1b/o": (2048, 2048), "1b/gate_up": (16384, 2048),
          "1b/down": (2048, 8192)}
L2_FLUSH_BYTES = 120e6  # the copies of one weight a timing cycles through add up to this


def sweep_tiles(rows: int) -> list[SmallGemmTiles]:
    block_ms = sorted({choose_half_tiles(rows).block_m, min(128, max(16, rows))})
    return [SmallGemmTiles(bn, bm, bk, w, s) for bn, bm, bk, w, s in itertools.product(
        (32, 64, 128), block_ms, (64, 128), (4,), (3, 4, 5))]


def _us(fn, copies: int) -> float:
    """GPU time of one product, replayed in a CUDA graph as the engine's decode runs it."""
    return 1000.0 * do_bench_cudagraph(fn, rep=20) / copies


def run(shapes: dict, rows_list, budget_s: float) -> tuple[dict, list[str]]:
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    failures, table = [], {}
    per_case_s = budget_s / (len(shapes) * len(rows_list))
    for name, (n, k) in shapes.items():
        copies = max(1, int(-(-L2_FLUSH_BYTES // (2 * n * k))))
        ws = [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) / k ** 0.5
              for _ in range(copies)]
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, generator=gen, dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().T
            got = half_small_gemm(x, ws[0])
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 0.01:  # bf16 output rounding is 0.4% of the largest value
                failures.append(f"{name} rows {rows}: relative error {err:.4f}")

            def cublas():
                for w in ws:
                    F.linear(x, w)

            def ours(t=None):
                for w in ws:
                    half_small_gemm(x, w, tiles=t)

            row = {"cublas": _us(cublas, copies), "default": _us(ours, copies)}
            deadline = time.time() + per_case_s
            best = (row["default"], choose_half_tiles(rows))
            for t in sweep_tiles(rows):
                if time.time() > deadline:
                    break
                try:
                    us = _us(lambda: ours(t), copies)
                except Exception as exc:  # a tile that does not compile (shared memory)
                    print(f"skip {t}: {type(exc).__name__}", flush=True)
                    continue
                if us < best[0]:
                    best = (us, t)
            row.update(best=best[0], best_tiles=best[1]._asdict(), weight_mb=2 * n * k / 1e6,
                       copies=copies)
            table[f"{name}/{rows}"] = row
            print(f"{name:12s} rows {rows:4d}: cublas {row['cublas']:7.1f}  ours {row['default']:7.1f}"
                  f"/{row['best']:7.1f} ({row['cublas'] / row['best']:.2f}x)  "
                  f"best tiles {tuple(row['best_tiles'].values())}", flush=True)
    return table, failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rows", default="2,8,16,32,64,128")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated SHAPES keys")
    args = ap.parse_args()
    shapes = {key: SHAPES[key] for key in args.shapes.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    table, failures = run(shapes, rows, args.budget_s)
    out = {"device": torch.cuda.get_device_name(), "us": table, "failures": failures}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "half_small_gemm.json").write_text(json.dumps(out, indent=1))
    print("FAILURES:" if failures else "ALL OK", *failures, sep="\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
