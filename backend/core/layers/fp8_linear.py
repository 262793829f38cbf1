"""FP8 linear layers: float8 e4m3 weights with a scale per output channel.

``layers/fp8_install.py`` (or ``quantize_linears`` here) swaps each ``nn.Linear`` of the
decoder layers for an ``Fp8Linear`` after the weights are loaded (or for the block-scaled
``fp8_block_linear.Fp8BlockLinear``); the model classes call their projections as before
(``basic.project`` or a module call) and never mention FP8. The LM head (an untied
``lm_head`` or the tied embedding) stays in the model's dtype: its logits feed sampling
directly, and on small models it is a large share of the weights' error.

The product (W8A8): each token's activation row is quantized on the fly with its own
scale (dynamic per-token scaling), then one float8 x float8 matrix product with float32
accumulation applies both scales to its output,

    y[t, n] = (sum_k xq[t, k] * wq[n, k]) * x_scale[t] * w_scale[n]  (+ bias[n])

On the GPU this is ``torch._scaled_mm`` with row-wise scales (cuBLASLt/CUTLASS float8
tensor-core GEMM), and for a decode batch's few rows (``takes_small_gemm``) the Triton
GEMM of ``kernels/small_gemm.py``, whose tiles fit them. With ``fuse_rows`` set the
norm before the qkv and gate/up projections and the SiLU-and-mul before the down
projection quantize their own output (``rmsnorm_linear``, ``silu_mul_linear``;
``kernels/fp8_fused_quant.py``): the same float8 bytes, one launch fewer. Why W8A8 for batches:
batched decode and prefill are bound by the matrix products, and the float8 tensor cores run twice the bf16 rate;
a weight-only kernel halves the weight bytes too but computes in bf16.
``tools/gpu/check_fp8.py`` measures both products by batch size.

Batches of at most ``WEIGHT_ONLY_ROWS`` rows (decode at batch 1) are bound by the
weight bytes instead, and there the layer skips the activation quantization: with
``fuse_rows`` set (the model runner sets it on CUDA, as for the bf16 matrix-vector
kernels) they take weight-only products (``kernels/fp8_gemv.py``), the model-dtype rows
times the float8 weight widened in registers, with the norm or SiLU-and-mul before the
projection fused in (``rmsnorm_linear``, ``silu_mul_linear``; ``layers/basic.py`` calls
them). Their numbers are those of ``F.linear(x, dequantized())`` up to the order of the
float32 sums.

On CPU (and wherever ``_scaled_mm`` does not apply: dimensions not multiples of 16)
the same quantized operands are dequantized to float32 and multiplied there: the same
numbers as the GPU product up to the order of the float32 sums, so CI tests the path
the GPU runs, quantization error included.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8 import FP8_DTYPE, MIN_SCALE, FP8_MAX, quantize_rows, to_fp8

# _scaled_mm needs both dimensions of the weight to be multiples of 16
_MM_ALIGN = 16
# Rows up to which the weight-only kernels run (they take up to fp8_gemv.MAX_ROWS = 8).
# Their multiplies run on the CUDA cores: compiled for sm_90 they issue 3.5 to 6.5
# instructions a float8 weight at one row and 3.5 more for each further row, so from
# about 4 rows on the issue rate, not HBM, bounds them, where W8A8's tensor cores do
# not; tools/gpu/fp8_gemv_checks.py times both at 1, 2, 4 and 8 rows. At two rows the
# 8B layer's four projections already take longer weight-only than W8A8 (H200: 169 us
# against 140, H100: 175 against 149; the gate/up projection 90 against 50), so only
# single rows take them.
WEIGHT_ONLY_ROWS = 1
# Rows up to which W8A8 runs as the swapped-operand Triton GEMM (kernels/small_gemm.py)
# instead of _scaled_mm: with per-token quantization included, in CUDA graphs on an H100
# at 32 rows it takes the 8B projections in 9.7/9.3/47.5/30.5 us (qkv/o/gate_up/down)
# against _scaled_mm's 19.8/15.0/54.7/43.3; from 2 to 64 rows it is ahead on each
# projection but gate/up at 64 (level: 51.9 against 51.2 us); at 128 rows _scaled_mm
# is ahead on gate/up (52.7 against 93.9 us with these tiles).
SMALL_GEMM_ROWS = 64


class Fp8Linear(nn.Module):
    """``y = x W^T + b`` with W in float8 e4m3 [out, in] and ``weight_scale`` [out]."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        assert weight.dtype == FP8_DTYPE and weight.dim() == 2
        assert weight_scale.shape == (weight.shape[0],) and weight_scale.dtype == torch.float32
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        # [1, out]: the row-wise layout _scaled_mm takes for the second operand
        self.register_buffer("weight_scale", weight_scale.view(1, -1))
        self.register_buffer("bias", bias)
        # the split-K launches' tile counts (kernels/fp8_gemv.py), zero between calls
        self.register_buffer("tile_counters", torch.zeros(self.out_features, dtype=torch.int32,
                                                          device=weight.device),
                             persistent=False)
        self.fuse_rows = False  # small batches take the weight-only kernels (CUDA)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """Quantize ``linear``'s weight row by row (absmax / 448 a row)."""
        q, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale.view(-1), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.rows_fusable(rows):
            from ..kernels.fp8_gemv import fp8_linear_rows

            y = fp8_linear_rows(rows, self.weight, self.weight_scale, self.bias,
                                counters=self.tile_counters)
        else:
            y = self.w8a8(*quantize_tokens(rows), x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def w8a8(self, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The product of rows already quantized per token (float8 [T, K], float32 scales
        [T, 1]), bias included, in ``dtype``."""
        if xq.is_cuda and self.takes_small_gemm(xq.shape[0]):
            from ..kernels.small_gemm import small_gemm

            # the bias goes into the kernel's epilogue: no separate add launch
            return small_gemm(xq, x_scale, self.weight, self.weight_scale, self.bias, dtype)
        if xq.is_cuda and self.in_features % _MM_ALIGN == 0 and self.out_features % _MM_ALIGN == 0:
            y = scaled_mm(xq, x_scale, self.weight, self.weight_scale, dtype)
        else:
            y = emulated_mm(xq, x_scale, self.weight, self.weight_scale, dtype)
        return y if self.bias is None else y + self.bias

    def takes_small_gemm(self, rows: int) -> bool:
        """Whether W8A8 of ``rows`` rows runs ``kernels/small_gemm.py``: up to
        SMALL_GEMM_ROWS, and up to twice that for projections no wider than their input
        (the 8B o and down projections at 128 rows: 12.0 and 34.7 us against 15.8 and
        43.0 with _scaled_mm, where the wider qkv and gate/up lose)."""
        if rows <= SMALL_GEMM_ROWS:
            return True
        return rows <= 2 * SMALL_GEMM_ROWS and self.out_features <= self.in_features

    def rows_fusable(self, x: torch.Tensor) -> bool:
        """Whether the weight-only kernels take ``x``: ``fuse_rows`` set, 1 to
        WEIGHT_ONLY_ROWS rows with unit stride on K, a float dtype the bias (if any)
        shares."""
        return (self.fuse_rows and x.dim() == 2 and 0 < x.shape[0] <= WEIGHT_ONLY_ROWS
                and x.stride(-1) == 1
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and (self.bias is None or self.bias.dtype == x.dtype))

    def fuses_norm(self, x: torch.Tensor, norm_weight: torch.Tensor) -> bool:
        """Whether ``rmsnorm_linear`` takes ``x`` normed by ``norm_weight``: the
        ``rows_fusable`` rows, and on CUDA the W8A8 rows whose norm can write their
        float8 quantization directly (``kernels/fp8_fused_quant.py``)."""
        from ..kernels.fp8_fused_quant import fusable_norm

        if self.rows_fusable(x):
            return norm_weight.dtype == x.dtype
        return self.fuse_rows and fusable_norm(x, norm_weight)

    def fuses_silu_mul(self, gate_up: torch.Tensor) -> bool:
        """Whether ``silu_mul_linear`` takes ``gate_up``, as ``fuses_norm``."""
        from ..kernels.fp8_fused_quant import fusable_silu_mul

        return self.rows_fusable(gate_up) or (self.fuse_rows and fusable_silu_mul(gate_up))

    def rmsnorm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float):
        """``RMSNorm.linear`` into this layer for the rows ``fuses_norm`` takes:
        ``(self(norm(x)), x)``, or with ``residual``, ``(self(norm(x + residual)),
        x + residual)``. One launch for ``rows_fusable`` rows (the weight-only kernel's
        prologue); two for W8A8 rows (the norm writing float8, then the GEMM)."""
        if self.rows_fusable(x):
            from ..kernels.fp8_gemv import fp8_rmsnorm_linear_rows

            return fp8_rmsnorm_linear_rows(x, residual, norm_weight, eps, self.weight,
                                           self.weight_scale, self.bias,
                                           counters=self.tile_counters)
        from ..kernels.fp8_fused_quant import rmsnorm_quant

        (xq, x_scale), residual = rmsnorm_quant(x, residual, norm_weight, eps)
        return self.w8a8(xq, x_scale, x.dtype), residual

    def silu_mul_linear(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(F.silu(gate) * up)`` for the rows gate_up [rows, 2K] that
        ``fuses_silu_mul`` takes."""
        if self.rows_fusable(gate_up):
            from ..kernels.fp8_gemv import fp8_silu_mul_linear_rows

            return fp8_silu_mul_linear_rows(gate_up, self.weight, self.weight_scale,
                                            self.bias, counters=self.tile_counters)
        from ..kernels.fp8_fused_quant import silu_mul_quant

        return self.w8a8(*silu_mul_quant(gate_up), gate_up.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the float8 values and scales stand for, [out, in] in ``dtype``:
        what the weight-only products multiply by (the reference of their checks)."""
        return (self.weight.float() * self.weight_scale.view(-1, 1)).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3"


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 rows, float32 scales [T, 1]): dynamic per-token scaling of x [T, K]."""
    if x.is_cuda:
        from ..kernels.fp8_quant import per_token_quant

        return per_token_quant(x)
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(x, scale), scale


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
              w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float8 GEMM with row-wise scales; xq [T, K], x_scale [T, 1], wq [N, K],
    w_scale [1, N]. Row-wise scaling writes bfloat16 only: other dtypes are a cast."""
    if xq.shape[0] == 0:
        return torch.empty((0, wq.shape[0]), dtype=dtype, device=xq.device)
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale,
                         out_dtype=torch.bfloat16)
    return y if dtype == torch.bfloat16 else y.to(dtype)


def emulated_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scaled_mm``'s numbers from dequantized float32 operands."""
    x = xq.float() * x_scale
    w = wq.float() * w_scale.view(-1, 1)
    return F.linear(x, w).to(dtype)


def quantize_linears(model: nn.Module, keep: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose name is not in ``keep`` by an
    ``Fp8Linear`` (in place, one layer at a time, so the peak memory is the model plus
    one layer); returns how many were replaced."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name.rpartition(".")[2] not in keep]
    return _replace(model, names, Fp8Linear.from_linear)


def dequantize_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every ``Fp8Linear`` and ``Fp8BlockLinear`` of ``model`` by an
    ``nn.Linear`` holding its ``dequantized(dtype)`` weight (``dtype``: the model's): the
    weight-only products computed by torch, exact in a float32 model, the reference the
    FP8 matrix-vector kernels are checked against and whose quality
    ``tools/fp8_quality.py`` measures. Returns how many were replaced."""
    def to_linear(fp8: Fp8Linear) -> nn.Linear:
        linear = nn.Linear(fp8.in_features, fp8.out_features, bias=fp8.bias is not None,
                           device=fp8.weight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(fp8.dequantized(dtype))
            if fp8.bias is not None:
                linear.bias.copy_(fp8.bias)
        return linear

    from .fp8_block_linear import Fp8BlockLinear

    names = [name for name, module in model.named_modules()
             if isinstance(module, (Fp8Linear, Fp8BlockLinear))]
    return _replace(model, names, to_linear)


def _replace(model: nn.Module, names: list[str], make) -> int:
    """Swap each named submodule for ``make(submodule)``, one at a time (names only: no
    reference keeps a replaced layer alive, so the peak memory is the model plus one
    layer); returns how many were replaced."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(parent.get_submodule(child)))
    return len(names)
