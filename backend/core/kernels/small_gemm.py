"""Products of a few dozen rows (batched decode): tensor cores with the operands swapped.

A decode batch of 2 to 128 rows fills a sliver of each tile that GEMM libraries make for
many rows: ``torch._scaled_mm`` with row-wise scales reaches about a fifth of the HBM
bandwidth at 1 to 32 rows (the 8B qkv projection: 23.8 us for 25 MB on an H200), and
bf16 ``F.linear`` leaves part of the SMs idle on the narrow projections (64 to 96 tiles
for 132 SMs). Here the weight is the tensor core's M side instead (``y^T = W x^T``): a
program takes BLOCK_N output channels (64 fill a warpgroup's MMA) by all of the batch's
rows (BLOCK_M: 16 to 128, the MMA's N side, which may be small), streams its BLOCK_N x K
weight strip through shared memory, and finishes in its epilogue.

Two forms share the kernel:

- W8A8 (``small_gemm``): float8 rows as ``fp8_quant.per_token_quant`` makes them (one
  scale a row) by a float8 weight with a scale per output channel,
  ``y[t, n] = (sum_k xq[t, k] * wq[n, k]) * x_scale[t] * w_scale[n]  (+ bias[n])``.
  A weight-only form (bf16 activations, each float8 weight tile widened in registers)
  was timed slower than this on every 8B projection from 2 to 128 rows, so it is not
  kept.
- half precision (``half_small_gemm``): bf16 or fp16 rows by a weight of the same dtype,
  float32 accumulation, ``F.linear``'s result up to the order of the sums.

``tools/gpu/fp8_small_gemm_checks.py`` and ``tools/gpu/half_small_gemm_checks.py`` check
the kernel against torch on the GPU and time it against ``_scaled_mm`` and ``F.linear``
by rows and tiles.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import await_previous_kernel, prefetch_to_l2


class SmallGemmTiles(NamedTuple):
    """One launch's tiling: BLOCK_N weight rows by BLOCK_M batch rows a program, K in
    BLOCK_K chunks, ``stages`` chunks in flight, ``warps`` warps a program."""
    block_n: int = 64
    block_m: int = 32
    block_k: int = 256
    warps: int = 4
    stages: int = 5


@triton.jit
def _small_gemm_kernel(X, XScale, W, WScale, Bias, Y, M, N, K, stride_x, stride_w, stride_y,
                       HAS_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       STAGES: tl.constexpr, PDL: tl.constexpr):
    # the row tiles of one weight strip are adjacent programs (axis 0 runs fastest), so
    # past BLOCK_M rows the strip's second read finds it in L2 instead of HBM
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    # rows past N or M read row 0 (in bounds) and are never stored: no mask in the loop
    w_ptrs = W + tl.where(nmask, rn, 0).to(tl.int64)[:, None] * stride_w + rk[None, :]
    x_ptrs = X + tl.where(mmask, rm, 0).to(tl.int64)[None, :] * stride_x + rk[:, None]
    if PDL:  # launched early (pdl.py): the chunks the pipeline's prologue will copy go
        # to L2 while the previous kernel ends; X and XScale are its output, read after
        for s in tl.static_range(STAGES - 1):
            prefetch_to_l2(W, rn, N, s * BLOCK_K, K, stride_w, BLOCK_N, BLOCK_K)
        await_previous_kernel()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            kmask = rk + k0 < K
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=kmask[:, None], other=0.0)
        # Hopper's float8 MMA adds into a narrower accumulator: a float32 add each chunk
        # keeps the down projection's 14336-term sums within bf16 rounding
        acc += tl.dot(w, x)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_SCALES:
        acc = acc * tl.load(WScale + rn, mask=nmask, other=0.0)[:, None]
        acc = acc * tl.load(XScale + rm, mask=mmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(Bias + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
    y_ptrs = Y + rm.to(tl.int64)[None, :] * stride_y + rn[:, None]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


def choose_tiles(rows: int) -> SmallGemmTiles:
    """The default W8A8 tiling for ``rows`` batch rows: all rows in one program up to 64
    (the tiles most often fastest in the H100 sweep of 2 to 128 rows)."""
    block_m = min(max(16, triton.next_power_of_2(rows)), 64)
    return SmallGemmTiles(block_m=block_m)


def choose_half_tiles(rows: int) -> SmallGemmTiles:
    """The default half-precision tiling: as W8A8's, with chunks of the same bytes (128
    bf16 columns are 256 float8 ones)."""
    return choose_tiles(rows)._replace(block_k=128)


def small_gemm(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
               w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
               tiles: SmallGemmTiles | None = None) -> torch.Tensor:
    """``y [M, N]`` in ``out_dtype`` from float8 x [M, K] with ``x_scale`` [M, 1], float8
    weight [N, K] with ``w_scale`` [N] or [1, N] (float32), and ``bias`` [N] (any float
    dtype, added in float32 before the one rounding). Both operands need unit stride on K."""
    assert x.dtype == weight.dtype and x_scale.numel() == x.shape[0], "float8 rows, a scale each"
    return _launch(x, x_scale, weight, w_scale.reshape(-1), bias, out_dtype,
                   tiles or choose_tiles(x.shape[0]))


def half_small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None,
                    tiles: SmallGemmTiles | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bf16 or fp16 x [M, K] and weight [N, K] of the
    same dtype, accumulated in float32 and rounded once to ``out_dtype`` (default: x's).
    Both operands need unit stride on K."""
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16), \
        "half-precision rows and weight of one dtype"
    return _launch(x, None, weight, None, bias, out_dtype or x.dtype,
                   tiles or choose_half_tiles(x.shape[0]))


def _launch(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor,
            w_scale: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
            t: SmallGemmTiles) -> torch.Tensor:
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    if rows == 0:
        return y
    grid = (triton.cdiv(rows, t.block_m), triton.cdiv(n, t.block_n))
    early = pdl.dependent_launch(x.device, pdl.FEW_ROW_GEMM)
    scales = x_scale is not None
    placeholder = weight  # never read: HAS_SCALES / HAS_BIAS are off where it stands in
    _small_gemm_kernel[grid](
        x, x_scale if scales else placeholder, weight, w_scale if scales else placeholder,
        bias if bias is not None else placeholder, y, rows, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_SCALES=scales, HAS_BIAS=bias is not None, EVEN_K=k % t.block_k == 0,
        BLOCK_N=t.block_n, BLOCK_M=t.block_m, BLOCK_K=t.block_k, STAGES=t.stages, PDL=early,
        num_warps=t.warps, num_stages=t.stages, launch_pdl=early)
    return y
