"""Hugging Face checkpoints whose linear weights are stored as float8 e4m3 with scales.

Two layouts, named by config.json's ``quantization_config``:

* ``quant_method: "compressed-tensors"`` (format ``float-quantized`` or
  ``naive-quantized``), every config group's weights symmetric 8-bit floats with
  strategy ``tensor``, ``channel`` or ``block``: ``<layer>.weight`` (float8) and
  ``<layer>.weight_scale`` ([1], [out, 1] or [out / b, in / b]);
* ``quant_method: "fp8"`` (transformers' fine-grained FP8): ``<layer>.weight`` with
  ``<layer>.weight_scale_inv`` (blocks of ``weight_block_size``, multiplied despite the
  name) or a per-tensor ``<layer>.weight_scale``.

Two ways to read one:

* ``dequantized``: what ``Checkpoint.weights()`` gives, like every other loader: each
  float8 weight times its scale, in float32 (an engine with ``quantization="none"``);
* ``Float8Weights``: for an engine that keeps the weights in float8, the float8 weights
  as stored and their scales set aside; ``layers/fp8_install.py`` builds the float8
  layers from both after the load, with the checkpoint's own values and scales.

Activation scales (``input_scale``: activations are scaled per token as they arrive) and
KV-cache scales (``k_scale``, ``v_scale``: the engine calibrates its own) are not used.
Anything else (integer or 4-bit schemes, zero points, other methods) is refused when the
config is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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
        role, layer = _role(name, tensor)
        if role == "other":
            yield name, tensor
            continue
        if role == "scale":
            scales_by_layer[layer] = tensor
        elif role == "float8":
            weights_by_layer[layer] = tensor
        if layer in weights_by_layer and layer in scales_by_layer:
            w, s = weights_by_layer.pop(layer), scales_by_layer.pop(layer)
            yield f"{layer}.weight", dequantize(w, s, scheme.block, layer)
    unpaired = sorted(weights_by_layer) + sorted(scales_by_layer)
    if unpaired:
        raise ValueError(f"FP8 checkpoint: weights without scales or scales without "
                         f"weights: {unpaired[:5]}")


def _role(name: str, tensor: torch.Tensor) -> tuple[str, str]:
    """(role, layer) of a stored tensor: role "unused" (a scale this engine does not
    read), "scale" (a weight's), "float8" (a float8 weight) or "other" (as any checkpoint
    holds); ValueError for what this engine cannot read."""
    layer, _, kind = name.rpartition(".")
    if name.endswith(UNUSED_SUFFIXES):
        return "unused", layer
    if kind in ("weight_scale", "weight_scale_inv"):
        return "scale", layer
    if kind == "weight_zero_point":
        raise ValueError(f"{name}: zero points (asymmetric weights) are not supported")
    if kind == "weight" and tensor.dtype == torch.float8_e4m3fn:
        return "float8", layer
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name}: a float8 tensor of type {tensor.dtype} is not supported")
    return "other", layer


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               name: str = "weight") -> torch.Tensor:
    """float32 ``weight`` x ``scale``, the scale per tensor ([] or [1]), per row ([rows]
    or [rows, 1]) or per block ([ceil(rows / b0), ceil(cols / b1)])."""
    return weight.float() * StoredScale.of(scale, *weight.shape, block, name).full()


@dataclass(frozen=True)
class StoredScale:
    """A float8 weight's scale as its checkpoint stores it, with the weight's shape."""

    scale: torch.Tensor  # float32: [] or [1], [rows] or [rows, 1], or the block grid
    rows: int
    cols: int
    block: tuple[int, int]  # the checkpoint's block (what a 2-D scale is a grid of)
    kind: str  # "tensor", "channel" or "block"

    @classmethod
    def of(cls, scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int],
           name: str = "weight") -> "StoredScale":
        """``scale`` of a [rows, cols] weight; ValueError for a shape that fits no kind."""
        b0, b1 = block
        # a grid of one block is a block scale, not a tensor's (its layer takes the
        # activations in groups, as the checkpoint's other layers do)
        if scale.shape in ((rows,), (rows, 1)):
            kind = "channel"
        elif scale.dim() == 2 and scale.shape == (-(-rows // b0), -(-cols // b1)):
            kind = "block"
        elif scale.numel() == 1:
            kind = "tensor"
        else:
            raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} fits neither a "
                             f"tensor, its {rows} rows nor {b0}x{b1} blocks of its "
                             f"{rows}x{cols} weight")
        return cls(scale.float(), rows, cols, block, kind)

    def per_row(self) -> torch.Tensor:
        """float32 [rows]: one scale a row (of a "tensor" or "channel" scale)."""
        assert self.kind != "block"
        return self.scale.reshape(-1).expand(self.rows).contiguous() \
            if self.kind == "tensor" else self.scale.reshape(self.rows)

    def full(self) -> torch.Tensor:
        """float32 [rows, cols]: every weight's scale."""
        if self.kind == "block":
            b0, b1 = self.block
            return (self.scale.repeat_interleave(b0, 0)[:self.rows]
                    .repeat_interleave(b1, 1)[:, :self.cols])
        return self.per_row().view(-1, 1).expand(self.rows, self.cols)


@dataclass
class Float8Weights:
    """A float8 checkpoint read for a model that keeps its weights in float8.

    ``stream`` passes the float8 weights on as they are stored (the model's load copies
    them into its dtype, which holds every e4m3 value exactly: float32, bfloat16 and
    float16 all have the exponent range and the 3 mantissa bits) and keeps each one's
    scale in ``scales``, by layer name without the ``model.`` prefix, for
    ``layers/fp8_install.py`` to build the float8 layers from after the load."""

    scheme: Fp8Scheme
    scales: dict[str, StoredScale] = field(default_factory=dict)

    def stream(self, weights: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        shapes: dict[str, tuple[int, int]] = {}  # float8 weights read, by layer
        raw_scales: dict[str, torch.Tensor] = {}  # scales read, by layer
        for name, tensor in weights:
            role, layer = _role(name, tensor)
            if role == "scale":
                raw_scales[layer] = tensor
            elif role == "float8":
                shapes[layer] = tuple(tensor.shape)
                yield name, tensor
            elif role == "other":
                yield name, tensor
        unpaired = sorted(set(shapes) ^ set(raw_scales))
        if unpaired:
            raise ValueError(f"FP8 checkpoint: weights without scales or scales without "
                             f"weights: {unpaired[:5]}")
        for layer, scale in raw_scales.items():
            self.scales[layer.removeprefix("model.")] = StoredScale.of(
                scale, *shapes[layer], self.scheme.block, layer)
