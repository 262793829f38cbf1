"""Attention over the paged KV pool: the contract and the torch reference backend.

A backend stores the batch's new K/V into the pool at ``batch.out_cache_loc`` and then
attends each new query to its request's KV (prefix + new tokens, causally), reading
slots through ``req_to_token``. See ``forward_batch.py`` for the index layout.

Per layer, two options change what a query sees:
  * ``window`` W > 0 (sliding-window layers): the query at position i sees keys at
    positions i - W + 1 .. i, as Hugging Face's ``kv_idx > q_idx - sliding_window``.
    The pool and the radix cache still keep every position (a later layer, or a full-
    attention layer, needs them); only the attention skips the old ones.
  * ``softcap`` c > 0: scores (after ``scale``) become ``c * tanh(score / c)``.
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

    def decode_len_classes(self, batch_size: int, max_seq_len: int) -> list[int]:
        """Bounds on a decode batch's longest row, ascending and ending at ``max_seq_len``,
        between which this backend launches differently at this batch size. A CUDA graph
        captured with a class's bound as every ``seq_lens_cpu`` serves any batch whose
        longest row is within it."""
        return [max_seq_len]

    def cascade_min_prefix(self, batch_size: int) -> int:
        """The shortest shared prefix (``ForwardBatch.shared_prefix_len_cpu``) from which a
        decode batch of this size attends to it once for all rows (cascade attention);
        0 when this backend never does. A CUDA graph captured with this bound as the
        batch's shared prefix serves any batch sharing at least that much."""
        return 0

    def extend_warmup_lens(self, num_heads: int, dtype: torch.dtype) -> list[int]:
        """Extend lengths between which this backend's prefill kernels differ (compiled
        variants) for a model of ``num_heads`` query heads computing in ``dtype``: one
        dummy extend of each at start-up compiles them all."""
        return []

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float, *, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (new tokens). Returns [T, H, D]."""

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer_id: int, batch: ForwardBatch, scale: float, rotary, *,
                       window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """``forward`` after rotating q and k to their positions with ``rotary`` (a
        ``RotaryEmbedding``). q and k may be modified in place. A backend may fuse the
        rotation with its KV store, or (decode) with the attention kernel itself."""
        q, k = rotary(batch.positions, q, k)
        return self.forward(q, k, v, layer_id, batch, scale, window=window, softcap=softcap)


class TorchAttention(AttentionBackend):
    """Reference implementation with PyTorch SDPA: one padded call for decode batches,
    a loop over requests for extends."""

    def forward(self, q, k, v, layer_id, batch, scale, *, window=0, softcap=0.0):
        pool = self.kv_pool
        pool.store(layer_id, batch.out_cache_loc, k, v)
        if batch.is_decode:
            return self._decode(q, layer_id, batch, scale, window, softcap)
        out = torch.empty_like(q)
        start = 0
        for i, (prefix, n) in enumerate(zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)):
            seq_len = prefix + n
            slots = self.req_to_token[batch.req_pool_indices[i], :seq_len].long()
            keys, values = pool.read(layer_id, slots, q.dtype)
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [KVH, S, D]
            query = q[start:start + n].transpose(0, 1)  # [H, n, D]
            # query j sits at absolute position prefix + j and sees keys 0..prefix + j
            # (only the last `window` of them in a sliding-window layer)
            q_pos = torch.arange(prefix, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = _visible(q_pos, k_pos, window)
            o = _attend(query.to(keys.dtype), keys, values, mask, scale, softcap)
            out[start:start + n] = o.transpose(0, 1).to(out.dtype)
            start += n
        return out

    def _decode(self, q, layer_id, batch, scale, window, softcap):
        max_len = batch.max_seq_len
        slots = self.req_to_token[batch.req_pool_indices, :max_len].long()  # [B, S]
        keys, values = self.kv_pool.read(layer_id, slots, q.dtype)
        keys = keys.permute(0, 2, 1, 3)  # [B, KVH, S, D]
        values = values.permute(0, 2, 1, 3)
        k_pos = torch.arange(max_len, device=q.device)[None, :]
        q_pos = (batch.seq_lens - 1).unsqueeze(1)  # the new token is the last position
        valid = _visible(q_pos, k_pos, window)  # [B, S]; also hides the padding past it
        o = _attend(q.unsqueeze(2).to(keys.dtype), keys, values, valid[:, None, None, :],
                    scale, softcap)
        return o.squeeze(2).to(q.dtype)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    mask = k_pos <= q_pos
    if window > 0:
        mask &= k_pos > q_pos - window
    return mask


def _attend(query, keys, values, mask, scale: float, softcap: float) -> torch.Tensor:
    """Softmax attention of query [..., H, n, D] over keys/values [..., KVH, S, D]."""
    gqa = query.shape[-3] != keys.shape[-3]
    if softcap <= 0:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    group = query.shape[-3] // keys.shape[-3]
    keys = keys.repeat_interleave(group, dim=-3)
    values = values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap  # as the reference models cap scores
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(values.dtype), values)
