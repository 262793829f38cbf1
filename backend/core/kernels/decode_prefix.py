"""Cascade attention's prefix kernel: a KV prefix that every row of a decode batch shares,
read once for many rows.

Requests that matched the same cached prompt (few-shot examples, a system prompt) hold
the same pool slots for it, so positions 0 .. L-1 of every row are the same K/V. Split-KV
decode (``decode_stages.py``) reads them once per row: 64 rows over a 1,024-token prefix
read 64 copies of it, and decode is bound by the KV bytes it reads. Here one program
takes a tile of query rows (requests x the GROUP query heads of one kv head, flattened:
64 rows at GROUP 4 are 16 requests) and a split of the prefix, and computes their scores
as a small GEMM: [BLOCK_M, D] x [D, BLOCK_N] per KV tile. The prefix is then read once
per 64 query rows instead of once per row, and the dot runs on a tile tall enough for
the tensor cores (stage 1 has GROUP rows, padded to 16)::

    grid (row tiles, kv heads, PREFIX_SPLITS)
    query row m of tile t:  request t * (BLOCK_M // GROUP) + m // GROUP,
                            head kv_head * GROUP + m % GROUP
    prefix split s:         positions s * chunk .. min((s + 1) * chunk, L) - 1,
                            chunk = ceil(L / PREFIX_SPLITS) rounded up to whole BLOCK_N

Each (row, head, split) partial (normalised acc, lse) goes to the decode workspace, in
the lanes after the row's NUM_SPLITS suffix splits (stage 1 covers L .. seq_len - 1 of
each row); stage 2 merges both kinds alike. Every prefix split writes all the tile's rows
that take part, an empty split the neutral partial (acc 0, lse NEG_FLOOR: weight 0 next
to the row's suffix, which always holds the new token), so stage 2 needs no knowledge of
this layout.

L is read on the device (a CUDA graph replays with the real L copied into its buffer),
and the grid depends only on (batch, kv heads, splits). A row takes part only where
seq_len > L: CUDA-graph padding rows (seq_len 0) never do, whatever the buffer holds.
The slots are those of the batch's first row, which is real whenever L > 0 matters.

With ``ROPE`` (the fused decode path, where q arrives unrotated) this kernel rotates q
itself with stage 1's float32 math, rather than waiting for stage 1 to publish a rotated
copy: the two launches then depend on nothing of each other's (stage 1's store of the
new K/V lands at position seq_len - 1 >= L, never in the prefix), and no extra buffer or
ordering is needed. FP8 pools and softcap as in stage 1. Sliding-window layers never
cascade (their rows do not all see the prefix).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .decode_stages import attend_positions, split_lse
from .pdl import await_previous_kernel


@triton.jit
def _decode_prefix(
    Q, KBuf, VBuf, ReqToToken, ReqPoolIdx, SeqLens, PrefixLen, WorkAcc, WorkLse,
    Pos, Cos, Sin, KScale, VScale, sm_scale, softcap, batch,
    stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_rt,
    stride_cos, stride_sin,
    GROUP: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROPE: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched early (pdl.py): q is the previous kernel's
        await_previous_kernel()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    REQS: tl.constexpr = BLOCK_M // GROUP  # whole requests per tile
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(KScale + kv_head)
        v_scale = tl.load(VScale + kv_head)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    req = (tile * REQS + offs_m // GROUP).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP
    in_batch = (offs_m < REQS * GROUP) & (req < batch)
    shared = tl.load(PrefixLen)
    seq_len = tl.load(SeqLens + req, mask=in_batch, other=0)
    takes_part = in_batch & (seq_len > shared)

    chunk = tl.cdiv(tl.cdiv(shared, PREFIX_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, shared)
    # a tile of padding rows only (a CUDA graph's tail) reads nothing
    end = tl.where(tl.max(takes_part.to(tl.int32), 0) > 0, end, start)
    first_row = tl.load(ReqPoolIdx).to(tl.int64)  # every taking part row holds these slots

    q_ptr = Q + req[:, None] * stride_qb + heads[:, None] * stride_qh
    qmask = takes_part[:, None] & d_mask[None, :]
    if ROPE:
        # stage 1's rotate-half rotary (kernels/fused.py), per row at its own position
        half: tl.constexpr = HEAD_DIM // 2
        lo = offs_d < half
        d_pair = tl.where(lo, offs_d + half, offs_d - half)
        d_freq = tl.where(lo, offs_d, offs_d - half)
        sign = tl.where(lo, -1.0, 1.0)
        pos = tl.load(Pos + req, mask=takes_part, other=0).to(tl.int64)
        cos = tl.load(Cos + pos[:, None] * stride_cos + d_freq[None, :], mask=qmask,
                      other=0.0).to(tl.float32)
        sin = tl.load(Sin + pos[:, None] * stride_sin + d_freq[None, :], mask=qmask,
                      other=0.0).to(tl.float32) * sign[None, :]
        q1 = tl.load(q_ptr + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32)
        q2 = tl.load(q_ptr + d_pair[None, :], mask=qmask, other=0.0).to(tl.float32)
        q = (q1 * cos + q2 * sin).to(Q.dtype.element_ty)
    else:
        q = tl.load(q_ptr + offs_d[None, :], mask=qmask, other=0.0)
    if KV_FP8:  # K/V upcast to q's dtype, their scales taken out of the sums (as stage 1)
        sm_scale = sm_scale * k_scale
    else:
        q = q.to(KBuf.dtype.element_ty)
    acc, m_i, l_i = attend_positions(
        q, ReqToToken + first_row * stride_rt, start, end, KBuf, VBuf, kv_head, stride_kbs,
        stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, sm_scale, softcap, v_scale,
        SOFTCAP, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D)
    lse = split_lse(m_i, l_i)
    # workspace rows ((b * H + head) * (NUM_SPLITS + PREFIX_SPLITS) + NUM_SPLITS + split)
    ws_row = (req * NUM_HEADS + heads) * (NUM_SPLITS + PREFIX_SPLITS) + NUM_SPLITS + split
    tl.store(WorkAcc + ws_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=qmask)
    tl.store(WorkLse + ws_row, lse, mask=takes_part)
