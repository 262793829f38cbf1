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

One program computes BLOCK_N outputs of every row: it requests its [BLOCK_N, BLOCK_K]
weight slice first and computes the input rows while the loads are in flight; each
weight tile, once in registers, serves all the rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import _input_chunk, _normalise

MAX_ROWS = 8  # Fp8Linear sends up to its WEIGHT_ONLY_ROWS here, W8A8 above

_NONE, _NORM, _ADD_NORM, _SILU_MUL = 0, 1, 2, 3


@triton.jit
def _fp8_gemv_kernel(
    X, Res, NormW, W, Scale, Bias, Out, ResOut,
    N, K, stride_x, stride_r, stride_wn, stride_sn, scale_rows, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, WHOLE_ROW: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS_PAD)  # accumulator rows: ROWS of them hold outputs
    dtype = X.dtype.element_ty
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    # SCALE_BLOCK > 0: this program's block row of the scales (BLOCK_N divides the block)
    s_row = Scale + ((pid * BLOCK_N) // scale_rows) * stride_sn
    is_norm = PROLOGUE == 1 or PROLOGUE == 2
    acc = tl.zeros([ROWS_PAD, BLOCK_N], dtype=tl.float32)
    if WHOLE_ROW:  # BLOCK_K >= K, known at launch: one branch compiled, not two
        # the whole row at once: the weight tile is requested before the input rows
        kmask = rk < K
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        first = (rk * 0 + pid) == 0
        if SCALE_BLOCK > 0:
            ks = tl.load(s_row + rk // SCALE_BLOCK, mask=kmask, other=0.0)
        for m in tl.static_range(ROWS):
            x = _input_chunk(X + m * stride_x, Res + m * stride_r, rk, kmask, K, PROLOGUE)
            if PROLOGUE == 2:
                tl.store(ResOut + m * K + rk, x.to(dtype), mask=kmask & first)
            if is_norm:
                rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
                x = _normalise(x, NormW, rk, kmask, rstd, dtype)
            if SCALE_BLOCK > 0:
                x = x * ks
            part = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    else:
        rstds = tl.zeros([ROWS_PAD], dtype=tl.float32)
        if is_norm:  # pass 1: each row's sum of squares (program 0 writes the new residual)
            for m in tl.static_range(ROWS):
                ss = tl.zeros([BLOCK_K], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + rk
                    kmask = kk < K
                    x = _input_chunk(X + m * stride_x, Res + m * stride_r, kk, kmask, K,
                                     PROLOGUE)
                    if PROLOGUE == 2:
                        tl.store(ResOut + m * K + kk, x.to(dtype),
                                 mask=kmask & ((kk * 0 + pid) == 0))
                    ss += x * x
                rstd_m = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
                rstds += tl.where(rows == m, rstd_m, 0.0)
        # one row: products summed into a [BLOCK_N, BLOCK_K] accumulator (one fused
        # multiply-add a weight, reduced once at the end) rather than reduced per chunk
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        # STAGES > 1: the weight chunks stream through shared memory (asynchronous
        # copies), STAGES - 1 chunks ahead of the products
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            kk = k0 + rk
            kmask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            if SCALE_BLOCK > 0:
                ks = tl.load(s_row + kk // SCALE_BLOCK, mask=kmask, other=0.0)
            for m in tl.static_range(ROWS):
                x = _input_chunk(X + m * stride_x, Res + m * stride_r, kk, kmask, K,
                                 PROLOGUE)
                if is_norm:
                    rstd = tl.sum(tl.where(rows == m, rstds, 0.0), axis=0)
                    x = _normalise(x, NormW, kk, kmask, rstd, dtype)
                if SCALE_BLOCK > 0:
                    x = x * ks
                if ROWS == 1:
                    acc2 += w.to(tl.float32) * x[None, :]
                else:
                    part = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
                    acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
        if ROWS == 1:
            acc += tl.sum(acc2, axis=1)[None, :]
    if SCALE_BLOCK == 0:
        acc = acc * tl.load(Scale + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = Out + rows[:, None] * N + rn[None, :]
    tl.store(out, acc.to(dtype), mask=(rows[:, None] < ROWS) & nmask[None, :])


def _config(n: int, k: int, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, pipeline stages of the chunk loop). At one row, the bf16 kernels' tiles in bytes (twice
    their weights): 8 x 4096 float8 weights, the whole row in one tile up to K = 4096,
    so that each program's prologue, which re-reads its input row (x, the residual, the
    norm weight: 24 KB at K = 4096) from L2, stays small beside its 32 KB of weights;
    8 x 2048 chunks past K = 4096 (512 programs for the 8B down projection). From 2 rows
    on, half the tile: each weight, widened to float32 once,
    serves every row and stays in registers meanwhile (compiled for sm_90 at 8 warps:
    60-90 registers a thread at one row, about 100 at 2-8 rows with the half tile, where
    the full one takes 165-190; no spills). Chunks of one row are summed into a 2-D
    accumulator, one fused multiply-add a weight; stages > 1 pipelines them through
    shared memory. tools/gpu/fp8_gemv_checks.py sweeps the alternatives."""
    elems = 32768 if rows == 1 else 16384
    if k <= 4096:
        block_k = triton.next_power_of_2(k)
        block_n = max(1, min(16, elems // block_k))
        return block_n, block_k, 8 if block_n * block_k >= 8192 else 4, 1
    return elems // 4096, 2048, 8, 1


def _launch(prologue, x, weight, scale, block, bias, res=None, norm_weight=None, eps=0.0,
            res_out=None, config=None):
    n, k = weight.shape
    rows = x.shape[0]
    assert 0 < rows <= MAX_ROWS, f"{rows} rows: the FP8 matrix-vector products take 1..{MAX_ROWS}"
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1
    assert x.stride(-1) == 1, "K must be contiguous"
    assert bias is None or bias.dtype == x.dtype
    block_n, block_k, warps, stages = config or _config(n, k, rows)
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
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, res if res is not None else x, norm_weight if norm_weight is not None else x,
        weight, scale, bias if bias is not None else x, out,
        res_out if res_out is not None else x,
        n, k, x.stride(0), res.stride(0) if res is not None else 0, weight.stride(0),
        stride_sn, block or 1, float(eps),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, SCALE_BLOCK=block or 0,
        ROWS=rows, ROWS_PAD=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        WHOLE_ROW=block_k >= k, STAGES=stages, num_warps=warps,
    )
    return out


def fp8_linear_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None, block: int = 0,
                    config=None) -> torch.Tensor:
    """``F.linear(x, dequantized weight, bias)`` in x's dtype for x [rows, K], weight
    float8 [N, K], scale per channel (``block`` 0) or per ``block`` x ``block``."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1]
    return _launch(_NONE, x, weight, scale, block, bias, config=config)


def fp8_rmsnorm_linear_rows(x: torch.Tensor, residual: torch.Tensor | None,
                            norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                            scale: torch.Tensor, bias: torch.Tensor | None = None,
                            block: int = 0, config=None):
    """``RMSNorm`` (layers/basic.py) then ``fp8_linear_rows``, one launch; returns
    ``(linear(norm(x)), x)``, or with ``residual``, ``s = x + residual`` in a new tensor
    and ``(linear(norm(s)), s)``, as ``gemv.rmsnorm_linear_rows`` does."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1] == norm_weight.shape[0]
    assert norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
    if residual is None:
        return _launch(_NORM, x, weight, scale, block, bias, norm_weight=norm_weight,
                       eps=eps, config=config), x
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = _launch(_ADD_NORM, x, weight, scale, block, bias, res=residual,
                  norm_weight=norm_weight, eps=eps, res_out=res_out, config=config)
    return out, res_out


def fp8_silu_mul_linear_rows(gate_up: torch.Tensor, weight: torch.Tensor,
                             scale: torch.Tensor, bias: torch.Tensor | None = None,
                             block: int = 0, config=None) -> torch.Tensor:
    """``fp8_linear_rows(F.silu(gate) * up, ...)`` for gate_up [rows, 2K] = [gate | up]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] == 2 * weight.shape[1]
    return _launch(_SILU_MUL, gate_up, weight, scale, block, bias, config=config)
