"""Attention over the paged KV pool: the contract and the torch reference backend.

A backend stores the batch's new K/V into the pool at ``batch.out_cache_loc`` and then
attends each new query to its request's KV (prefix + new tokens, causally), reading
slots through ``req_to_token``. See ``forward_batch.py`` for the index layout.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from ..forward_batch import ForwardBatch
from ..memory_pool import KVPool


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def prepare(self, batch: ForwardBatch) -> None:
        """Per-batch set-up shared by all layers (index tensors, workspaces). Optional."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (new tokens). Returns [T, H, D]."""


class TorchAttention(AttentionBackend):
    """Reference implementation: a loop over requests with PyTorch SDPA."""

    def forward(self, q, k, v, layer_id, batch, scale):
        k_buf = self.kv_pool.k_buffer[layer_id]
        v_buf = self.kv_pool.v_buffer[layer_id]
        k_buf[batch.out_cache_loc] = k.to(k_buf.dtype)
        v_buf[batch.out_cache_loc] = v.to(v_buf.dtype)
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        group = num_heads // num_kv_heads
        start = 0
        for i, (prefix, n) in enumerate(zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)):
            seq_len = prefix + n
            slots = self.req_to_token[batch.req_pool_indices[i], :seq_len].long()
            keys = k_buf[slots].transpose(0, 1)  # [KVH, S, D]
            values = v_buf[slots].transpose(0, 1)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=0)
                values = values.repeat_interleave(group, dim=0)
            query = q[start:start + n].transpose(0, 1)  # [H, n, D]
            # query j sits at absolute position prefix + j and sees keys 0..prefix + j
            mask = torch.ones((n, seq_len), dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            o = F.scaled_dot_product_attention(query.to(keys.dtype), keys, values,
                                               attn_mask=mask, scale=scale)
            out[start:start + n] = o.transpose(0, 1).to(out.dtype)
            start += n
        return out
