"""The norm and SiLU-and-mul fused with FP8 quantization (kernels/fp8_fused_quant.py) on
the GPU, Llama-3.1-8B shape (hidden 4096, intermediate 14336), bf16.

For each batch size in ``--rows``: checks that the fused kernels write the float8 bytes,
scales and residual sums of the two launches they replace, and that an FP8 layer fed
through ``RMSNorm.linear`` / ``GatedMLP.down`` with the fusion gives the output of the
unfused path exactly; then times both forms in microseconds (CUDA graphs, as the engine's
decode replays them). Prints a table; writes ``$OUT/fp8_fused_quant.json``; exits 1 if a
check fails.

    python3 tools/gpu/fp8_fused_quant_checks.py --out $OUT [--rows 1,32,128,1024]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from backend.core.kernels.fp8_fused_quant import rmsnorm_quant, silu_mul_quant  # noqa: E402
from backend.core.kernels.fp8_quant import per_token_quant  # noqa: E402
from backend.core.kernels.fused import fused_add_rmsnorm, silu_and_mul  # noqa: E402
from backend.core.layers.basic import GatedMLP, RMSNorm  # noqa: E402
from backend.core.layers.fp8_linear import WEIGHT_ONLY_ROWS, Fp8Linear  # noqa: E402

HIDDEN, INTER, EPS = 4096, 14336, 1e-5


def _us(fn) -> float:
    return 1000.0 * do_bench_cudagraph(fn, rep=20)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _layers(dev: str):
    """An RMSNorm into an FP8 qkv-like projection and an FP8 gated MLP, fuse_rows on."""
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16 = torch.bfloat16
    norm = RMSNorm(HIDDEN, EPS).to(dev, bf16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(HIDDEN, device=dev, generator=gen, dtype=bf16))
    qkv = Fp8Linear.from_linear(torch.nn.Linear(HIDDEN, 6144, bias=False, device=dev, dtype=bf16))
    mlp = GatedMLP(HIDDEN, INTER).to(dev, bf16)
    mlp.down_proj = Fp8Linear.from_linear(mlp.down_proj)
    for module in (norm, qkv, mlp, mlp.down_proj):
        module.fuse_rows = True
    return norm, qkv, mlp


def run(rows_list) -> tuple[dict, list[str]]:
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1)
    norm, qkv, mlp = _layers(dev)
    failures, table = [], {}
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, device=dev, generator=gen, dtype=bf16)
        res = torch.randn(rows, HIDDEN, device=dev, generator=gen, dtype=bf16)
        gate_up = 3 * torch.randn(rows, 2 * INTER, device=dev, generator=gen, dtype=bf16)

        (q, s), r = rmsnorm_quant(x, res, norm.weight, EPS)
        normed, want_r = fused_add_rmsnorm(x, res, norm.weight, EPS)
        want_q, want_s = per_token_quant(normed)
        checks = {"norm_bytes": _same(q, want_q) and _same(s, want_s) and _same(r, want_r)}
        q, s = silu_mul_quant(gate_up)
        want_q, want_s = per_token_quant(silu_and_mul(gate_up))
        checks["silu_mul_bytes"] = _same(q, want_q) and _same(s, want_s)
        if rows > WEIGHT_ONLY_ROWS:  # single rows take the weight-only kernels instead
            got, _ = norm.linear(qkv, x, res)
            checks["norm_layer"] = _same(got, qkv(normed))
            checks["silu_mul_layer"] = _same(mlp.down(gate_up),
                                             mlp.down_proj(silu_and_mul(gate_up)))
        failures += [f"rows {rows}: {name}" for name, ok in checks.items() if not ok]

        row = {
            "norm_then_quant": _us(lambda: per_token_quant(fused_add_rmsnorm(x, res, norm.weight, EPS)[0])),
            "norm_quant": _us(lambda: rmsnorm_quant(x, res, norm.weight, EPS)),
            "silu_mul_then_quant": _us(lambda: per_token_quant(silu_and_mul(gate_up))),
            "silu_mul_quant": _us(lambda: silu_mul_quant(gate_up)),
            "checks": checks,
        }
        table[str(rows)] = row
        print(f"rows {rows:5d}: norm+quant {row['norm_then_quant']:6.1f} -> {row['norm_quant']:6.1f} us  "
              f"silu_mul+quant {row['silu_mul_then_quant']:6.1f} -> {row['silu_mul_quant']:6.1f} us  "
              f"checks {'ok' if all(checks.values()) else checks}", flush=True)
    return table, failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1,32,128,1024")
    args = ap.parse_args()
    table, failures = run([int(r) for r in args.rows.split(",")])
    out = {"device": torch.cuda.get_device_name(), "us": table, "failures": failures}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_fused_quant.json").write_text(json.dumps(out, indent=1))
    print("FAILURES:" if failures else "ALL OK", *failures, sep="\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
