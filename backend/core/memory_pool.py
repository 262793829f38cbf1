"""KV memory on the device: the request-to-token table and the per-layer K/V tensors.

Layout (one entry per token of KV cache, per layer)::

    req_to_token[row, pos] -> slot        int32, on the model's device
    k_buffer[layer][slot]  -> [num_kv_heads, head_dim]
    v_buffer[layer][slot]  -> [num_kv_heads, head_dim]

Which rows and slots are free is policy, kept in plain Python by
``kv_allocator``; this module only holds and writes the tensors. Slot 0 and row 0 are
never handed out: padded tokens (CUDA-graph padding) write there harmlessly.
"""
from __future__ import annotations

import torch

from .transfer import HostToDevice


class ReqToTokenPool:
    """The request-to-token table: ``num_rows`` rows (row 0 a dummy) of token slots."""

    def __init__(self, num_rows: int, max_context_len: int, device: str) -> None:
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((num_rows, max_context_len), dtype=torch.int32, device=device)

    def write(self, row: int, start: int, slots: list[int], copy: HostToDevice) -> None:
        """Record ``slots`` as positions ``start..start+len(slots)`` of ``row``."""
        if slots:
            self.req_to_token[row, start:start + len(slots)] = copy(slots, torch.int32)


class KVPool:
    """Per-layer K/V tensors of ``size + 1`` token slots."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> None:
        self.size = size  # usable slots (slot 0 is extra, never allocated)
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
