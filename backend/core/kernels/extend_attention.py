"""Causal prefill/extend attention over the paged KV pool (flash-attention style).

Grid: (request, query head, block of BLOCK_M new-token rows). A program keeps its Q tile
in registers and streams the request's K/V in BLOCK_N-slot tiles gathered through
``req_to_token``, keeping a running max ``m``, running denominator ``l`` and an
unnormalised accumulator (online softmax), so nothing of size seq_len is materialised.

Invariants the kernel relies on:
  * K/V of the new tokens are already in the pool (``store_kv`` ran first), so prefix
    and new tokens are read the same way: positions ``0 .. seq_len - 1`` of the row.
  * New token ``j`` of request ``b`` is at absolute position ``prefix_b + j`` and sees
    positions ``<= prefix_b + j``; ``seq_len_b == prefix_b + ext_len_b``.
  * The running max starts at a finite floor, so a row with no visible key in a tile
    (a padded row, or a tile older than a sliding window) adds exactly 0 to its sums
    and a fully-masked row yields ``l == 0`` and a 0 output instead of NaN.
  * ``WINDOW`` W > 0 (a sliding-window layer): row ``q_pos`` sees positions
    ``q_pos - W + 1 .. q_pos`` only. The KV loop then starts at the first tile holding
    the oldest position any row of the block sees:

        positions  0 ........ lo ............ first_q .... last_q
                   (skipped)   |<- W - 1 ->|  the block's rows
                               lo = first_q - W + 1, rounded down to a tile

Softmax runs in base 2: logits are pre-multiplied by ``sm_scale * log2(e)``; with
``SOFTCAP`` c > 0 the scaled score s becomes ``c * tanh(s / c)`` first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# finite floor for the running max: exp2(floor - real_logit) underflows to exactly 0
NEG_FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _extend_attn_kernel(
    Q, O, KBuf, VBuf, ReqToToken, ReqPoolIdx, SeqLens, PrefixLens, QoIndptr,
    sm_scale, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_rt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)

    q_start = tl.load(QoIndptr + b)
    ext_len = tl.load(QoIndptr + b + 1) - q_start
    # the grid is sized by the longest extend in the batch; shorter requests stop here
    if mblk * BLOCK_M >= ext_len:
        return
    prefix = tl.load(PrefixLens + b)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    kv_head = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this request's new tokens
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext_len
    d_mask = offs_d < HEAD_DIM  # head_dim 80/96 are padded up to 128 and masked
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(KBuf.dtype.element_ty)  # same rule as the reference: q in the pool's dtype
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], NEG_FLOOR, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # the last row of this block sits at prefix + (mblk + 1) * BLOCK_M - 1: nothing past it
    # is visible to any row of the block, so the KV loop stops there
    kv_end = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)
    kv_start = 0
    if WINDOW > 0:
        kv_start = tl.maximum(prefix + mblk * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        # out-of-range lanes read slot 0 (the dummy slot), then get masked to -inf
        slots = tl.load(ReqToToken + row * stride_rt + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        qk = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), sm_scale, softcap,
                     SOFTCAP)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            visible &= offs_n[None, :] > q_pos[:, None] - WINDOW
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(O + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _scores(dot, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """Base-2 logits from q.k: scaled, and soft-capped (c * tanh(s / c)) with SOFTCAP."""
    if SOFTCAP:
        s = dot * sm_scale
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both saturations, no inf / inf
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        return s * LOG2E
    return dot * (sm_scale * LOG2E)


def _launch_config(block_d: int, dtype: torch.dtype, max_extend_len: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), sized so Q/acc tiles stay in registers."""
    if dtype == torch.float32:
        block_m, block_n, warps = (64, 32, 4) if block_d <= 128 else (32, 32, 4)
    elif block_d <= 64:
        block_m, block_n, warps = 128, 64, 4
    elif block_d <= 128:
        block_m, block_n, warps = 128, 64, 8
    else:
        block_m, block_n, warps = 64, 32, 8
    # short extends (decode rows riding in a mixed batch) would waste most of a big tile
    block_m = min(block_m, max(16, triton.next_power_of_2(max(max_extend_len, 1))))
    return block_m, block_n, warps, 2


def extend_attention(q: torch.Tensor, o: torch.Tensor, k_buffer: torch.Tensor,
                     v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     extend_prefix_lens: torch.Tensor, qo_indptr: torch.Tensor,
                     max_extend_len: int, sm_scale: float, window: int = 0,
                     softcap: float = 0.0) -> None:
    """Write into ``o`` [T, H, D] the causal attention of the new tokens ``q`` [T, H, D].

    k_buffer, v_buffer: [num_slots + 1, KVH, D] with H % KVH == 0; req_to_token: int32
    [rows, max_context]; req_pool_indices, seq_lens, extend_prefix_lens: int [B];
    qo_indptr: int [B + 1]; max_extend_len: host int >= every extend length (it only
    sizes the grid, so no device sync is needed). window, softcap: see the module
    docstring (0: off).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    batch = req_pool_indices.shape[0]
    assert num_heads % num_kv_heads == 0 and k_buffer.shape[2] == head_dim
    assert o.shape == q.shape and q.stride(-1) == 1 and o.stride(-1) == 1
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1 and req_to_token.stride(1) == 1
    if batch == 0 or num_tokens == 0 or max_extend_len <= 0:
        return
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, warps, stages = _launch_config(block_d, k_buffer.dtype, max_extend_len)
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_attn_kernel[grid](
        q, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
        extend_prefix_lens, qo_indptr,
        sm_scale, softcap,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # fp32 pools keep full-precision products (tf32 would cost ~1e-3 abs error)
        DOT_PRECISION="ieee" if k_buffer.dtype == torch.float32 else "tf32",
        WINDOW=max(0, int(window)), SOFTCAP=softcap > 0,
        num_warps=warps, num_stages=stages,
    )
