"""Dynamic per-token FP8 quantization of activations, one launch.

One program per row: its absmax, the scale ``absmax / 448`` and the clamped float8
row, from a single read of the row (the torch expression takes four passes). The row
stays in registers, so rows up to MAX_COLS wide take this kernel; wider ones the torch
reference in ``layers/fp8_linear.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, to_fp8
from . import pdl
from .pdl import await_previous_kernel

MAX_COLS = 32768


@triton.jit
def _quantize_row(y, Q, S, row, stride_q, cols, mask, fp8_max, min_scale):
    """``per_token_quant``'s numbers for one float32 row already rounded to the model
    dtype: scale = absmax / fp8_max (at least min_scale), q = clamp(y / scale)."""
    scale = tl.maximum(tl.max(tl.abs(y), 0) / fp8_max, min_scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -fp8_max), fp8_max)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


@triton.jit
def _per_token_quant_kernel(X, Q, S, stride_x, stride_q, K, fp8_max, min_scale,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    if PDL:  # launched early (pdl.py): x is the previous kernel's
        await_previous_kernel()
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _quantize_row(x, Q, S, row, stride_q, cols, mask, fp8_max, min_scale)


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [T, K], float32 scales [T, 1]) for x [T, K] (unit stride on K)."""
    assert x.dim() == 2 and x.stride(1) == 1
    rows, cols = x.shape
    if cols > MAX_COLS:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
        return to_fp8(x, scale), scale
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        early = pdl.dependent_launch(x.device, pdl.FEW_ROW_GEMM)
        _per_token_quant_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), cols,
                                         FP8_MAX, MIN_SCALE, BLOCK=block, PDL=early,
                                         num_warps=4 if block <= 4096 else 16,
                                         launch_pdl=early)
    return q, scale
