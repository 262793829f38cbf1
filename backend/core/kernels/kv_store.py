"""Scatter the step's new K/V rows into their pool slots.

One program per new token writes that token's ``[num_kv_heads, head_dim]`` K and V tiles
to slot ``loc[t]``. K and V share the launch because they share the slot lookup.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    # loc is int64, so slot * stride is computed in 64 bits: a pool of a few million
    # slots times num_kv_heads * head_dim overflows int32 offsets.
    slot = tl.load(Loc + t)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(KBuf + slot * stride_kbs + h[:, None] * stride_kbh + d[None, :],
             k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + slot * stride_vbs + h[:, None] * stride_vbh + d[None, :],
             v.to(VBuf.dtype.element_ty), mask=mask)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """``k_buffer[loc] = k; v_buffer[loc] = v`` (cast to the pool dtype), in one launch.

    k_buffer, v_buffer: [num_slots + 1, KVH, D]; loc: int64 [T]; k, v: [T, KVH, D] with a
    unit stride on the last dim (views of a fused qkv projection are fine). Slots in
    ``loc`` must be distinct (padded tokens all point at the dummy slot 0, whose content
    is never read unmasked, so races there are harmless).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert v.shape == k.shape and loc.shape == (num_tokens,) and loc.dtype == torch.int64
    assert k_buffer.shape[1:] == (num_kv_heads, head_dim) and v_buffer.shape == k_buffer.shape
    for t in (k, v, k_buffer, v_buffer):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
