"""The FP8 matrix-vector product with whole rows of K, each program streaming several
tiles: the variant of ``fp8_gemv.py``'s whole-row path for grids larger than one round of
resident programs.

With one program a tile, a program requests its tile, waits for it, computes and stores;
the SM's next tile is only requested once a program ends, and every program computes
its input rows (the norm or SiLU-and-mul prologue, from L2) again. Here a grid of a few
programs an SM walks the tiles (``t = pid, pid + programs, ...``): the input rows are
computed once a program, and with ``STAGES`` > 1 the next tile is copied into shared
memory (Triton's async copies) while the current one is summed:

    grid (programs,); program p: xs = the input rows after the prologue
      for t = p, p + programs, ... < n_tiles:
        Out[rows, t*BLOCK_N : (t+1)*BLOCK_N] = sum over K of w(t) * xs   (scale, bias)

A tile carried to the next iteration in registers instead took a register a byte of
float8 (174 a thread at 8 x 4096, one program an SM). At one row each tile's sums are
those of the one-program-a-tile kernel with the same BLOCK_N, BLOCK_K and warps (the
same reduction over the same layout). ``programs_for`` balances the grid: every program
gets the same number of tiles, or one fewer.

Measured on an H100 (docs/benchmarks/fp8.md): only the 8B qkv projection gains (12.8 ->
12.0 µs at one row), so the default tiles (``choose_tiles``) do not stream; the tile
sweep of tools/gpu/fp8_gemv_checks.py times it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv import _input_chunk, _normalise


def programs_for(n_tiles: int, per_sm: int, sms: int) -> int:
    """The grid for ``n_tiles`` tiles and ``per_sm`` programs an SM: as many programs as
    split the tiles evenly within ``per_sm * sms`` (at most one tile more for some)."""
    per_program = triton.cdiv(n_tiles, max(1, per_sm * sms))
    return triton.cdiv(n_tiles, per_program)


@triton.jit
def _store_out(acc, Scale, Bias, Out, rows, rn, nmask, N, ROWS: tl.constexpr,
               HAS_BIAS: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """The per-channel scale and the bias on the float32 sums [ROWS_PAD, BLOCK_N], then
    one rounding to the output dtype."""
    if SCALE_BLOCK == 0:
        acc = acc * tl.load(Scale + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rows[:, None] * N + rn[None, :], acc.to(Out.dtype.element_ty),
             mask=(rows[:, None] < ROWS) & nmask[None, :])


@triton.jit
def _tile(W, t, r0, rk, kmask, N, stride_wn, BLOCK_N: tl.constexpr):
    """Tile t of the weight, [BLOCK_N, BLOCK_K] float8 (zeros past N and K)."""
    rn = t * BLOCK_N + r0
    return tl.load(W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                   mask=(rn < N)[:, None] & kmask[None, :], other=0.0)


@triton.jit
def _fp8_gemv_stream_kernel(
    X, Res, NormW, W, Scale, Bias, Out, ResOut,
    N, K, n_tiles, stride_x, stride_r, stride_wn, stride_sn, scale_rows, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rk = tl.arange(0, BLOCK_K)
    kmask = rk < K
    r0 = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS_PAD)
    dtype = X.dtype.element_ty
    xs = tl.zeros([ROWS_PAD, BLOCK_K], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        x = _input_chunk(X + m * stride_x, Res + m * stride_r, rk, kmask, K, PROLOGUE)
        if PROLOGUE == 2:  # program 0 writes the new residual
            tl.store(ResOut + m * K + rk, x.to(dtype), mask=kmask & ((rk * 0 + pid) == 0))
        if PROLOGUE == 1 or PROLOGUE == 2:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            x = _normalise(x, NormW, rk, kmask, rstd, dtype)
        xs += tl.where(rows[:, None] == m, x[None, :], 0.0)
    # STAGES > 1: the next STAGES - 1 tiles are copied into shared memory (async copies)
    # while this one is summed; 1: each tile waited for, the SM's other programs filling
    # the wait (carried in registers instead, a float8 tile takes a register a byte)
    for t in tl.range(pid, n_tiles, programs, num_stages=STAGES):
        w = _tile(W, t, r0, rk, kmask, N, stride_wn, BLOCK_N)
        rn = t * BLOCK_N + r0
        xt = xs
        if SCALE_BLOCK > 0:  # this tile's block row of scales, on the input columns
            s_row = Scale + ((t * BLOCK_N) // scale_rows) * stride_sn
            xt = xs * tl.load(s_row + rk // SCALE_BLOCK, mask=kmask, other=0.0)[None, :]
        if ROWS == 1:  # the one-program-a-tile kernel's reduction, [BLOCK_N, BLOCK_K]
            part = tl.sum(w.to(tl.float32) * tl.sum(xt, axis=0)[None, :], axis=1)[None, :]
        else:
            part = tl.sum(w.to(tl.float32)[None, :, :] * xt[:, None, :], axis=2)
        _store_out(part, Scale, Bias, Out, rows, rn, rn < N, N, ROWS, HAS_BIAS, SCALE_BLOCK)
