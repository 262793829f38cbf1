"""Float8 e4m3 numbers: the one format both FP8 weights and the FP8 KV cache use.

e4m3 ("fn": finite, no infinities) holds magnitudes up to 448 with 3 mantissa bits, so
every value carries about 6% relative error wherever it lands in the normal range
(2^-6 .. 448) and less precision below it. A scale maps a tensor's range onto that:
``stored = value / scale`` and ``value ~ stored * scale``. Values past the range are
clamped to +-448 before the cast (the casts of torch and Triton differ past it: one
saturates, the other may give NaN), so an outlier costs accuracy, never a NaN.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# smallest scale: an all-zero row or head gets this instead of 0 (no division by 0)
MIN_SCALE = 1e-12


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` clamped to the e4m3 range and cast (``scale`` broadcasts)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def from_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``dtype`` (float32 math, one rounding)."""
    return (x.float() * scale).to(dtype)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 t, float32 scales [rows, 1]): each row of a 2-D ``t`` scaled so its
    largest magnitude lands on 448 (symmetric absmax scaling, one scale a row)."""
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(t, scale), scale
