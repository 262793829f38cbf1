"""The weight-only FP8 matrix-vector kernels (backend/core/kernels/fp8_gemv.py) on the
GPU, the ``gemv`` part of ``check_fp8.py`` (and of its ``kernels`` part):

* correctness: the four projections of Llama-3.1-8B with their prologues (RMSNorm +
  residual before qkv and gate_up, SiLU-and-mul before down), 1, 2 and the timed rows,
  per-channel and 128x128 block scales, against the torch modules followed by
  ``F.linear`` with the dequantized float32 weight (bf16 bound: 2 ulps of the output
  plus 1% of the row's largest output, as tools/check_gemv_gpu.py); the new residual
  bit for bit; and each default launch repeated (``REPEATS`` times, with the layer's
  split-K counters) giving the same bits with the counters back at zero, which a race
  between a tile's K slices would break;
* time of each projection at ``rows`` (1, 2, 4, 8 rows), prologue included, against
  what runs otherwise: bf16 (the bf16 GEMV at 1 row, the fused norm or SiLU-and-mul
  then cuBLAS above) and W8A8 (the same prologue, then the per-token quantization and
  ``_scaled_mm``), each call streaming its weights from HBM (copies totalling over 4x
  the L2 cache, replayed in a CUDA graph); the FP8 kernel with ``choose_tiles``' tiles
  and, at 1 and 2 rows, with the split-K alternative (``split_k_tiles``), with
  the bandwidth each reaches (GB/s and share of a device-to-device copy's) and the time
  recorded for the kernel before split K (docs/benchmarks/fp8_gemv_gpu.json, ``before_us``);
* a tile sweep at 1 and 2 rows, those of them timed (per-channel scales): ``SWEEP`` and
  the rule's choice, fastest first.
"""
from __future__ import annotations

import json
from pathlib import Path

SHAPES = {  # name: (prologue, N, K)
    "qkv": ("norm", 6144, 4096), "o": ("plain", 4096, 4096),
    "gate_up": ("norm", 28672, 4096), "down": ("silu", 4096, 14336),
}
BLOCK = 128
TIMED_ROWS = (1, 2, 4, 8)  # where weight-only stops beating W8A8 sets WEIGHT_ONLY_ROWS
CHECKED_ROWS = (1, 2)  # and every row count timed
REPEATS = 30
BEFORE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "fp8_gemv_gpu.json"
# (BLOCK_N, BLOCK_K, warps, split, stages[, persist]): stages - 1 chunks ahead through
# shared memory; persist > 0: whole rows, that many programs an SM streaming tiles
# (fp8_gemv_stream.py). Split 0 stands for the rule's split of that shape with these
# tiles. First the one-program-a-tile tilings (whole rows where BLOCK_K >= K), then the
# streaming ones (16384 columns: the down projection's whole rows), then split K.
SWEEP = ((8, 4096, 8, 1, 1), (4, 4096, 8, 1, 1), (4, 4096, 4, 1, 1), (8, 2048, 8, 1, 1),
         (8, 4096, 8, 1, 1, 2), (8, 4096, 8, 1, 2, 2), (4, 4096, 8, 1, 1, 4),
         (4, 4096, 8, 1, 2, 4), (4, 4096, 4, 1, 1, 6), (4, 4096, 4, 1, 2, 4),
         (2, 4096, 4, 1, 1, 8),
         (2, 16384, 16, 1, 1, 1), (2, 16384, 16, 1, 2, 1), (2, 16384, 8, 1, 1, 2),
         (1, 16384, 8, 1, 1, 2), (1, 16384, 8, 1, 2, 2), (16, 1024, 4, 0, 3))


def _sweep_tiles(n: int, k: int, rows: int):
    """The default tiles, the split-K alternative, then ``SWEEP`` (split 0: the split
    that fills one round of resident programs), each once."""
    import triton

    from backend.core.kernels.fp8_gemv_tiles import (GemvTiles, choose_tiles, filling_split,
                                                     split_k_tiles)

    out = [choose_tiles(n, k, rows), split_k_tiles(n, k, rows)]
    for block_n, block_k, warps, split, stages, *persist in SWEEP:
        if block_k > max(triton.next_power_of_2(k), 4096) or (persist and block_k < k):
            continue  # whole rows padded past the next power of two, or not whole rows
        split = split or filling_split(n, k, block_n, block_k, rows)
        out.append(GemvTiles(block_n, block_k, warps, split, stages, *persist))
    return list(dict.fromkeys(out))


def _quantize(w, block):
    """(float8 weight, float32 scales, dequantized float32 weight) of a bf16 weight."""
    import torch

    from backend.core.fp8 import quantize_rows
    from backend.core.loaders.fp8_checkpoint import dequantize

    if not block:
        q, s = quantize_rows(w)
        return q, s.view(-1).contiguous(), q.float() * s
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, device=w.device)
    padded[:n, :k] = w.float().abs()
    s = (padded.view(nb, block, kb, block).amax((1, 3)) / 448).clamp(min=1e-12)
    full = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, dequantize(q, s, (block, block))


class _Case:
    """One projection's inputs and the ways to run it."""

    def __init__(self, kind, rows, n, k, gen, device):
        import torch

        from backend.core.layers.basic import RMSNorm

        dt = torch.bfloat16
        self.kind, self.k = kind, k
        self.norm = RMSNorm(k, 1e-5).to(device, dt)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.3 * torch.randn(k, generator=gen, device=device))
        width = 2 * k if kind == "silu" else k
        self.x = (torch.randn(rows, width, generator=gen, device=device) * 2).to(dt)
        self.res = torch.randn(rows, k, generator=gen, device=device).to(dt)

    def activation(self):
        """The projection's input as the torch modules make it, and the new residual."""
        import torch.nn.functional as F

        if self.kind == "norm":
            return self.norm(self.x, self.res)
        if self.kind == "silu":
            gate, up = self.x.split(self.k, dim=-1)
            return F.silu(gate) * up, None
        return self.x, None

    def fp8(self, q, s, block, counters, config=None):
        """The FP8 kernel, with a layer's split-K counters (zero between calls)."""
        from functools import partial

        from backend.core.kernels import fp8_gemv as g

        nw, opts = self.norm.weight, dict(block=block, config=config, counters=counters)
        if self.kind == "norm":
            return partial(g.fp8_rmsnorm_linear_rows, self.x, self.res, nw, 1e-5, q, s, **opts)
        if self.kind == "silu":
            return partial(g.fp8_silu_mul_linear_rows, self.x, q, s, **opts)
        return partial(g.fp8_linear_rows, self.x, q, s, **opts)

    def prologue(self):
        """The prologue as its own fused launch (what precedes cuBLAS or W8A8)."""
        from backend.core.kernels.fused import fused_add_rmsnorm, silu_and_mul

        if self.kind == "norm":
            return lambda: fused_add_rmsnorm(self.x, self.res, self.norm.weight, 1e-5)[0]
        if self.kind == "silu":
            return lambda: silu_and_mul(self.x)
        return lambda: self.x

    def bf16(self, w):
        import torch.nn.functional as F

        from backend.core.kernels import gemv

        if self.x.shape[0] > gemv.MAX_ROWS:
            before = self.prologue()
            return lambda: F.linear(before(), w)
        if self.kind == "norm":
            return lambda: gemv.rmsnorm_linear_rows(self.x, self.res, self.norm.weight, 1e-5, w)
        if self.kind == "silu":
            return lambda: gemv.silu_mul_linear_rows(self.x, w)
        return lambda: gemv.linear_rows(self.x, w)

    def w8a8(self, layer):
        before = self.prologue()
        return lambda: layer(before())


def check_gemv(device: str, sweep: bool = True, rows=TIMED_ROWS) -> dict:
    """The checks, timings and sweep above, as a dict (``ok``: no check failed)."""
    import torch

    with torch.no_grad():
        return _check_gemv(device, sweep, tuple(rows))


def _check_gemv(device: str, sweep: bool, timed_rows: tuple[int, ...]) -> dict:
    import torch

    from backend.core.kernels.fp8_gemv import tile_counters
    from backend.core.kernels.fp8_gemv_tiles import choose_tiles, split_k_tiles
    from backend.core.layers.fp8_linear import Fp8Linear
    from benchmarks.gpu.bench_engine import copy_bandwidth

    gen = torch.Generator(device=device).manual_seed(0)
    bw = copy_bandwidth(torch, device, 1 << 30)
    before = (json.loads(BEFORE.read_text())["kernels"]["fp8_gemv"]["timing"]
              if BEFORE.exists() else {})
    out = {"copy_bw_TBps": round(bw / 1e12, 3), "errors": {}, "timing": {}, "sweep": {},
           "failures": []}
    print(f"fp8 gemv: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name, (kind, n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(torch.bfloat16)
        counters = tile_counters(n, device)
        for block in (0, BLOCK):
            q, s, deq = _quantize(w, block)
            for rows in sorted(set(CHECKED_ROWS) | set(timed_rows)):
                key = f"{name}/{'block' if block else 'channel'}/m{rows}"
                case = _Case(kind, rows, n, k, gen, device)
                err, failures = _check_one(case, case.fp8(q, s, block, counters), deq, counters)
                out["errors"][key] = err
                out["failures"] += [f"{key}: {f}" for f in failures]
        ws, layers = _copies(w, Fp8Linear, torch, device)
        for rows in timed_rows:
            case = _Case(kind, rows, n, k, gen, device)
            tiles = choose_tiles(n, k, rows)
            t = {"bf16_us": _time([case.bf16(x) for x in ws]),
                 "w8a8_us": _time([case.w8a8(lay) for lay in layers]),
                 "fp8_gemv_us": _time(_fp8_calls(case, layers, tiles))}
            if rows <= 2:
                t["split_k_us"] = _time(_fp8_calls(case, layers, split_k_tiles(n, k, rows)))
            if f"{name}/m{rows}" in before:
                t["before_us"] = before[f"{name}/m{rows}"]["fp8_gemv_us"]
            for key in [key for key in t if key.startswith(("fp8", "split_k", "before"))]:
                t[key.replace("_us", "_GBps")] = round(n * k / (t[key] * 1e-6) / 1e9, 1)
            t["fp8_gemv_hbm"] = round(n * k / (t["fp8_gemv_us"] * 1e-6) / bw, 3)
            t["vs_bf16"] = round(t["bf16_us"] / t["fp8_gemv_us"], 3)
            t["vs_w8a8"] = round(t["w8a8_us"] / t["fp8_gemv_us"], 3)
            t["tiles"] = list(tiles)
            out["timing"][f"{name}/m{rows}"] = t
            print(f"fp8 gemv {name} m={rows}: {t}", flush=True)
        for rows in [r for r in (1, 2) if r in timed_rows] if sweep else ():
            case = _Case(kind, rows, n, k, gen, device)
            grid = []
            for tiles in _sweep_tiles(n, k, rows):
                try:
                    grid.append([list(tiles), _time(_fp8_calls(case, layers, tiles))])
                except Exception as exc:  # noqa: BLE001 - a tiling may not compile
                    print(f"   tiles {tuple(tiles)}: {type(exc).__name__}", flush=True)
            grid.sort(key=lambda g: g[1])
            out["sweep"][f"{name}/m{rows}"] = grid
            print(f"fp8 gemv sweep {name} m={rows} (BLOCK_N, BLOCK_K, warps, split, stages) "
                  f"us: {grid[:4]}; rule {list(choose_tiles(n, k, rows))}", flush=True)
        del ws, layers
        torch.cuda.empty_cache()
    out["ok"] = not out["failures"]
    _print_table(out["timing"])
    return out


def _print_table(timing: dict) -> None:
    """One line a projection and row count: the time recorded on the H200 before split
    K (another machine instance, so no ratio is taken with it), the split-K tiles and the
    rule's tiles of this call (µs and GB/s), HBM share and speed-up on bf16."""
    print("fp8 gemv    before_us  split_k_us  rule_us  rule_GBps  hbm  vs_bf16")
    for key, t in timing.items():
        print(f"{key:12s}{t.get('before_us', '-'):>9}  {t.get('split_k_us', '-'):>10}"
              f"  {t['fp8_gemv_us']:>6}  {t['fp8_gemv_GBps']:>8}  {t['fp8_gemv_hbm']:>4}"
              f"  {t['vs_bf16']:>7}", flush=True)


def _check_one(case, call, deq, counters) -> tuple[float, list[str]]:
    """(max error / max |output|, failures) of one launch against the torch reference;
    then the same launch ``REPEATS`` times: the same bits each time, counters at zero."""
    import torch
    import torch.nn.functional as F

    act, ref_res = case.activation()
    ref = F.linear(act.float(), deq)
    got = call()
    got, got_res = got if isinstance(got, tuple) else (got, None)
    diff = (got.float() - ref).abs()
    bound = 2 * 2.0 ** -7 * ref.abs() + 1e-2 * ref.abs().amax(1, keepdim=True)
    failures = [f"max diff {diff.max().item():.4g}"] if (diff > bound).any() else []
    if ref_res is not None and not torch.equal(got_res, ref_res):
        failures.append("residual differs")
    for _ in range(REPEATS):
        again = call()
        if not torch.equal(again[0] if isinstance(again, tuple) else again, got):
            failures.append("a repeated launch gave other bits")
            break
    if counters.any():
        failures.append("split-K counters not zero after the launches")
    return round(float(diff.max() / ref.abs().max()), 6), failures


def _copies(w, fp8_linear, torch, device) -> tuple[list, list]:
    """(copies of ``w``, their FP8 layers): over 4x the L2 cache in float8 (bf16 streams
    twice the bytes), so each timed call reads its weight from HBM."""
    n, k = w.shape
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    ws = [w] + [w.clone() for _ in range(max(2, -(-4 * l2 // (n * k))) - 1)]
    return ws, [fp8_linear.from_linear(_as_linear(x)) for x in ws]


def _fp8_calls(case, layers, tiles) -> list:
    return [case.fp8(lay.weight, lay.weight_scale, 0, lay.tile_counters, tiles)
            for lay in layers]


def _time(fns) -> float:
    from tools.check_gemv_gpu import time_graph

    return round(time_graph(fns) * 1e6, 2)


def _as_linear(weight):
    import torch

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                             device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear
