"""Small building blocks shared by the decoder models.

On CUDA tensors they run fused Triton kernels (one launch instead of several elementwise
torch kernels, which dominate small decode steps); elsewhere plain torch with the same
math order, so CPU results match the reference implementations exactly.

Small decode batches go further when ``fuse_rows`` is set (the model runner sets it on
CUDA): the norm before a projection and the SiLU-and-mul before the down projection run
as the prologue of a matrix-vector kernel (``kernels/gemv.py``; for FP8 layers,
``kernels/fp8_gemv.py`` through ``Fp8Linear`` and ``Fp8BlockLinear``), one launch per
projection instead of two; larger batches of an ``Fp8Linear`` get the op fused with the
quantization of its output instead (``kernels/fp8_fused_quant.py``), whichever the layer's
``fuses_norm`` / ``fuses_silu_mul`` accept."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_block_linear import Fp8BlockLinear
from .fp8_linear import Fp8Linear

FP8_LINEARS = (Fp8Linear, Fp8BlockLinear)  # the float8 layers, one call interface
# Rows up to which half-precision products take kernels/small_gemm.py instead of cuBLAS
SMALL_GEMM_MAX_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           fuse_rows: bool, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (then cast to ``out_dtype``); with ``fuse_rows``,
    batch-1 rows take the matrix-vector kernel, which writes ``out_dtype`` directly. A
    decode batch of a few dozen half-precision rows takes the swapped-operand GEMM
    (``small_gemm_rows``)."""
    if fuse_rows and rows_fusable(x, weight, bias):
        from ..kernels.gemv import linear_rows

        return linear_rows(x, weight, bias, out_dtype=out_dtype)
    if small_gemm_rows(x, weight, bias):
        from ..kernels.small_gemm import half_small_gemm

        y = half_small_gemm(x, weight, bias)
    else:
        y = F.linear(x, weight, bias)
    # rounded to x's dtype first, as the reference models' logits are
    return y if out_dtype is None else y.to(out_dtype)


def project(proj: nn.Module, x: torch.Tensor, fuse_rows: bool) -> torch.Tensor:
    """``proj(x)`` for a linear layer ``proj``: the one place where a projection's
    weights meet its input. Batch-1 rows of a half-precision ``nn.Linear`` take the
    matrix-vector kernel (``fuse_rows``); any other layer runs its own forward, which is
    ``F.linear`` for ``nn.Linear`` and the float8 product for ``fp8_linear.Fp8Linear``
    (whose float8 weight never passes ``rows_fusable``: it takes small batches to its
    own weight-only kernels)."""
    if type(proj) is nn.Linear:
        return linear(x, proj.weight, proj.bias, fuse_rows)
    return proj(x)


def small_gemm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``kernels/small_gemm.py``'s half-precision GEMM takes this product: a CUDA
    batch of 2 to SMALL_GEMM_MAX_ROWS rows of the weight's dtype, by a weight at least as
    wide as it is deep. That is where it beat cuBLAS on an H100
    (``tools/gpu/half_small_gemm_checks.py``, docs/benchmarks/half_small_gemm_gpu.json):
    1.04-1.20x on the 8B qkv and o projections at 8 to 32 rows and 1.05-1.08x on the LM
    head; the down projections (K 3.5-4x N: 32 to 64 programs for 132 SMs) lost up to
    0.84x on the 1B shape. From 33 rows the tile of rows is 64 wide, and at 64 rows it
    lost on both GPUs: 0.90-1.00x on the 8B qkv, o and gate-up projections on an H100,
    0.90-0.96x on an H200; past 64 a second tile of rows reads the weight again."""
    return (x.is_cuda and x.dim() == 2 and small_gemm_shape(x.shape[0], *weight.shape)
            and x.stride(1) == 1 and weight.stride(1) == 1  # the kernel's K-major operands
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype))


def small_gemm_shape(rows: int, n: int, k: int) -> bool:
    """The shapes of ``small_gemm_rows``: 2 to SMALL_GEMM_MAX_ROWS rows, N >= K."""
    return 2 <= rows <= SMALL_GEMM_MAX_ROWS and n >= k


def rows_fusable(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether ``kernels/gemv.py`` takes this input: a CUDA half-precision batch of at
    most MAX_ROWS rows whose parameters share its dtype."""
    from ..kernels.gemv import MAX_ROWS

    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16)
            and all(p is None or p.dtype == x.dtype for p in params))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fuse_rows = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual``: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from ..kernels.fused import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def linear(self, proj: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``(proj(norm(x)), x)``; with ``residual``: ``(proj(norm(x + residual)),
        x + residual)``, i.e. ``forward`` followed by the projection."""
        if self.fuse_rows and rows_fusable(x, self.weight, proj.weight, proj.bias):
            return self.linear_weight(proj.weight, proj.bias, x, residual)
        if self.fuse_rows and isinstance(proj, FP8_LINEARS) and proj.fuses_norm(x, self.weight):
            return proj.rmsnorm_linear(x, residual, self.weight, self.eps)
        normed, residual = (self(x), x) if residual is None else self(x, residual)
        return project(proj, normed, False), residual

    def linear_weight(self, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                      residual: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None):
        """``linear`` for a bare weight (a tied LM head), its product cast to
        ``out_dtype``."""
        if self.fuse_rows and rows_fusable(x, self.weight, weight, bias):
            from ..kernels.gemv import rmsnorm_linear_rows

            return rmsnorm_linear_rows(x, residual, self.weight, self.eps, weight, bias,
                                       out_dtype=out_dtype)
        normed, residual = (self(x), x) if residual is None else self(x, residual)
        return linear(normed, weight, bias, False, out_dtype), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 like the reference implementations, then cast back
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedMLP(nn.Module):
    """Gated feed-forward, ``down(act(gate) * up)``, with the gate and up projections fused
    into one matmul. ``act``: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r}")
        self.intermediate = intermediate
        self.act = act
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.fuse_rows = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The block's output from its gate/up projection ``gate_up`` [T, 2I]."""
        gate, up = gate_up.split(self.intermediate, dim=-1)
        if self.act == "gelu_tanh":
            return project(self.down_proj, F.gelu(gate, approximate="tanh") * up, False)
        if self.fuse_rows and rows_fusable(gate_up, self.down_proj.weight):
            from ..kernels.gemv import silu_mul_linear_rows

            return silu_mul_linear_rows(gate_up, self.down_proj.weight)
        if (self.fuse_rows and isinstance(self.down_proj, FP8_LINEARS)
                and self.down_proj.fuses_silu_mul(gate_up)):
            return self.down_proj.silu_mul_linear(gate_up)
        if gate_up.is_cuda:
            from ..kernels.fused import silu_and_mul

            return project(self.down_proj, silu_and_mul(gate_up), False)
        return self.down_proj(F.silu(gate) * up)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the scale is ``1 + weight`` and multiplies the float32 normalised
    row before the one rounding to the input dtype (Llama's rounds first). Same call
    interface as ``RMSNorm``; never fused into a projection."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual``: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from ..kernels.fused import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps, unit_offset=True)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps, unit_offset=True)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
