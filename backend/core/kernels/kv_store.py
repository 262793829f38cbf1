"""Scatter the step's new K/V rows into their pool slots.

One program per new token writes that token's ``[num_kv_heads, head_dim]`` K and V tiles
to slot ``loc[t]``. K and V share the launch because they share the slot lookup.
A float8 pool stores ``k / k_scale[head]`` (and v likewise), clamped to the e4m3 range.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scales import check_kv_scales, saturate


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Loc, KScale, VScale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
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
    if KV_FP8:
        hmask = h < NUM_KV_HEADS
        k = saturate(tl.math.div_rn(k.to(tl.float32),
                                    tl.load(KScale + h, mask=hmask, other=1.0)[:, None]))
        v = saturate(tl.math.div_rn(v.to(tl.float32),
                                    tl.load(VScale + h, mask=hmask, other=1.0)[:, None]))
    tl.store(KBuf + slot * stride_kbs + h[:, None] * stride_kbh + d[None, :],
             k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + slot * stride_vbs + h[:, None] * stride_vbh + d[None, :],
             v.to(VBuf.dtype.element_ty), mask=mask)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """``k_buffer[loc] = k; v_buffer[loc] = v`` (cast to the pool dtype), in one launch.

    k_buffer, v_buffer: [num_slots + 1, KVH, D]; loc: int64 [T]; k, v: [T, KVH, D] with a
    unit stride on the last dim (views of a fused qkv projection are fine). Slots in
    ``loc`` must be distinct (padded tokens all point at the dummy slot 0, whose content
    is never read unmasked, so races there are harmless). k_scale, v_scale: float32
    [KVH], required for a float8 pool.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert v.shape == k.shape and loc.shape == (num_tokens,) and loc.dtype == torch.int64
    assert k_buffer.shape[1:] == (num_kv_heads, head_dim) and v_buffer.shape == k_buffer.shape
    for t in (k, v, k_buffer, v_buffer):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    fp8 = check_kv_scales(k_buffer, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, loc, k_scale if fp8 else k, v_scale if fp8 else k,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=fp8, num_warps=4,
    )
