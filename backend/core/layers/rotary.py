"""Rotary position embeddings with a precomputed cos/sin table indexed by position."""
from __future__ import annotations

import torch
from torch import nn


def _inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    # Scaled variants (linear, llama3, yarn, ...): reuse the config library's published
    # formulas so every rope type a checkpoint declares is honoured exactly.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the model is built on "meta"
            inv_freq, scaling = _inv_freq(config, head_dim)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

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
