"""Block-scaled FP8 linear layers: float8 e4m3 weights with a scale per 128 x 128 block.

The scheme of DeepSeek-V3's FP8 checkpoints: the weight [N, K] holds one scale per
``block_n`` x ``group`` block (``block``, 128 x 128 by default), and each token's
activations are quantized as they arrive with one scale per ``group`` columns (dynamic,
1 x 128). A block scale follows the weights' local range where one scale per output
channel must cover the whole row, and an activation group keeps an outlier column from
flattening the rest of its token. The product, with the scale grids of
``kernels/fp8_block_gemm.py``:

    y[t, n] = sum_g x_scale[t, g] * w_scale[n // block_n, g] * (xq[t, g] . wq[n, g])  (+ b)

On CUDA that is the Triton kernel of ``kernels/fp8_block_gemm.py`` (a float8 tensor-core
product per group). Decode batches of up to ``WEIGHT_ONLY_ROWS`` rows with ``fuse_rows``
set take the weight-only matrix-vector kernels instead (``kernels/fp8_gemv.py`` in its
block-scale form, the norm or SiLU-and-mul before the projection fused in), as
``Fp8Linear`` does: the activations stay in the model dtype there. On CPU the same
quantized operands are dequantized to float32 and multiplied, the GPU kernel's numbers up
to the order of the float32 sums.

Shapes need not be multiples of the block: the grid has ceil(N / block_n) x ceil(K /
group) scales and the last block of a row or column is partial, as in the checkpoints.
``block_n`` may be 1 (a scale per output row and group): what a fused projection (QKV,
gate/up) read from a checkpoint becomes when its pieces' row counts are not multiples
of the checkpoint's block, so that each row keeps its own piece's scales
(``layers/fp8_install.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, to_fp8

DEFAULT_BLOCK = (128, 128)
# Rows up to which the weight-only kernels run: the bound of fp8_linear.WEIGHT_ONLY_ROWS,
# which says why (same kernels; not imported: fp8_linear imports this module)
WEIGHT_ONLY_ROWS = 1


class Fp8BlockLinear(nn.Module):
    """``y = x W^T + b`` with W float8 e4m3 [out, in] and ``weight_scale``
    [ceil(out / block[0]), ceil(in / block[1])]."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, block: tuple[int, int] = DEFAULT_BLOCK) -> None:
        super().__init__()
        assert weight.dtype == FP8_DTYPE and weight.dim() == 2
        assert weight_scale.dtype == torch.float32
        assert weight_scale.shape == scale_grid(weight.shape, block), (weight_scale.shape, block)
        self.out_features, self.in_features = weight.shape
        self.block = block
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.contiguous())
        self.register_buffer("bias", bias)
        # the split-K launches' tile counts (kernels/fp8_gemv.py), zero between calls
        self.register_buffer("tile_counters", torch.zeros(self.out_features, dtype=torch.int32,
                                                          device=weight.device),
                             persistent=False)
        self.fuse_rows = False  # small batches take the weight-only kernels (CUDA)

    @classmethod
    def from_linear(cls, linear: nn.Linear,
                    block: tuple[int, int] = DEFAULT_BLOCK) -> "Fp8BlockLinear":
        """Quantize ``linear``'s weight block by block (absmax / 448 a block)."""
        q, scale = quantize_blocks(linear.weight.detach(), block)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale, bias, block)

    @property
    def group(self) -> int:
        """Input columns per activation scale: the weight blocks' width."""
        return self.block[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.rows_fusable(rows):
            from ..kernels.fp8_gemv import fp8_linear_rows

            y = fp8_linear_rows(rows, self.weight, self.weight_scale, self.bias,
                                block=self.group, counters=self.tile_counters)
        elif x.is_cuda and self.kernel_fits():
            y = self.kernel_product(rows)
        else:
            xq, x_scale = quantize_groups(rows, self.group)
            y = emulated_block_mm(xq, x_scale, self.weight, self.weight_scale, self.block,
                                  self.bias).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_product(self, rows: torch.Tensor) -> torch.Tensor:
        """The W8A8 product of rows [T, K] by the Triton kernels (CUDA; the interpreter
        elsewhere): the activations quantized per token and group, then the GEMM."""
        from ..kernels.fp8_block_gemm import block_gemm, group_quant

        xq, x_scale = group_quant(rows.contiguous(), self.group)
        return block_gemm(xq, x_scale, self.weight, self.weight_scale, self.block[0],
                          self.group, rows.dtype, self.bias)

    def kernel_fits(self) -> bool:
        """Whether the Triton GEMM takes this layer: its K steps are one group wide, and
        a float8 tensor-core step is a power of two of at least 16 columns."""
        return self.group >= 16 and self.group & (self.group - 1) == 0

    def rows_fusable(self, x: torch.Tensor) -> bool:
        """Whether the weight-only kernels take ``x``: ``fuse_rows`` set, square scale
        blocks (their block-scale form), 1 to WEIGHT_ONLY_ROWS rows with unit stride on
        K, a float dtype the bias (if any) shares."""
        return (self.fuse_rows and self.block[0] == self.block[1] and x.dim() == 2
                and 0 < x.shape[0] <= WEIGHT_ONLY_ROWS and x.stride(-1) == 1
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and (self.bias is None or self.bias.dtype == x.dtype))

    def fuses_norm(self, x: torch.Tensor, norm_weight: torch.Tensor) -> bool:
        """Whether ``rmsnorm_linear`` takes ``x`` (``Fp8Linear.fuses_norm``): the
        ``rows_fusable`` rows only (group quantization is not fused into the norm)."""
        return self.rows_fusable(x) and norm_weight.dtype == x.dtype

    def fuses_silu_mul(self, gate_up: torch.Tensor) -> bool:
        """Whether ``silu_mul_linear`` takes ``gate_up``: the ``rows_fusable`` rows."""
        return self.rows_fusable(gate_up)

    def rmsnorm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float):
        """``Fp8Linear.rmsnorm_linear``: RMSNorm then this layer for ``rows_fusable``
        rows, one launch."""
        from ..kernels.fp8_gemv import fp8_rmsnorm_linear_rows

        return fp8_rmsnorm_linear_rows(x, residual, norm_weight, eps, self.weight,
                                       self.weight_scale, self.bias, block=self.group,
                                       counters=self.tile_counters)

    def silu_mul_linear(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(F.silu(gate) * up)`` for ``rows_fusable`` rows gate_up [rows, 2K]."""
        from ..kernels.fp8_gemv import fp8_silu_mul_linear_rows

        return fp8_silu_mul_linear_rows(gate_up, self.weight, self.weight_scale, self.bias,
                                        block=self.group, counters=self.tile_counters)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the float8 values and block scales stand for, [out, in] in
        ``dtype`` (float32 products, one rounding)."""
        return dequantize_blocks(self.weight, self.weight_scale, self.block).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fp8_e4m3, block={self.block[0]}x{self.block[1]}")


def scale_grid(shape, block: tuple[int, int]) -> tuple[int, int]:
    """Scales of a [rows, cols] weight in ``block`` blocks: ceil-div, partial last blocks."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def expand_scales(scale: torch.Tensor, rows: int, cols: int,
                  block: tuple[int, int]) -> torch.Tensor:
    """The [rows, cols] float32 scale of every weight from its block grid."""
    return (scale.float().repeat_interleave(block[0], 0)[:rows]
            .repeat_interleave(block[1], 1)[:, :cols])


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 w, float32 scales ``scale_grid``): each block of w scaled so its largest
    magnitude lands on 448 (the partial blocks at the edges over the values they hold)."""
    rows, cols = w.shape
    grid_rows, grid_cols = scale_grid(w.shape, block)
    padded = w.new_zeros((grid_rows * block[0], grid_cols * block[1]), dtype=torch.float32)
    padded[:rows, :cols] = w.abs()
    amax = padded.view(grid_rows, block[0], grid_cols, block[1]).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(w, expand_scales(scale, rows, cols, block)), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """float32 q x its block scales."""
    return q.float() * expand_scales(scale, q.shape[0], q.shape[1], block)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 x, float32 scales [T, ceil(K / group)]): dynamic scaling of x [T, K], one
    scale per token and ``group`` columns (the torch form of ``fp8_block_gemm.group_quant``)."""
    tokens, cols = x.shape
    groups = -(-cols // group)
    padded = x.new_zeros((tokens, groups * group), dtype=torch.float32)
    padded[:, :cols] = x.abs()
    amax = padded.view(tokens, groups, group).amax(dim=-1)
    # a tensor divisor: CUDA torch multiplies by the reciprocal of a Python scalar one,
    # which differs from the IEEE quotient (what the kernel and CPU torch give) by an ulp
    scale = (amax / amax.new_tensor(FP8_MAX)).clamp(min=MIN_SCALE)
    return to_fp8(x, expand_scales(scale, tokens, cols, (1, group))), scale


def emulated_block_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                      w_scale: torch.Tensor, block: tuple[int, int],
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_block_gemm.block_gemm``'s numbers in float32 from dequantized operands."""
    x = dequantize_blocks(xq, x_scale, (1, block[1]))
    w = dequantize_blocks(wq, w_scale, block)
    return F.linear(x, w, None if bias is None else bias.float())
