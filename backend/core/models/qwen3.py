"""Qwen3ForCausalLM: the Llama decoder with an RMSNorm over each head of q and k (before
the rotation) and no QKV bias."""
from __future__ import annotations

import torch

from ..layers.basic import RMSNorm
from .llama import Attention, LlamaForCausalLM


class Qwen3Attention(Attention):
    def __init__(self, config, qkv_bias: bool, layer_id: int) -> None:
        super().__init__(config, qkv_bias, layer_id)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        # q, k are column slices of the fused projection: rows of head_dim need a copy
        return (self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape[0], -1),
                self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape[0], -1))


class Qwen3ForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    attention_cls = Qwen3Attention
