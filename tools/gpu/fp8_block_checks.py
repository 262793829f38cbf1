"""Block-scaled FP8 (backend/core/kernels/fp8_block_gemm.py, layers/fp8_block_linear.py)
on the GPU, the ``block`` part of ``check_fp8.py``:

* correctness: ``group_quant`` gives the bytes and scales of its torch form
  ``quantize_groups`` exactly (both divide with IEEE rounding and clamp before the
  cast); ``block_gemm`` matches dequantize-then-matmul in float32 for Llama-3.1-8B's four
  projections at 3, 32, 128 and 1024 rows and for shapes that fit no block (partial
  blocks, 1-row blocks, a bias), bf16 out (bound: 2 bf16 ulps of the output plus 2^-16
  of sum |x||w|); ``Fp8BlockLinear`` with ``fuse_rows`` at 1-2 rows (weight-only
  kernels) and at 3 (W8A8) against its dequantized weight;
* time of each 8B projection at 1, 32, 128 and 1024 rows, activation quantization
  included, each call streaming its weights from HBM (copies totalling over 4x the L2,
  replayed in a CUDA graph): bf16 ``F.linear``, ``Fp8Linear`` (per-channel) and
  ``Fp8BlockLinear``, as the runner sets them (``fuse_rows``);
* a tile sweep of ``block_gemm`` at 32, 128 and 1024 rows: ``default_config``'s choice
  among the others, fastest first.

    python3 tools/gpu/check_fp8.py --out $OUT --parts block [--no-sweep]
"""
from __future__ import annotations

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # name: (N, K)
ODD = ((3, 200, 300, (128, 128), False), (33, 130, 257, (1, 128), True),
       (130, 1000, 520, (128, 128), True))  # (M, N, K, block, bias)
CHECKED_ROWS = (3, 32, 128, 1024)
TIMED_ROWS = (1, 32, 128, 1024)
SWEEP_ROWS = (32, 128, 1024)
# (BLOCK_M, BLOCK_N, GROUP_M, warps, stages), each tried where its row tile is no
# taller than twice the batch (``_sweep_configs``)
SWEEP = [(bm, bn, 8, w, s) for bm in (16, 32, 64, 128) for bn in (32, 64, 128)
         for w in (4, 8) for s in (3, 4)]


def _sweep_configs(m: int, default) -> list[tuple]:
    """The default config first, then the sweep's that fit ``m`` rows."""
    fits = [c for c in SWEEP if c[0] <= max(16, 2 * m) and (m < 512 or c[0] >= 64)]
    return list(dict.fromkeys([tuple(default), *fits]))


def check_block(device: str, sweep: bool = True) -> dict:
    """The checks, timings and sweep above, as a dict (``ok``: no check failed)."""
    import torch

    with torch.no_grad():
        out = {"errors": {}, "timing": {}, "sweep": {}, "failures": []}
        _check_kernels(device, out)
        _check_layer(device, out)
        _time(device, out, sweep)
    out["ok"] = not out["failures"]
    return out


def _operands(m, n, k, block, bias, gen, device):
    """(xq, x_scale, wq, w_scale, bias, float32 reference of the product)."""
    import torch
    import torch.nn.functional as F

    from backend.core.kernels.fp8_block_gemm import group_quant
    from backend.core.layers.fp8_block_linear import dequantize_blocks, quantize_blocks

    w = torch.randn(n, k, generator=gen, device=device) * k ** -0.5
    w[: n // 2] *= 0.05  # blocks of different ranges
    wq, w_scale = quantize_blocks(w, block)
    x = (torch.randn(m, k, generator=gen, device=device) * 2).to(torch.bfloat16)
    xq, x_scale = group_quant(x, block[1])
    b = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if bias else None
    xd, wd = dequantize_blocks(xq, x_scale, (1, block[1])), dequantize_blocks(wq, w_scale, block)
    ref = F.linear(xd, wd, None if b is None else b.float())
    return xq, x_scale, wq, w_scale, b, ref, (xd.abs() @ wd.abs().T)


def _check_kernels(device, out) -> None:
    import torch

    from backend.core.kernels.fp8_block_gemm import block_gemm, group_quant
    from backend.core.layers.fp8_block_linear import quantize_groups

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(37, 5000, generator=gen, device=device).to(torch.bfloat16) * 3
    x[0, :64] *= 1e3
    q, s = group_quant(x, 128)
    want_q, want_s = quantize_groups(x, 128)
    bytes_differ = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
    scales_differ = int((s != want_s).sum())
    out["group_quant"] = {"bytes_differ": bytes_differ, "scales_differ": scales_differ,
                          "values": q.numel()}
    if bytes_differ or scales_differ:
        out["failures"].append(f"group_quant differs from quantize_groups: {bytes_differ} "
                               f"of {q.numel()} bytes, {scales_differ} scales")
    cases = [(m, n, k, (128, 128), False) for n, k in SHAPES.values() for m in CHECKED_ROWS]
    for m, n, k, block, bias in cases + list(ODD):
        xq, x_scale, wq, w_scale, b, ref, magnitude = _operands(m, n, k, block, bias, gen, device)
        got = block_gemm(xq, x_scale, wq, w_scale, block[0], block[1], torch.bfloat16, b)
        diff = (got.float() - ref).abs()
        bound = 2 * 2.0 ** -8 * ref.abs() + 2.0 ** -16 * magnitude + 1e-3
        key = f"gemm/m{m}/n{n}/k{k}/b{block[0]}x{block[1]}{'/bias' if bias else ''}"
        out["errors"][key] = round(float(diff.max() / ref.abs().max()), 6)
        if (diff > bound).any():
            out["failures"].append(f"{key}: max diff {diff.max().item():.4g}")
    print("fp8 block kernels:", out["failures"] or "ok", flush=True)


def _check_layer(device, out) -> None:
    """The layer as the runner sets it up: weight-only up to ``WEIGHT_ONLY_ROWS``, W8A8 above."""
    import torch
    import torch.nn.functional as F

    from backend.core.layers.fp8_block_linear import WEIGHT_ONLY_ROWS, Fp8BlockLinear

    gen = torch.Generator(device=device).manual_seed(1)
    lin = torch.nn.Linear(4096, 6144, bias=False, device=device, dtype=torch.bfloat16)
    layer = Fp8BlockLinear.from_linear(lin)
    layer.fuse_rows = True
    for rows in (1, 2, 3):
        x = torch.randn(rows, 4096, generator=gen, device=device).to(torch.bfloat16)
        ref = F.linear(x.float(), layer.dequantized())
        got = layer(x).float()
        err = float((got - ref).abs().max() / ref.abs().max())
        out["errors"][f"layer/m{rows}"] = round(err, 6)
        # weight-only: bf16 rounding of the output; W8A8: the activations' float8 rounding
        if err > (0.01 if rows <= WEIGHT_ONLY_ROWS else 0.08):
            out["failures"].append(f"layer m={rows}: relative error {err:.4g}")


def _time(device, out, sweep: bool) -> None:
    import torch
    import torch.nn.functional as F

    from backend.core.kernels.fp8_block_gemm import (GemmConfig, block_gemm, default_config,
                                                     group_quant)
    from backend.core.layers.fp8_block_linear import Fp8BlockLinear
    from backend.core.layers.fp8_linear import Fp8Linear
    from tools.check_gemv_gpu import time_graph

    gen = torch.Generator(device=device).manual_seed(2)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-4 * l2 // (n * k)))  # float8 bytes; bf16 streams twice as many
        linears = [torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
                   for _ in range(copies)]
        channel = [Fp8Linear.from_linear(lin) for lin in linears]
        block = [Fp8BlockLinear.from_linear(lin) for lin in linears]
        for layer in channel + block:
            layer.fuse_rows = True
        for m in TIMED_ROWS:
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            t = {"bf16_us": time_graph([lambda w=lin.weight: F.linear(x, w) for lin in linears]),
                 "fp8_channel_us": time_graph([lambda lay=lay: lay(x) for lay in channel]),
                 "fp8_block_us": time_graph([lambda lay=lay: lay(x) for lay in block])}
            t = {key: round(v * 1e6, 2) for key, v in t.items()}
            t["block_vs_bf16"] = round(t["bf16_us"] / t["fp8_block_us"], 3)
            t["block_vs_channel"] = round(t["fp8_channel_us"] / t["fp8_block_us"], 3)
            out["timing"][f"{name}/m{m}"] = t
            print(f"fp8 block {name} m={m}: {t}", flush=True)
        if sweep:
            for m in SWEEP_ROWS:
                x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
                xq, x_scale = group_quant(x, 128)
                grid = []
                for config in _sweep_configs(m, default_config(m, n)):
                    try:
                        us = time_graph([lambda lay=lay, c=config: block_gemm(
                            xq, x_scale, lay.weight, lay.weight_scale, 128, 128,
                            torch.bfloat16, config=GemmConfig(*c)) for lay in block]) * 1e6
                    except Exception as exc:  # noqa: BLE001 - a config may not compile
                        print(f"   config {config}: {type(exc).__name__}", flush=True)
                        continue
                    grid.append([list(config), round(us, 2)])
                grid.sort(key=lambda g: g[1])
                default = next((us for c, us in grid
                                if tuple(c) == tuple(default_config(m, n))), None)
                out["sweep"][f"{name}/m{m}"] = {"default_us": default, "fastest": grid[:5]}
                print(f"fp8 block sweep {name} m={m}: default {default} us, fastest "
                      f"{grid[:3]}", flush=True)
        del linears, channel, block
        torch.cuda.empty_cache()
