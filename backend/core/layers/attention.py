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
    supports_cuda_graph = False  # decode launches depend only on the batch size

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def prepare(self, batch: ForwardBatch) -> None:
        """Per-batch set-up shared by all layers (index tensors, workspaces). Optional."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (new tokens). Returns [T, H, D]."""

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer_id: int, batch: ForwardBatch, scale: float, rotary) -> torch.Tensor:
        """``forward`` after rotating q and k to their positions with ``rotary`` (a
        ``RotaryEmbedding``). q and k may be modified in place. A backend may fuse the
        rotation with its KV store, or (decode) with the attention kernel itself."""
        q, k = rotary(batch.positions, q, k)
        return self.forward(q, k, v, layer_id, batch, scale)


class TorchAttention(AttentionBackend):
    """Reference implementation with PyTorch SDPA: one padded call for decode batches,
    a loop over requests for extends."""

    def forward(self, q, k, v, layer_id, batch, scale):
        k_buf = self.kv_pool.k_buffer[layer_id]
        v_buf = self.kv_pool.v_buffer[layer_id]
        k_buf[batch.out_cache_loc] = k.to(k_buf.dtype)
        v_buf[batch.out_cache_loc] = v.to(v_buf.dtype)
        gqa = q.shape[1] != k.shape[1]
        if batch.is_decode:
            return self._decode(q, k_buf, v_buf, batch, scale, gqa)
        out = torch.empty_like(q)
        start = 0
        for i, (prefix, n) in enumerate(zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)):
            seq_len = prefix + n
            slots = self.req_to_token[batch.req_pool_indices[i], :seq_len].long()
            keys = k_buf[slots].transpose(0, 1)  # [KVH, S, D]
            values = v_buf[slots].transpose(0, 1)
            query = q[start:start + n].transpose(0, 1)  # [H, n, D]
            # query j sits at absolute position prefix + j and sees keys 0..prefix + j
            mask = torch.ones((n, seq_len), dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            o = F.scaled_dot_product_attention(query.to(keys.dtype), keys, values, attn_mask=mask,
                                               scale=scale, enable_gqa=gqa)
            out[start:start + n] = o.transpose(0, 1).to(out.dtype)
            start += n
        return out

    def _decode(self, q, k_buf, v_buf, batch, scale, gqa):
        max_len = batch.max_seq_len
        slots = self.req_to_token[batch.req_pool_indices, :max_len].long()  # [B, S]
        keys = k_buf[slots].permute(0, 2, 1, 3)  # [B, KVH, S, D]
        values = v_buf[slots].permute(0, 2, 1, 3)
        valid = torch.arange(max_len, device=q.device) < batch.seq_lens.unsqueeze(1)  # [B, S]
        o = F.scaled_dot_product_attention(q.unsqueeze(2).to(keys.dtype), keys, values,
                                           attn_mask=valid[:, None, None, :], scale=scale,
                                           enable_gqa=gqa)
        return o.squeeze(2).to(q.dtype)
