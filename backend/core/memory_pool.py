"""KV memory: a request-to-token table and a token-granular KV slot pool.

Layout (one entry per token of KV cache, per layer)::

    req_to_token[row, pos] -> slot        int32, on the model's device
    k_buffer[layer][slot]  -> [num_kv_heads, head_dim]
    v_buffer[layer][slot]  -> [num_kv_heads, head_dim]

Slot 0 is never handed out: padded tokens (CUDA-graph padding) write there harmlessly.
The allocator's free list lives on the CPU; the scheduler owns it, the runner only reads
and writes the tensors.
"""
from __future__ import annotations

import torch

from .transfer import to_device


class ReqToTokenPool:
    """Rows of the request-to-token table, one per running request (``num_rows - 1`` usable)."""

    def __init__(self, num_rows: int, max_context_len: int, device: str) -> None:
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((num_rows, max_context_len), dtype=torch.int32, device=device)
        # row 0 is a dummy row for padded (CUDA-graph) batch entries; never handed out
        self._free_rows = list(range(num_rows - 1, 0, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        """Record ``slots`` as positions ``start..start+len(slots)`` of ``row``."""
        if slots:
            self.req_to_token[row, start:start + len(slots)] = to_device(
                slots, self.req_to_token.device, torch.int32)


class KVPool:
    """Token-granular KV slots over per-layer K/V tensors."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> None:
        self.size = size  # usable slots (slot 0 is extra, never allocated)
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free: list[int] = list(range(size, 0, -1))  # pop() hands out low slots first

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free slots, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def free_slots(self) -> list[int]:
        return list(self._free)
