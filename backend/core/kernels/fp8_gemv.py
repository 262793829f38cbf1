"""Weight-only FP8 matrix-vector products for the smallest decode batches (1 to 8 rows).

At batch 1 a decode step reads every weight once and does two flops per byte of bf16
weight: it is bound by the weight bytes, not by the multiplies. Float8 e4m3 weights
halve those bytes; the activations need no quantization to profit from that, so here
they stay in the model dtype and each weight is widened to float32 in registers as it
arrives (``weight * scale``, with the scale applied once per output or per block):

    y[m, n] = sum_k x[m, k] * wq[n, k] * scale(n, k)  (+ bias[n])

This spares the W8A8 path's separate per-token quantization launch and its float8 GEMM,
which is tuned for many rows, and it keeps the activations' precision (the W8A8 product
rounds each activation to 3 mantissa bits as well). The prologues of ``gemv.py`` come
along: RMSNorm (+ residual add) before the QKV and gate/up projections, SiLU-and-mul
before the down projection, recomputed by every program from the L2-resident input rows,
with the same rounding points as the torch modules.

Scales, one of two layouts:

* per output channel: ``scale`` [N] (or [1, N]), applied to each output's float32 sum;
* per block of ``block`` x ``block`` weights (128 in the published checkpoints):
  ``scale`` [ceil(N / block), ceil(K / block)]. A program's BLOCK_N rows lie inside one
  block row (BLOCK_N divides ``block``), so the scale multiplies the input chunk,
  ``x[k] * scale[n // block, k // block]``, before the products: one multiply per input
  column and program instead of one per weight.

Tiles with ``persist`` > 0 (whole rows, one slice) go to ``fp8_gemv_stream.py``, a few
programs an SM each walking several tiles. Otherwise one program computes BLOCK_N
outputs of every row over one slice of K (``split`` slices; tiles and split from
``fp8_gemv_tiles.choose_tiles``): it streams its weight chunks with the next ones in
flight and computes the input columns meanwhile; each weight chunk, once in registers,
serves all the rows. With K split, the slices of a tile meet in a float32 workspace:

    grid (N / BLOCK_N, split); program (t, s):
      Partial[s, rows, t*BLOCK_N : (t+1)*BLOCK_N] = sums over slice s
      barrier; arrived = atomic_add(Counts[t], 1)        (acquire-release, GPU scope)
      arrived == split - 1 (the last):  out = sum over s' = 0..split-1 of Partial[s']
                                        Counts[t] = 0

The sum runs in slice order whichever program is last, so the bits do not depend on
timing; Counts is the layer's and stays zero between launches, so a CUDA graph
replays the launch as it is (Partial is written in full before it is read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .fp8_gemv_stream import _fp8_gemv_stream_kernel, _store_out, programs_for
from .fp8_gemv_tiles import H200_SMS, GemvTiles, choose_tiles, k_slice
from .gemv import _input_chunk, _normalise
from .pdl import await_previous_kernel, prefetch_to_l2

MAX_ROWS = 8  # Fp8Linear sends up to its WEIGHT_ONLY_ROWS here, W8A8 above

_NONE, _NORM, _ADD_NORM, _SILU_MUL = 0, 1, 2, 3


@triton.jit
def _fp8_gemv_kernel(
    X, Res, NormW, W, Scale, Bias, Out, ResOut, Partial, Counts,
    N, K, k_slice, stride_x, stride_r, stride_wn, stride_sn, scale_rows, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, WHOLE_ROW: tl.constexpr,
    STAGES: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)  # this program's K slice: [k_lo, k_hi)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS_PAD)  # accumulator rows: ROWS of them hold outputs
    dtype = X.dtype.element_ty
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    # SCALE_BLOCK > 0: this program's block row of the scales (BLOCK_N divides the block)
    s_row = Scale + ((pid_n * BLOCK_N) // scale_rows) * stride_sn
    k_lo = pid_k * k_slice
    k_hi = tl.minimum(K, k_lo + k_slice)
    if WHOLE_ROW:  # one chunk is all of K (BLOCK_K >= K, one slice): requested before
        # anything else, in flight while the input rows are computed
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & (rk < K)[None, :], other=0.0)
        if PDL:  # launched early: only the weights are read before the previous kernel ends
            await_previous_kernel()
        part = _whole_row_products(w, X, Res, NormW, ResOut, s_row, rk, K, stride_x, stride_r,
                                   eps, pid_n, rows, dtype, PROLOGUE, SCALE_BLOCK, ROWS,
                                   ROWS_PAD, BLOCK_N)
    else:  # chunks, STAGES - 1 of them ahead through shared memory (async copies)
        # a chunk as [BLOCK_N, BLOCK_K / 16, 16]: each thread's 16-byte strips; the
        # products are summed within each strip only (inside one thread, no shuffles)
        # into ``strips`` [ROWS_PAD, BLOCK_N, BLOCK_K / 16], which is summed across
        # threads once, after the loop. The weight copies start after the norm's pass.
        if PDL:  # launched early: the first chunk goes to L2 while the previous kernel ends
            if BLOCK_K >= 128:
                prefetch_to_l2(W, rn, N, k_lo, k_hi, stride_wn, BLOCK_N, BLOCK_K)
            await_previous_kernel()
        rstds = _row_rstds(X, Res, ResOut, K, stride_x, stride_r, eps, pid_n + pid_k, rows,
                           dtype, PROLOGUE, ROWS, ROWS_PAD, NORM_BLOCK)
        k2 = tl.arange(0, BLOCK_K // 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
        w_rows3 = w_rows[:, :, None]
        strips = tl.zeros([ROWS_PAD, BLOCK_N, BLOCK_K // 16], dtype=tl.float32)
        rows3 = rows[:, None, None]
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            kk = k0 + k2
            kmask = kk < k_hi
            w = tl.load(w_rows3 + kk[None, :, :], mask=nmask[:, None, None] & kmask[None, :, :],
                        other=0.0)
            for m in tl.static_range(ROWS):
                x = _row_input(X + m * stride_x, Res + m * stride_r, NormW, s_row, kk, kmask,
                               K, rstds, rows, m, dtype, PROLOGUE, SCALE_BLOCK)
                strip = tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)
                if ROWS == 1:
                    strips += strip[None, :, :]
                else:
                    strips += tl.where(rows3 == m, strip[None, :, :], 0.0)
        part = tl.sum(strips, axis=2)
    if SPLIT == 1:
        _store_out(part, Scale, Bias, Out, rows, rn, nmask, N, ROWS, HAS_BIAS, SCALE_BLOCK)
    else:
        # Partial [SPLIT, ROWS_PAD, N]: each slice writes its sums, then counts itself in;
        # the last of a tile's slices adds all of them, slice 0 first (the same sums
        # whichever finishes last), writes the outputs and resets the count for the next
        # call. The barrier puts every thread's stores before the count's release.
        tl.store(Partial + (pid_k * ROWS_PAD + rows[:, None]) * N + rn[None, :], part,
                 mask=nmask[None, :])
        tl.debug_barrier()
        arrived = tl.atomic_add(Counts + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros([ROWS_PAD, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # .cg: from L2, where the other SMs wrote
                total += tl.load(Partial + (s * ROWS_PAD + rows[:, None]) * N + rn[None, :],
                                 mask=nmask[None, :], other=0.0, cache_modifier=".cg")
            tl.store(Counts + pid_n, 0)
            _store_out(total, Scale, Bias, Out, rows, rn, nmask, N, ROWS, HAS_BIAS,
                       SCALE_BLOCK)


@triton.jit
def _whole_row_products(w, X, Res, NormW, ResOut, s_row, rk, K, stride_x, stride_r, eps,
                        pid_n, rows, dtype, PROLOGUE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                        ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """[ROWS_PAD, BLOCK_N] sums of a whole-row tile ``w``: each input row computed once,
    its norm from the same values (program 0 writes the new residual)."""
    kmask = rk < K
    part = tl.zeros([ROWS_PAD, BLOCK_N], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        x = _input_chunk(X + m * stride_x, Res + m * stride_r, rk, kmask, K, PROLOGUE)
        if PROLOGUE == 2:
            tl.store(ResOut + m * K + rk, x.to(dtype), mask=kmask & ((rk * 0 + pid_n) == 0))
        if PROLOGUE == 1 or PROLOGUE == 2:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            x = _normalise(x, NormW, rk, kmask, rstd, dtype)
        if SCALE_BLOCK > 0:
            x = x * tl.load(s_row + rk // SCALE_BLOCK, mask=kmask, other=0.0)
        row = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        part += tl.where(rows[:, None] == m, row[None, :], 0.0)
    return part


@triton.jit
def _row_rstds(X, Res, ResOut, K, stride_x, stride_r, eps, program, rows, dtype,
               PROLOGUE: tl.constexpr, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr,
               NORM_BLOCK: tl.constexpr):
    """The norm's 1 / rms of each row [ROWS_PAD] over all of K, whatever the program's
    slice, NORM_BLOCK columns a step (4096: one L2 round trip a row for K <= 4096);
    program 0 (``program``: the sum of its grid indices) writes the new residual."""
    rstds = tl.zeros([ROWS_PAD], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        for m in tl.static_range(ROWS):
            ss = tl.zeros([NORM_BLOCK], dtype=tl.float32)
            for j0 in range(0, K, NORM_BLOCK):
                jj = j0 + tl.arange(0, NORM_BLOCK)
                jmask = jj < K
                x = _input_chunk(X + m * stride_x, Res + m * stride_r, jj, jmask, K, PROLOGUE)
                if PROLOGUE == 2:
                    tl.store(ResOut + m * K + jj, x.to(dtype),
                             mask=jmask & ((jj * 0 + program) == 0))
                ss += x * x
            rstd_m = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
            rstds += tl.where(rows == m, rstd_m, 0.0)
    return rstds


@triton.jit
def _row_input(X, Res, NormW, s_row, kk, kmask, K, rstds, rows, m, dtype,
               PROLOGUE: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """Columns kk of input row m as the projection takes them: after the prologue, times
    each column's block scale (SCALE_BLOCK > 0)."""
    x = _input_chunk(X, Res, kk, kmask, K, PROLOGUE)
    if PROLOGUE == 1 or PROLOGUE == 2:
        rstd = tl.sum(tl.where(rows == m, rstds, 0.0), axis=0)
        x = _normalise(x, NormW, kk, kmask, rstd, dtype)
    if SCALE_BLOCK > 0:
        x = x * tl.load(s_row + kk // SCALE_BLOCK, mask=kmask, other=0.0)
    return x


def tile_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 counts for the split-K launches of an N-output weight (one per
    output, enough for any BLOCK_N). Every launch leaves them zero again, so a layer
    makes them once and passes them to each call (``counters=``); launches sharing them
    must run one after another (one stream)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def _launch(prologue, x, weight, scale, block, bias, res=None, norm_weight=None, eps=0.0,
            res_out=None, config=None, counters=None):
    n, k = weight.shape
    rows = x.shape[0]
    early = pdl.dependent_launch(x.device, pdl.MATRIX_VECTOR)
    assert 0 < rows <= MAX_ROWS, f"{rows} rows: the FP8 matrix-vector products take 1..{MAX_ROWS}"
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1
    assert x.stride(-1) == 1, "K must be contiguous"
    assert bias is None or bias.dtype == x.dtype
    tiles = GemvTiles(*config) if config else choose_tiles(n, k, rows)
    block_n = tiles.block_n
    if block:
        assert scale.shape == (triton.cdiv(n, block), triton.cdiv(k, block)), scale.shape
        assert scale.stride(1) == 1
        block_n = min(block_n, block)
        assert block % block_n == 0, f"BLOCK_N {block_n} must divide the scale block {block}"
        stride_sn = scale.stride(0)
    else:
        assert scale.numel() == n and scale.is_contiguous(), "one scale per output channel"
        stride_sn = 0
    assert scale.dtype == torch.float32
    n_tiles, rows_pad = triton.cdiv(n, block_n), triton.next_power_of_2(rows)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if tiles.persist:  # a few programs an SM each streaming several tiles (fp8_gemv_stream)
        assert tiles.split == 1 and tiles.block_k >= k, \
            f"streaming tiles {tuple(tiles)} take whole rows of K ({k}), one slice"
        sms = (torch.cuda.get_device_properties(x.device).multi_processor_count
               if x.is_cuda else H200_SMS)
        _fp8_gemv_stream_kernel[(programs_for(n_tiles, tiles.persist, sms),)](
            x, res if res is not None else x, norm_weight if norm_weight is not None else x,
            weight, scale, bias if bias is not None else x, out,
            res_out if res_out is not None else x,
            n, k, n_tiles, x.stride(0), res.stride(0) if res is not None else 0,
            weight.stride(0), stride_sn, block or 1, float(eps),
            PROLOGUE=prologue, HAS_BIAS=bias is not None, SCALE_BLOCK=block or 0,
            ROWS=rows, ROWS_PAD=rows_pad, BLOCK_N=block_n, BLOCK_K=tiles.block_k,
            STAGES=tiles.stages, num_warps=tiles.warps,
        )
        return out
    per_slice, split = k_slice(k, tiles)  # split: slices actually launched
    if split > 1:
        # no zeroing: every slice writes its whole [rows_pad, BLOCK_N] block
        partial = torch.empty(split, rows_pad, n, dtype=torch.float32, device=x.device)
        if counters is None:
            counters = tile_counters(n, x.device)
        assert counters.dtype == torch.int32 and counters.numel() >= n_tiles
    else:
        partial = counters = out  # not read
    _fp8_gemv_kernel[(n_tiles, split)](
        x, res if res is not None else x, norm_weight if norm_weight is not None else x,
        weight, scale, bias if bias is not None else x, out,
        res_out if res_out is not None else x, partial, counters,
        n, k, per_slice, x.stride(0), res.stride(0) if res is not None else 0,
        weight.stride(0), stride_sn, block or 1, float(eps),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, SCALE_BLOCK=block or 0,
        ROWS=rows, ROWS_PAD=rows_pad, BLOCK_N=block_n, BLOCK_K=tiles.block_k, SPLIT=split,
        WHOLE_ROW=tiles.block_k >= k, STAGES=tiles.stages,
        NORM_BLOCK=min(triton.next_power_of_2(k), 4096), PDL=early, num_warps=tiles.warps,
        launch_pdl=early,
    )
    return out


def fp8_linear_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None, block: int = 0,
                    config=None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantized weight, bias)`` in x's dtype for x [rows, K], weight
    float8 [N, K], scale per channel (``block`` 0) or per ``block`` x ``block``.
    ``config``: a ``GemvTiles`` (else ``choose_tiles``'); ``counters``: the layer's
    ``tile_counters`` (else a zeroed one is made when K is split)."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1]
    return _launch(_NONE, x, weight, scale, block, bias, config=config, counters=counters)


def fp8_rmsnorm_linear_rows(x: torch.Tensor, residual: torch.Tensor | None,
                            norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                            scale: torch.Tensor, bias: torch.Tensor | None = None,
                            block: int = 0, config=None,
                            counters: torch.Tensor | None = None):
    """``RMSNorm`` (layers/basic.py) then ``fp8_linear_rows``, one launch; returns
    ``(linear(norm(x)), x)``, or with ``residual``, ``s = x + residual`` in a new tensor
    and ``(linear(norm(s)), s)``, as ``gemv.rmsnorm_linear_rows`` does."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1] == norm_weight.shape[0]
    assert norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
    if residual is None:
        return _launch(_NORM, x, weight, scale, block, bias, norm_weight=norm_weight,
                       eps=eps, config=config, counters=counters), x
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = _launch(_ADD_NORM, x, weight, scale, block, bias, res=residual,
                  norm_weight=norm_weight, eps=eps, res_out=res_out, config=config,
                  counters=counters)
    return out, res_out


def fp8_silu_mul_linear_rows(gate_up: torch.Tensor, weight: torch.Tensor,
                             scale: torch.Tensor, bias: torch.Tensor | None = None,
                             block: int = 0, config=None,
                             counters: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear_rows(F.silu(gate) * up, ...)`` for gate_up [rows, 2K] = [gate | up]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] == 2 * weight.shape[1]
    return _launch(_SILU_MUL, gate_up, weight, scale, block, bias, config=config,
                   counters=counters)
