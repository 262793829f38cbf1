"""The op before an FP8 projection, fused with the dynamic per-token quantization of its
output: RMSNorm (+ residual add) before the qkv and gate/up projections, SiLU-and-mul
before the down projection.

Unfused, a W8A8 projection's input takes two launches and a round trip through HBM: the
op writes its model-dtype row (``kernels/fused.py``), then ``fp8_quant.per_token_quant``
reads it back for its absmax and writes the float8 row. Here one program per row keeps
the op's result in registers, rounds it to the model dtype exactly where the op would
have stored it, and quantizes that: the float8 bytes and scales are those of the two
launches, bit for bit (tests/test_fp8_fused_quant.py), with one launch fewer for each of
the three sites of a decoder layer.

Whole rows only: rows up to ``NORM_MAX_COLS`` (RMSNorm) and ``SILU_MAX_COLS`` (the
intermediate size) wide; ``fusable_norm`` and ``fusable_silu_mul`` say which inputs the
callers (``layers/fp8_linear.py``) may bring.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from . import pdl
from .fp8_quant import _quantize_row
from .fused import _scaled
from .pdl import await_previous_kernel

# One program holds a whole row in registers: the norm's width up to 8192 (Llama up to
# 70B), the SiLU-and-mul's two halves up to 16384 columns each (8B: 14336).
NORM_MAX_COLS = 8192
SILU_MAX_COLS = 16384


@triton.jit
def _rmsnorm_quant_kernel(X, Res, W, ResOut, Q, S, stride_x, stride_r, stride_ro, stride_q,
                          N, eps, fp8_max, min_scale,
                          HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0)  # the norm's weight: no kernel writes it
    if PDL:  # launched early (pdl.py): x and the residual are the previous kernel's
        await_previous_kernel()
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    # the value RMSNorm would have stored: rounded to the model dtype
    y = _scaled(xf * rstd, w, X.dtype.element_ty, False).to(X.dtype.element_ty).to(tl.float32)
    _quantize_row(y, Q, S, row, stride_q, cols, mask, fp8_max, min_scale)


@triton.jit
def _silu_mul_quant_kernel(GateUp, Q, S, stride_g, stride_q, I, fp8_max, min_scale,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < I
    if PDL:  # launched early (pdl.py): gate_up is the previous kernel's
        await_previous_kernel()
    g = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + row * stride_g + I + cols, mask=mask, other=0.0)
    dtype = u.dtype
    # silu_and_mul's roundings: silu's result, then the product, each to the model dtype
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    y = (s * u.to(tl.float32)).to(dtype).to(tl.float32)
    _quantize_row(y, Q, S, row, stride_q, cols, mask, fp8_max, min_scale)


def fusable_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rmsnorm_quant`` takes ``x`` normed by ``weight``."""
    return (x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] <= NORM_MAX_COLS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype)


def fusable_silu_mul(gate_up: torch.Tensor) -> bool:
    """Whether ``silu_mul_quant`` takes ``gate_up``."""
    return (gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(-1) == 1
            and gate_up.shape[1] % 2 == 0 and gate_up.shape[1] // 2 <= SILU_MAX_COLS
            and gate_up.dtype in (torch.bfloat16, torch.float16))


def _outputs(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((rows, cols), dtype=FP8_DTYPE, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def _norm_warps(block: int) -> int:
    # fused.rmsnorm's warps: the sum of squares reduces in the same order, so the same rstd
    return max(1, min(16, block // 256))


def rmsnorm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float):
    """``per_token_quant(RMSNorm(x))``; with ``residual``, of ``RMSNorm(x + residual)``.
    Returns ``((float8 [T, N], float32 scales [T, 1]), x + residual or x)``."""
    rows, n = x.shape
    assert weight.shape == (n,) and weight.is_contiguous()
    q, scale = _outputs(rows, n, x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        res_out = torch.empty_like(x)
    else:
        residual = res_out = x  # unused: HAS_RESIDUAL=False compiles their accesses away
    if rows:
        block = triton.next_power_of_2(n)
        early = pdl.dependent_launch(x.device, pdl.FEW_ROW_GEMM)
        _rmsnorm_quant_kernel[(rows,)](
            x, residual, weight, res_out, q, scale,
            x.stride(0), residual.stride(0), res_out.stride(0), q.stride(0),
            n, float(eps), FP8_MAX, MIN_SCALE,
            HAS_RESIDUAL=res_out is not x, BLOCK=block, PDL=early,
            num_warps=_norm_warps(block), launch_pdl=early)
    return (q, scale), res_out


def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_quant(silu_and_mul(gate_up))`` for gate_up [T, 2I] = [gate | up]:
    (float8 [T, I], float32 scales [T, 1])."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q, scale = _outputs(rows, inter, gate_up.device)
    if rows:
        block = triton.next_power_of_2(inter)
        early = pdl.dependent_launch(gate_up.device, pdl.FEW_ROW_GEMM)
        _silu_mul_quant_kernel[(rows,)](gate_up, q, scale, gate_up.stride(0), q.stride(0),
                                        inter, FP8_MAX, MIN_SCALE, BLOCK=block, PDL=early,
                                        num_warps=max(4, min(16, block // 1024)),
                                        launch_pdl=early)
    return q, scale
