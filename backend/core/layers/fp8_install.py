"""The decoder's linear layers turned float8 after the load, as ``quantization`` asks.

Two sources:

* a checkpoint in the model dtype (bf16, float32): every ``nn.Linear`` but the LM head
  is quantized at load, with one scale per output channel (``"fp8"``, ``Fp8Linear``) or
  per 128 x 128 block (``"fp8_block"``, ``Fp8BlockLinear``);
* a float8 checkpoint (``loaders/fp8_checkpoint.Float8Weights``): the load copied its
  float8 values into the model's weights unscaled (exactly: the model dtype holds every
  e4m3 value), and each layer is built back from them and the checkpoint's own scales,
  in the checkpoint's form whatever ``quantization`` names: per-tensor and per-channel
  scales make an ``Fp8Linear`` (a per-tensor scale repeated on every row), block scales
  an ``Fp8BlockLinear``. The float8 bytes are the checkpoint's and nothing is quantized
  twice.

A fused projection takes the scales of its checkpoint pieces in order (QKV from q, k, v;
gate/up from gate, up; ``stacked_params`` of the model says which). Block grids stack when
every piece but the last has a whole number of block rows; otherwise each row takes
its own piece's block scales (``Fp8BlockLinear`` with 1-row blocks: the same numbers).
Pieces that disagree (some scaled, some not, or block beside per-channel) are
dequantized and the layer quantized at load as ``quantization`` says. A layer that
stays in the model dtype (the LM head) but was stored in float8 is dequantized in place.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..fp8 import FP8_DTYPE
from .fp8_block_linear import Fp8BlockLinear
from .fp8_linear import Fp8Linear

logger = logging.getLogger(__name__)

KEEP = ("lm_head",)  # linear layers that stay in the model dtype (fp8_linear.py: why)


class Installed(NamedTuple):
    """How many float8 layers ``install_fp8`` made each way."""

    from_checkpoint: int  # from a float8 checkpoint's own values and scales
    quantized: int  # quantized at load


def quantizer(quantization: str) -> Callable[[nn.Linear], nn.Module]:
    """The float8 layer an ``nn.Linear`` becomes at load under ``quantization``."""
    if quantization == "fp8":
        return Fp8Linear.from_linear
    if quantization == "fp8_block":
        return Fp8BlockLinear.from_linear
    raise ValueError(f"no float8 layers for quantization {quantization!r}")


def install_fp8(model: nn.Module, quantization: str, scales: dict | None = None) -> Installed:
    """Replace the decoder's ``nn.Linear`` layers of a loaded ``model`` by float8 ones,
    one layer at a time (the peak memory is the model plus one layer). ``scales``: a
    float8 checkpoint's (``Float8Weights.scales``, by layer name); None for a checkpoint
    in the model dtype."""
    scales = dict(scales or {})
    from_ckpt = quantized = 0
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name.rpartition(".")[2] not in KEEP]
    for name in names:
        linear = model.get_submodule(name)
        # a fused layer stored fused (Phi-3's qkv_proj) is its own one piece
        pieces = [name] if name in scales else _piece_names(name, model.stacked_params)
        found = [scales.pop(p) for p in pieces if p in scales]
        if len(found) not in (0, len(pieces)):
            raise ValueError(f"float8 checkpoint: only some of {pieces} are stored in float8")
        layer = from_checkpoint(linear, found) if found else None
        if layer is None:
            _dequantize_in_place(linear, found)
            layer = quantizer(quantization)(linear)
            quantized += 1
        else:
            from_ckpt += 1
        _swap(model, name, layer)
    modules = dict(model.named_modules())
    for name, stored in scales.items():  # float8 layers kept in the model dtype
        if name in modules:  # (the others, a tied head's, were not loaded)
            _dequantize_in_place(modules[name], [stored])
    logger.info("FP8 weights: %d linear layers from the checkpoint's float8, %d quantized "
                "at load (%s)", from_ckpt, quantized, quantization)
    return Installed(from_ckpt, quantized)


def from_checkpoint(linear: nn.Linear, pieces: list) -> nn.Module | None:
    """The float8 layer of ``linear``, whose weight holds the checkpoint's float8 values
    unscaled, from its pieces' ``StoredScale``s; None when the pieces disagree."""
    kinds = {p.kind for p in pieces}
    weight = linear.weight.detach().to(FP8_DTYPE)  # exact: float8 values, stored wider
    bias = None if linear.bias is None else linear.bias.detach()
    device = weight.device  # the scales were read on the host
    if kinds <= {"tensor", "channel"}:
        return Fp8Linear(weight, torch.cat([p.per_row() for p in pieces]).to(device), bias)
    if kinds != {"block"} or len({p.block for p in pieces}) != 1:
        return None
    block_rows, group = pieces[0].block
    if all(p.rows % block_rows == 0 for p in pieces[:-1]):
        grid = torch.cat([p.scale for p in pieces])
        return Fp8BlockLinear(weight, grid.to(device), bias, (block_rows, group))
    rows = torch.cat([p.scale.repeat_interleave(block_rows, 0)[:p.rows] for p in pieces])
    return Fp8BlockLinear(weight, rows.to(device), bias, (1, group))


def _piece_names(name: str, stacked) -> list[str]:
    """The checkpoint layers ``name`` was loaded from, in shard order: its pieces when it
    is a fused layer (``layers.0.self_attn.qkv_proj`` <- q_proj, k_proj, v_proj), else
    itself."""
    parent, _, child = name.rpartition(".")
    pieces = sorted((shard, piece) for piece, fused, shard in stacked if fused == child)
    return [f"{parent}.{piece}" for _, piece in pieces] or [name]


def _dequantize_in_place(module: nn.Module, pieces: list) -> None:
    """Multiply each piece's rows of ``module.weight`` (float8 values, unscaled, the
    pieces stacked in order) by its scales: the weight the checkpoint stands for, in the
    model dtype."""
    start = 0
    with torch.no_grad():
        for piece in pieces:
            rows = module.weight[start:start + piece.rows]
            rows.copy_(rows.float() * piece.full().to(rows.device))
            start += piece.rows


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
