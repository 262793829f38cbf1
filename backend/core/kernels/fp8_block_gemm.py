"""Block-scaled FP8 products (W8A8): float8 weights with a scale per block of the weight,
activations quantized per token and per group of input columns as they arrive.

The layout of DeepSeek-V3's FP8 checkpoints (transformers' ``fp8`` quantization with a
``weight_block_size``): a weight wq [N, K] in float8 e4m3 with one float32 scale per
``block_n`` x ``group`` block (128 x 128 as published), and activations with one scale
per token per ``group`` columns (1 x 128), so every ``group``-wide slice of K has a
single scale on each side:

            K:   | group 0        | group 1        | ...  | last group (K % group wide) |
    x[m, :]       x_scale[m, 0]    x_scale[m, 1]           x_scale[m, G-1]
    w[n, :]       w_scale[n // block_n, 0]  ...            w_scale[n // block_n, G-1]

    y[m, n] = sum_g x_scale[m, g] * w_scale[n // block_n, g] * sum_{k in g} xq[m, k] wq[n, k]

G = ceil(K / group) and the scale grid has ceil(N / block_n) rows: shapes that are not
multiples of the block keep a partial last block (the checkpoints' ceil-div grid), and
the kernel masks the columns past K. ``block_n`` may be 1 (a scale per output row and
group): the form a fused projection takes when its pieces' blocks do not line up
(layers/fp8_block_linear.py).

The GEMM steps through K one group at a time (BLOCK_K = group): each step is one float8
tensor-core product accumulated in float32, scaled by the outer product of the two
scale vectors and added to the output tile. ``group_quant`` is the activations' one
launch: each group's absmax, its scale ``absmax / 448`` and the clamped float8 values.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from .scales import saturate

# Output tiles aimed at per launch: about two per SM of an H200 (132 SMs), so that the
# small decode batches, whose products are bound by the weight bytes, keep every SM
# streaming weights; narrower N tiles are taken until a launch has this many.
TARGET_PROGRAMS = 256
GROUPS_PER_PROGRAM = 8  # group_quant: groups of one row a program handles


class GemmConfig(NamedTuple):
    """Tiles and pipelining of one ``block_gemm`` launch (BLOCK_K is the group)."""

    block_m: int
    block_n: int
    group_m: int  # row tiles that walk the N tiles together (weight tiles reused in L2)
    num_warps: int
    num_stages: int


@triton.jit
def _group_quant_kernel(X, Q, S, stride_x, stride_q, stride_s, K, num_groups, fp8_max,
                        min_scale, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn), as torch divides: the bytes of the torch form, exactly
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), fp8_max), min_scale)
    q = saturate(tl.math.div_rn(x, scale[:, None]))
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_s + groups, scale, mask=groups < num_groups)


def group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [M, K], float32 scales [M, ceil(K / group)]) for x [M, K]: each token's
    ``group``-wide column groups scaled on their own (absmax / 448, dynamic)."""
    assert x.dim() == 2 and x.stride(1) == 1
    assert group >= 16 and group & (group - 1) == 0, "group: a power of two, at least 16"
    rows, cols = x.shape
    num_groups = triton.cdiv(cols, group)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, num_groups), dtype=torch.float32, device=x.device)
    if rows:
        per_program = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(num_groups))
        grid = (rows, triton.cdiv(num_groups, per_program))
        _group_quant_kernel[grid](x, q, scale, x.stride(0), q.stride(0), scale.stride(0),
                                  cols, num_groups, FP8_MAX, MIN_SCALE, GROUP=group,
                                  GROUPS=per_program, num_warps=4)
    return q, scale


@triton.jit
def _block_gemm_kernel(A, AScale, B, BScale, Bias, C, M, N, K,
                       stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                       SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    # program -> (row tile, column tile), GROUP_M row tiles at a time over all column
    # tiles, so the weight tiles those rows share are read from L2 rather than HBM
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask, nmask = rm < M, rn < N
    a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    # the weight [N, K] read as [K, N] (K-major, what the float8 tensor cores take)
    b_ptrs = B + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    a_scale_ptrs = AScale + rm * stride_asm
    b_scale_ptrs = BScale + (rn // SCALE_ROWS) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = rk < K - g * BLOCK_K
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + g, mask=mmask, other=0.0)
        b_scale = tl.load(b_scale_ptrs + g, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def default_config(m: int, n: int) -> GemmConfig:
    """Row tiles just covering small batches (decode batches of 3 to 64 rows waste
    little on rows past M), column tiles of 128 narrowed to 64 or 32 while the launch has
    fewer than TARGET_PROGRAMS tiles. ``tools/gpu/fp8_block_checks.py`` times the
    alternatives on the GPU."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    tiles_m = triton.cdiv(m, block_m)
    block_n = 128
    while block_n > 32 and tiles_m * triton.cdiv(n, block_n) < TARGET_PROGRAMS:
        block_n //= 2
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return GemmConfig(block_m, block_n, group_m=8, num_warps=warps,
                      num_stages=3 if block_m >= 128 else 4)


def block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
               w_scale: torch.Tensor, block_n: int, group: int, out_dtype: torch.dtype,
               bias: torch.Tensor | None = None,
               config: GemmConfig | None = None) -> torch.Tensor:
    """``y = x w^T (+ bias)`` in ``out_dtype`` from xq float8 [M, K] with x_scale
    [M, ceil(K / group)] and wq float8 [N, K] with w_scale [ceil(N / block_n),
    ceil(K / group)] (the layout above)."""
    m, k = xq.shape
    n = wq.shape[0]
    assert wq.shape[1] == k and xq.dtype == wq.dtype == FP8_DTYPE
    assert xq.stride(1) == 1 and wq.stride(1) == 1
    groups = triton.cdiv(k, group)
    assert x_scale.shape == (m, groups) and x_scale.stride(1) == 1, x_scale.shape
    assert w_scale.shape == (triton.cdiv(n, block_n), groups) and w_scale.stride(1) == 1, \
        w_scale.shape
    assert x_scale.dtype == w_scale.dtype == torch.float32
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = config or default_config(m, n)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _block_gemm_kernel[grid](
        xq, x_scale, wq, w_scale, bias if bias is not None else out, out, m, n, k,
        xq.stride(0), x_scale.stride(0), wq.stride(0), w_scale.stride(0), out.stride(0),
        SCALE_ROWS=block_n, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=group, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
