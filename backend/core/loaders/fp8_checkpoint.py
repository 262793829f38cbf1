"""Hugging Face checkpoints whose linear weights are stored as float8 e4m3 with scales.

Two layouts, named by config.json's ``quantization_config``:

* ``quant_method: "compressed-tensors"`` (format ``float-quantized`` or
  ``naive-quantized``), every config group's weights symmetric 8-bit floats with
  strategy ``tensor``, ``channel`` or ``block``: ``<layer>.weight`` (float8) and
  ``<layer>.weight_scale`` ([1], [out, 1] or [out / b, in / b]);
* ``quant_method: "fp8"`` (transformers' fine-grained FP8): ``<layer>.weight`` with
  ``<layer>.weight_scale_inv`` (blocks of ``weight_block_size``, multiplied despite the
  name) or a per-tensor ``<layer>.weight_scale``.

Like the other loaders, this one hands the model dequantized weights: each float8 weight
times its scale, in float32. With ``quantization="fp8"`` the engine then quantizes them
again with one scale per output channel. A per-channel checkpoint comes back as the same
float8 values (each row's largest magnitude maps to 448 again, the scale is recomputed
from it); per-tensor and block scales become per-row ones. Activation scales
(``input_scale``: activations are scaled per token as they arrive) and KV-cache scales
(``k_scale``, ``v_scale``: the engine calibrates its own) are not used. Anything else
(integer or 4-bit schemes, zero points, other methods) is refused when the config is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a float8 checkpoint stores its weight scales."""

    method: str  # "compressed-tensors" or "fp8"
    block: tuple[int, int]  # rows, cols of a scale block (used when the scale is 2-D)


def fp8_scheme(config) -> Fp8Scheme | None:
    """The checkpoint's float8 scheme; None for an unquantized checkpoint. Raises
    ValueError for a quantization this engine cannot read."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 checkpoint format {qc.get('fmt')!r} is not supported (e4m3 only)")
        return Fp8Scheme("fp8", _block(qc.get("weight_block_size")))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"checkpoint quantization {method!r} is not supported: only float8 "
                     "e4m3 checkpoints (quant_method 'fp8' or 'compressed-tensors' with "
                     "8-bit float weights) are read")


def _block(size) -> tuple[int, int]:
    return (int(size[0]), int(size[1])) if size else DEFAULT_BLOCK


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported: only "
                         "'float-quantized' (8-bit float weights)")
    block = DEFAULT_BLOCK
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise ValueError(f"compressed-tensors group {name!r}: weights of "
                             f"{w.get('num_bits')}-bit {w.get('type')} are not supported "
                             "(8-bit float only)")
        if w.get("symmetric") is False:
            raise ValueError(f"compressed-tensors group {name!r}: asymmetric weights "
                             "(zero points) are not supported")
        if w.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors group {name!r}: weight strategy "
                             f"{w.get('strategy')!r} is not supported (tensor, channel, block)")
        if w.get("strategy") == "block":
            block = _block(w.get("block_structure"))
    return Fp8Scheme("compressed-tensors", block)


def dequantized(weights: Iterator[tuple[str, torch.Tensor]],
                scheme: Fp8Scheme) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each float8 weight replaced by weight x scale (float32) and the
    scale tensors dropped. A weight and its scale may come in either order."""
    weights_by_layer: dict[str, torch.Tensor] = {}
    scales_by_layer: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(UNUSED_SUFFIXES):
            continue
        layer, _, kind = name.rpartition(".")
        if kind in ("weight_scale", "weight_scale_inv"):
            scales_by_layer[layer] = tensor
        elif kind == "weight_zero_point":
            raise ValueError(f"{name}: zero points (asymmetric weights) are not supported")
        elif kind == "weight" and tensor.dtype == torch.float8_e4m3fn:
            weights_by_layer[layer] = tensor
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{name}: a float8 tensor of type {tensor.dtype} is not supported")
        else:
            yield name, tensor
            continue
        if layer in weights_by_layer and layer in scales_by_layer:
            w, s = weights_by_layer.pop(layer), scales_by_layer.pop(layer)
            yield f"{layer}.weight", dequantize(w, s, scheme.block, layer)
    unpaired = sorted(weights_by_layer) + sorted(scales_by_layer)
    if unpaired:
        raise ValueError(f"FP8 checkpoint: weights without scales or scales without "
                         f"weights: {unpaired[:5]}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               name: str = "weight") -> torch.Tensor:
    """float32 ``weight`` x ``scale``, the scale per tensor ([] or [1]), per row ([rows]
    or [rows, 1]) or per block ([ceil(rows / b0), ceil(cols / b1)])."""
    rows, cols = weight.shape
    w = weight.float()
    s = scale.float()
    if s.numel() == 1:
        return w * s.reshape(())
    if s.shape in ((rows,), (rows, 1)):
        return w * s.reshape(rows, 1)
    b0, b1 = block
    if s.dim() == 2 and s.shape == (-(-rows // b0), -(-cols // b1)):
        full = s.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
        return w * full
    raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} fits neither a tensor, "
                     f"its {rows} rows nor {b0}x{b1} blocks of its {rows}x{cols} weight")
