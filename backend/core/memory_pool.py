"""KV memory on the device: the request-to-token table and the per-layer K/V tensors.

Layout (one entry per token of KV cache, per layer)::

    req_to_token[row, pos] -> slot        int32, on the model's device
    k_buffer[layer][slot]  -> [num_kv_heads, head_dim]
    v_buffer[layer][slot]  -> [num_kv_heads, head_dim]

With an FP8 pool (``kv_cache_dtype="fp8_e4m3"``) a slot holds ``value / scale`` as
float8 e4m3, with one scale per layer and KV head (``k_scale[layer][kv_head]``, the same
for V); readers multiply back. Scales are fixed before the first token is stored.

Which rows and slots are free is policy, kept in plain Python by
``kv_allocator``; this module only holds and writes the tensors. Slot 0 and row 0 are
never handed out: padded tokens (CUDA-graph padding) write there harmlessly.
"""
from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE, from_fp8, to_fp8
from .transfer import HostToDevice

# EngineConfig.kv_cache_dtype -> the storage dtype (None: the model's dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": FP8_DTYPE}


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
    """Per-layer K/V tensors of ``size + 1`` token slots, stored in ``dtype``."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> None:
        self.size = size  # usable slots (slot 0 is extra, never allocated)
        self.dtype = dtype
        self.quantized = dtype == FP8_DTYPE
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # [layers, kv_heads] float32; all 1.0 (and unused) unless the pool is FP8
        self.k_scale = torch.ones((num_layers, num_kv_heads), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((num_layers, num_kv_heads), dtype=torch.float32, device=device)

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """The FP8 scales, [layers, kv_heads] each (copied in place: kernels and CUDA
        graphs keep the same tensors)."""
        assert self.quantized and k_scale.shape == self.k_scale.shape == v_scale.shape
        self.k_scale.copy_(k_scale)
        self.v_scale.copy_(v_scale)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k_buffer[layer][loc] = k`` (and v), quantized when the pool is FP8."""
        if self.quantized:
            k = to_fp8(k, self.k_scale[layer][:, None])
            v = to_fp8(v, self.v_scale[layer][:, None])
        self.k_buffer[layer][loc] = k.to(self.dtype)
        self.v_buffer[layer][loc] = v.to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype):
        """(K, V) of ``slots`` [...] as [..., kv_heads, head_dim]: in the pool's dtype, or
        dequantized to ``dtype`` when the pool is FP8."""
        k, v = self.k_buffer[layer][slots], self.v_buffer[layer][slots]
        if not self.quantized:
            return k, v
        return (from_fp8(k, self.k_scale[layer][:, None], dtype),
                from_fp8(v, self.v_scale[layer][:, None], dtype))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes of one token over all layers (the per-head scales are per pool, not
        per token)."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
