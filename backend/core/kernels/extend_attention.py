"""Causal prefill/extend attention over the paged KV pool (flash-attention style).

Grid: (request, kv head x head block, block of new tokens). A program takes the query
heads that share one KV head (GQA: GROUP of them, HEADS rows a token: the group padded
to a power of two, at most 16, a larger group in several head blocks) for
BLOCK_M // HEADS consecutive new tokens of one request, flattened into BLOCK_M query
rows, and streams the request's K/V in BLOCK_N-slot tiles gathered through
``req_to_token``, keeping a running max ``m``, running denominator ``l`` and an
unnormalised accumulator (online softmax), so nothing of size seq_len is materialised::

    query row r of a program:  new token  mblk * (BLOCK_M // HEADS) + r // HEADS
                               head       kv_head * GROUP + hblk * HEADS + r % HEADS

Each K/V tile is read once for all the heads that share it, and short extends still
fill a tile tall enough for the tensor cores: 32 new tokens of an 8B model (GROUP 4)
are 128 rows, where one head per program would fill a quarter of a 128-row tile and
read every K/V tile four times. GROUP 1 (no GQA) is one head per program.

Invariants the kernel relies on:
  * K/V of the new tokens are already in the pool (``store_kv`` ran first), so prefix
    and new tokens are read the same way: positions ``0 .. seq_len - 1`` of the row.
  * New token ``j`` of request ``b`` is at absolute position ``prefix_b + j`` and sees
    positions ``<= prefix_b + j``; ``seq_len_b == prefix_b + ext_len_b``.
  * Tiles wholly at or before the block's first token are visible to every row: they
    run without the causal mask (most of a long prefix); the rest run masked.
  * The running max starts at a finite floor, so a row with no visible key in a tile
    (a padded row, or a tile older than a sliding window) adds exactly 0 to its sums
    and a fully-masked row yields ``l == 0`` and a 0 output instead of NaN.
  * ``WINDOW`` W > 0 (a sliding-window layer): row ``q_pos`` sees positions
    ``q_pos - W + 1 .. q_pos`` only. Every tile runs masked, and the KV loop starts at
    the first tile holding the oldest position any row of the block sees:

        positions  0 ........ lo ............ first_q .... last_q
                   (skipped)   |<- W - 1 ->|  the block's rows
                               lo = first_q - W + 1, rounded down to a tile

Softmax runs in base 2: logits are pre-multiplied by ``sm_scale * log2(e)``; with
``SOFTCAP`` c > 0 the scaled score s becomes ``c * tanh(s / c)`` first.

An FP8 pool (``KV_FP8``) holds ``K / k_scale`` and ``V / v_scale`` with one scale per
KV head: tiles are upcast to q's dtype as they are loaded, and since a program sees one
KV head, its scales come out of the sums, ``q.(s k) = s (q.k)`` (folded into
``sm_scale``) and ``sum p (s v) = s sum p v`` (applied to the output once).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .scales import check_kv_scales

LOG2E = tl.constexpr(1.4426950408889634)
# finite floor for the running max: exp2(floor - real_logit) underflows to exactly 0
NEG_FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _extend_attn_kernel(
    Q, O, KBuf, VBuf, ReqToToken, ReqPoolIdx, SeqLens, PrefixLens, QoIndptr,
    KScale, VScale, sm_scale, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_rt,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // HEADS  # new tokens per program
    HEAD_BLOCKS: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    hblk = tl.program_id(1) % HEAD_BLOCKS
    mblk = tl.program_id(2)

    q_start = tl.load(QoIndptr + b)
    ext_len = tl.load(QoIndptr + b + 1) - q_start
    # the grid is sized by the longest extend in the batch; shorter requests stop here
    if mblk * TOKENS >= ext_len:
        return
    prefix = tl.load(PrefixLens + b)
    seq_len = tl.load(SeqLens + b)
    slot_row = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_rt

    offs_m = tl.arange(0, BLOCK_M)
    tok = mblk * TOKENS + offs_m // HEADS  # index among this request's new tokens
    g = hblk * HEADS + offs_m % HEADS  # head within the group
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = (tok < ext_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM  # head_dim 80/96 are padded up to 128 and masked
    q_rows = (q_start + tok).to(tl.int64)
    heads = kv_head * GROUP + g
    q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    v_scale = 1.0
    if KV_FP8:  # K/V are upcast to q's dtype; their scales leave the sums
        sm_scale = sm_scale * tl.load(KScale + kv_head)
        v_scale = tl.load(VScale + kv_head)
    else:
        q = q.to(KBuf.dtype.element_ty)  # same rule as the reference: q in the pool's dtype
    q_pos = prefix + tok

    m_i = tl.full([BLOCK_M], NEG_FLOOR, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    first_q = prefix + mblk * TOKENS
    # the block's last row sits at first_q + TOKENS - 1: nothing past it is visible to
    # any row of the block, so the KV loop stops there
    kv_end = tl.minimum(seq_len, first_q + TOKENS)
    kv_start = 0
    full_end = 0  # tiles before this are visible to every row (all at or before first_q)
    if WINDOW > 0:
        kv_start = tl.maximum(first_q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    else:
        full_end = (first_q + 1) // BLOCK_N * BLOCK_N
    for start_n in range(kv_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, slot_row, start_n, kv_end, q_pos, KBuf, VBuf, kv_head,
            stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, sm_scale,
            softcap, False, WINDOW, SOFTCAP, DOT_PRECISION, BLOCK_N)
    for start_n in range(tl.maximum(kv_start, full_end), kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, slot_row, start_n, kv_end, q_pos, KBuf, VBuf, kv_head,
            stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, sm_scale,
            softcap, True, WINDOW, SOFTCAP, DOT_PRECISION, BLOCK_N)

    out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    tl.store(O + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _attend_tile(q, acc, m_i, l_i, slot_row, start_n, kv_end, q_pos, KBuf, VBuf, kv_head,
                 stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, sm_scale,
                 softcap, MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """One online-softmax step over positions ``start_n .. start_n + BLOCK_N - 1``.
    Unmasked (``MASKED`` False) only for a tile every row sees whole: no position past
    ``kv_end``, none after any row's own, none outside a window."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = offs_n < kv_end
        # out-of-range lanes read slot 0 (the dummy slot), then get masked to -inf
        slots = tl.load(slot_row + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        slots = tl.load(slot_row + offs_n).to(tl.int64)
        kv_mask = d_mask[None, :]
    k = tl.load(KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                mask=kv_mask, other=0.0).to(q.dtype)
    qk = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), sm_scale, softcap,
                 SOFTCAP)
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            visible &= offs_n[None, :] > q_pos[:, None] - WINDOW
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _scores(dot, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """Base-2 logits from q.k: scaled, and soft-capped (c * tanh(s / c)) with SOFTCAP."""
    if SOFTCAP:
        s = dot * sm_scale
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both saturations, no inf / inf
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        return s * LOG2E
    return dot * (sm_scale * LOG2E)


class ExtendTiles(NamedTuple):
    """A program's query tile (BLOCK_M rows: BLOCK_M // heads new tokens x ``heads``
    query heads of one KV head, rows of heads past the group masked), its KV tile and
    launch options."""

    block_m: int
    block_n: int
    heads: int
    num_warps: int
    num_stages: int


MAX_HEADS = 16  # query heads one program takes; a larger group runs in several blocks


def extend_tiles(dot_dtype: torch.dtype, head_dim: int, group: int,
                 max_extend_len: int) -> ExtendTiles:
    """The default tiles: 128 query rows over 64-position KV tiles with 8 warps at
    head_dim 128 (64 x 32 for fp32 dots or wide heads, so the Q and accumulator tiles
    stay in registers); as many query heads of the group a program as leave it a KV
    tile's worth of tokens (all 4 of the 8B shape for extends of up to 32 tokens, 2
    past that); fewer rows when the longest extend cannot fill them (decode rows riding
    in a mixed batch)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dot_dtype == torch.float32:
        block_m, block_n, warps = (64, 32, 4) if block_d <= 128 else (32, 32, 4)
    elif block_d <= 64:
        block_m, block_n, warps = 128, 64, 4
    elif block_d <= 128:
        block_m, block_n, warps = 128, 64, 8
    else:
        block_m, block_n, warps = 64, 32, 8
    # At least a KV tile's worth of tokens a program when the extend has them: fewer
    # tokens a block means more blocks, each with its own masked diagonal tile. 2,048-
    # and 256-token prefills ran 4-6% faster at 64 tokens x 2 heads than at 32 x 4 (H100,
    # 8B layer; equal with a 2,048-token prefix), a 32-token question fills 128 rows
    # with all 4 heads.
    tokens = min(triton.next_power_of_2(max(max_extend_len, 1)), block_n)
    # a power of two: rows split by shifts and masks (a group of 7 padded to 8 spills 72
    # bytes a thread at sm_90 where 7 rows of 7 heads spill 440)
    heads = min(triton.next_power_of_2(group), MAX_HEADS, max(1, block_m // tokens))
    rows = heads * max(max_extend_len, 1)
    block_m = min(block_m, max(16, triton.next_power_of_2(rows)))
    return ExtendTiles(block_m, block_n, heads, warps, 2)


def extend_warmup_lens(dot_dtype: torch.dtype, head_dim: int, group: int) -> list[int]:
    """The shortest extend length of each distinct tile ``extend_tiles`` picks: one
    extend of each compiles every variant a model's prefills use (at GROUP 4, lengths
    5-8 take 32-row tiles that no round warm-up length reaches)."""
    final = extend_tiles(dot_dtype, head_dim, group, 1 << 30)
    lens, last, n = [], None, 1
    while last != final:  # tiles grow with the length and stop at ``final``
        tiles = extend_tiles(dot_dtype, head_dim, group, n)
        if tiles != last:
            lens.append(n)
            last = tiles
        n += 1
    return lens


def extend_attention(q: torch.Tensor, o: torch.Tensor, k_buffer: torch.Tensor,
                     v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     extend_prefix_lens: torch.Tensor, qo_indptr: torch.Tensor,
                     max_extend_len: int, sm_scale: float, window: int = 0,
                     softcap: float = 0.0, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None,
                     tiles: ExtendTiles | None = None) -> None:
    """Write into ``o`` [T, H, D] the causal attention of the new tokens ``q`` [T, H, D].

    k_buffer, v_buffer: [num_slots + 1, KVH, D] with H % KVH == 0; req_to_token: int32
    [rows, max_context]; req_pool_indices, seq_lens, extend_prefix_lens: int [B];
    qo_indptr: int [B + 1]; max_extend_len: host int >= every extend length (it only
    sizes the grid, so no device sync is needed). window, softcap: see the module
    docstring (0: off). k_scale, v_scale: float32 [KVH], required for a float8 pool.
    tiles: ``extend_tiles``'s choice unless given (the kernel checks try others).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    batch = req_pool_indices.shape[0]
    assert num_heads % num_kv_heads == 0 and k_buffer.shape[2] == head_dim
    assert o.shape == q.shape and q.stride(-1) == 1 and o.stride(-1) == 1
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1 and req_to_token.stride(1) == 1
    if batch == 0 or num_tokens == 0 or max_extend_len <= 0:
        return
    fp8 = check_kv_scales(k_buffer, k_scale, v_scale)
    compute = q.dtype if fp8 else k_buffer.dtype  # what the dot products run in
    group = num_heads // num_kv_heads
    if tiles is None:
        tiles = extend_tiles(compute, head_dim, group, max_extend_len)
    assert 1 <= tiles.heads <= tiles.block_m, tiles
    head_blocks = triton.cdiv(group, tiles.heads)
    grid = (batch, num_kv_heads * head_blocks,
            triton.cdiv(max_extend_len, tiles.block_m // tiles.heads))
    _extend_attn_kernel[grid](
        q, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
        extend_prefix_lens, qo_indptr,
        k_scale if fp8 else q, v_scale if fp8 else q, sm_scale, softcap,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=group, HEADS=tiles.heads, HEAD_DIM=head_dim,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # fp32 pools keep full-precision products (tf32 would cost ~1e-3 abs error)
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32",
        WINDOW=max(0, int(window)), SOFTCAP=softcap > 0, KV_FP8=fp8,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
