"""Rotary position embeddings with a precomputed cos/sin table indexed by position."""
from __future__ import annotations

import torch
from torch import nn


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's rope settings (for models with several, those of ``layer_type``)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    return params


def _inv_freq(config, head_dim: int, max_positions: int,
              layer_type: str | None) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rotary embeddings over part of the head (partial_rotary_factor "
                         f"{params['partial_rotary_factor']}) are not supported")
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    # Scaled variants (linear, llama3, yarn, longrope, ...): reuse the config library's
    # published formulas so every rope type a checkpoint declares is honoured exactly.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope type {rope_type!r}")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":
        # LongRoPE has two sets of factors: the long ones when sequences can outgrow the
        # pretraining length. The choice is made once, for the longest sequence this
        # engine serves, so every cached key was rotated by the same table.
        kwargs["seq_len"] = max_positions - 1
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the model is built on "meta"
            self._inv_freq, self._scaling = _inv_freq(config, head_dim, max_positions, layer_type)
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)  # [P, D/2]
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.fill_tables()

    def fill_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 tables, on ``device`` (default: where they are now).
        A model built on "meta" and moved with ``to_empty`` needs this."""
        device = device or self.cos.device
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float),
                                self._inv_freq.float())
        self.cos = (freqs.cos() * self._scaling).to(device)
        self.sin = (freqs.sin() * self._scaling).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KVH, D]; rotate-half convention (first/second halves)."""
        if q.is_cuda:
            from ..kernels.fused import rotary_embedding_

            rotary_embedding_(q, k, positions, self.cos, self.sin)  # in place, one launch
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
