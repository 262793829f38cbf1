"""The two Triton kernels of split-KV ("flash-decoding") decode attention.

Decode has one query row per head, so a grid of (request, head) alone leaves most SMs
idle on long contexts at small batch. Stage 1 therefore also splits each request's KV
into ``num_kv_splits`` chunks; every (request, kv head, split) program computes, for all
``GROUP = H / KVH`` query heads sharing that kv head, a normalised partial output and
its log-sum-exp. Loading a K/V tile once per group (not once per query head) is what
makes GQA cheap: decode is bound by KV bytes read. Stage 2 merges the splits:

    out = sum_s 2^(lse_s - M) * acc_s / sum_s 2^(lse_s - M),   M = max_s lse_s

Each row picks its own chunk, in the kernel, from its length n (the positions it sees)::

    chunk = max(n / num_kv_splits, min_split_len), rounded up to whole BLOCK_N tiles
    split s covers positions s * chunk .. (s + 1) * chunk - 1; used = ceil(n / chunk)

    n <= chunk (used <= 1): "one pass": split 0 normalises and writes o itself, the
                            other splits return at once, stage 2 skips the row
    n >  chunk:             every used split writes (acc_s, lse_s) to the workspace,
                            stage 2 merges exactly the used ones

Both stages read seq_lens on the device (never the host): the grid depends only on
(batch, heads, splits), as CUDA graphs need. A request with seq_len 0 (graph padding) is
a one-pass row with no key: its output is 0, not NaN.

Cascade (``PREFIX_SPLITS`` > 0; 0 compiles all of it out): where every row shares the
pool slots of positions 0 .. L-1 (L read on the device), the prefix kernel
(``decode_prefix.py``) reads them once for many rows and writes its partials into lanes
NUM_SPLITS .. NUM_SPLITS + PREFIX_SPLITS - 1 of each row's workspace. Stage 1 then splits
only ``L .. seq_len - 1`` of a row past L (its whole row otherwise: padding), and never
writes o: every used split goes to the workspace, and stage 2 merges a row's suffix
splits with its prefix partials and writes every row::

    workspace row of (b, head):  | suffix splits 0 .. NUM_SPLITS-1 | prefix 0 .. P-1 |

With ``ROPE`` stage 1 also applies the rotary embedding to q and writes the new token's
rotated K and its V to the pool. With ``WINDOW`` W > 0 (a sliding-window layer) the
splits divide ``max(0, seq_len - W) .. seq_len - 1`` instead of the whole row. ``SOFTCAP``
as in the extend kernel, and so is an FP8 pool (``KV_FP8``): tiles upcast to q's dtype,
the KV head's scales taken out of the sums; the new token's K/V are divided by them
before they are stored.

Kept apart from the launch (``decode_attention.py``: argument checks, workspace, tiles):
this is the file to read for the algorithm and its index arithmetic, and the kernels'
names are the ones profiles show (``_decode_stage1``, ``_decode_stage2``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .extend_attention import _scores
from .pdl import await_previous_kernel
from .scales import saturate

NEG_FLOOR = tl.constexpr(-1.0e30)  # finite "minus infinity": never yields inf - inf


@triton.jit
def _row_chunk(SeqLens, PrefixLen, b, min_split_len, WINDOW: tl.constexpr,
               NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(seq_len, first position covered, positions covered, chunk): both stages derive
    the split layout of row b from this one place, so they always agree on it."""
    seq_len = tl.load(SeqLens + b)
    first = 0  # the oldest position the new token sees
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    if PREFIX_SPLITS > 0:  # the shared prefix is the prefix kernel's, for rows past it
        shared = tl.load(PrefixLen)
        first = tl.where(seq_len > shared, shared, 0)
    n_kv = seq_len - first
    # whole tiles: only the last used split has a partial tile
    chunk = tl.cdiv(tl.maximum(tl.cdiv(n_kv, NUM_SPLITS), min_split_len), BLOCK_N) * BLOCK_N
    return seq_len, first, n_kv, chunk


@triton.jit
def attend_positions(q, slot_row, start, end, KBuf, VBuf, kv_head, stride_kbs, stride_kbh,
                     stride_vbs, stride_vbh, offs_d, d_mask, sm_scale, softcap, v_scale,
                     SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Attention of ``ROWS`` query rows ``q`` (in the pool's dtype; a float8 pool's K
    scale already in ``sm_scale``, its V scale is ``v_scale``) over the positions ``start .. end - 1`` of
    one request's row of pool slots (``slot_row``: its row of ReqToToken), by online
    softmax, BLOCK_N positions a step: the split's normalised output ``acc``, its running
    max ``m_i`` (log2 units) and sum of weights ``l_i`` (``split_lse`` makes them stage 2's
    weight). An empty split (l == 0) gives acc 0 and lse NEG_FLOOR, which stage 2 weighs
    0; a non-empty one has l >= 1 (its max key scores exp2(0)). Stage 1
    and the cascade prefix kernel (decode_prefix.py) share it; it is inlined, so each
    compiles as it did with the loop written out."""
    m_i = tl.full([ROWS], NEG_FLOOR, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(slot_row + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        qk = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), sm_scale, softcap,
                     SOFTCAP)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    return acc, m_i, l_i


@triton.jit
def split_lse(m_i, l_i):
    """A split's log2-sum-exp from ``attend_positions``'s ``m_i`` and ``l_i``."""
    return m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))


@triton.jit
def _decode_stage1(
    Q, O, KBuf, VBuf, ReqToToken, ReqPoolIdx, SeqLens, PrefixLen, WorkAcc, WorkLse,
    Pos, Cos, Sin, KNew, VNew, Loc, KScale, VScale,
    sm_scale, softcap, min_split_len,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_rt, stride_cos, stride_sin, stride_knb, stride_knh, stride_vnb, stride_vnh,
    GROUP: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
    PDL: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
):
    if PDL:  # launched early (pdl.py): q and the new K/V are the previous kernel's
        await_previous_kernel()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(KScale + kv_head)
        v_scale = tl.load(VScale + kv_head)
    split = tl.program_id(2)

    seq_len, first, n_kv, chunk = _row_chunk(SeqLens, PrefixLen, b, min_split_len, WINDOW,
                                             NUM_SPLITS, PREFIX_SPLITS, BLOCK_N)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    start = first + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    one_pass = n_kv <= chunk  # split 0 holds the whole row and writes o itself

    offs_g = tl.arange(0, BLOCK_G)  # BLOCK_G >= 16 (tl.dot minimum); rows >= GROUP are padding
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_ptr = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    # a scalar condition enters a mask as a row limit (GROUP or 0): the interpreter
    # rejects a scalar bool broadcast into a tensor mask
    q_rows = tl.where(start < end, GROUP, 0)  # an empty split reads nothing
    qmask = (offs_g < q_rows)[:, None] & d_mask[None, :]
    if ROPE:
        # rotate-half rotary at this token's position, as kernels/fused.py's rotary does
        # (float32 math, rounded to q's dtype): lane d pairs with lane d +- HEAD_DIM / 2
        half: tl.constexpr = HEAD_DIM // 2
        lo = offs_d < half
        d_pair = tl.where(lo, offs_d + half, offs_d - half)
        d_freq = tl.where(lo, offs_d, offs_d - half)
        sign = tl.where(lo, -1.0, 1.0)
        pos = tl.load(Pos + b).to(tl.int64)
        cos = tl.load(Cos + pos * stride_cos + d_freq, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(Sin + pos * stride_sin + d_freq, mask=d_mask, other=0.0).to(tl.float32) * sign
        q1 = tl.load(q_ptr + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32)
        q2 = tl.load(q_ptr + d_pair[None, :], mask=qmask, other=0.0).to(tl.float32)
        q = (q1 * cos[None, :] + q2 * sin[None, :]).to(Q.dtype.element_ty)
        # the new token's K/V go to their pool slot. Only the split holding the last
        # position reads that slot, so that program writes it, before its own reads
        # (the barrier makes the writes visible to all of its threads)
        if (seq_len > 0) & (split == (seq_len - 1 - first) // tl.maximum(chunk, 1)):
            slot = tl.load(Loc + b).to(tl.int64)
            kn_ptr = KNew + b.to(tl.int64) * stride_knb + kv_head * stride_knh
            k1 = tl.load(kn_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            k2 = tl.load(kn_ptr + d_pair, mask=d_mask, other=0.0).to(tl.float32)
            k_rot = (k1 * cos + k2 * sin).to(KNew.dtype.element_ty)
            v_new = tl.load(VNew + b.to(tl.int64) * stride_vnb + kv_head * stride_vnh + offs_d,
                            mask=d_mask, other=0.0)
            if KV_FP8:
                k_rot = saturate(tl.math.div_rn(k_rot.to(tl.float32), k_scale))
                v_new = saturate(tl.math.div_rn(v_new.to(tl.float32), v_scale))
            tl.store(KBuf + slot * stride_kbs + kv_head * stride_kbh + offs_d,
                     k_rot.to(KBuf.dtype.element_ty), mask=d_mask)
            tl.store(VBuf + slot * stride_vbs + kv_head * stride_vbh + offs_d,
                     v_new.to(VBuf.dtype.element_ty), mask=d_mask)
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + offs_d[None, :], mask=qmask, other=0.0)
    if KV_FP8:  # K/V are upcast to q's dtype instead, their scales taken out of the sums
        sm_scale = sm_scale * k_scale
    else:
        q = q.to(KBuf.dtype.element_ty)
    # a row with no key gets a 0 output
    acc, m_i, l_i = attend_positions(
        q, ReqToToken + row * stride_rt, start, end, KBuf, VBuf, kv_head, stride_kbs,
        stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, sm_scale, softcap, v_scale,
        SOFTCAP, DOT_PRECISION, BLOCK_G, BLOCK_N, BLOCK_D)
    if PREFIX_SPLITS == 0:  # with a prefix, stage 2 merges it into every row: no one pass
        o_ptr = O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        o_rows = tl.where(one_pass & (split == 0), GROUP, 0)
        tl.store(o_ptr, acc.to(O.dtype.element_ty),
                 mask=(offs_g < o_rows)[:, None] & d_mask[None, :])
    if NUM_SPLITS + PREFIX_SPLITS > 1:
        lse = split_lse(m_i, l_i)
        # workspace rows: ((b * H + head) * (NUM_SPLITS + PREFIX_SPLITS) + split), used
        # splits only; the prefix kernel's come after a row's NUM_SPLITS
        ws_row = (b.to(tl.int64) * NUM_HEADS + heads) * (NUM_SPLITS + PREFIX_SPLITS) + split
        written = start < end
        if PREFIX_SPLITS == 0:
            written = (n_kv > chunk) & written
        ws_mask = offs_g < tl.where(written, GROUP, 0)
        tl.store(WorkAcc + ws_row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=ws_mask[:, None] & d_mask[None, :])
        tl.store(WorkLse + ws_row, lse, mask=ws_mask)


@triton.jit
def _decode_stage2(
    WorkAcc, WorkLse, O, SeqLens, PrefixLen, min_split_len, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
    PDL: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
):
    """One program per (request, head), for latency at small batch: merges the row's
    used splits; a one-pass row (stage 1 wrote it) costs it one load of seq_len. With
    PREFIX_SPLITS, also the prefix kernel's partials of a row past the shared prefix,
    and it writes every row (a padding row: 0, all its lanes unused)."""
    if PDL:  # launched early (pdl.py): the splits are stage 1's
        await_previous_kernel()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len, _, n_kv, chunk = _row_chunk(SeqLens, PrefixLen, b, min_split_len, WINDOW,
                                         NUM_SPLITS, PREFIX_SPLITS, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    if PREFIX_SPLITS == 0:
        # used splits (each with l >= 1, a finite lse); none for a one-pass row
        used = tl.where(n_kv > chunk, tl.cdiv(n_kv, tl.maximum(chunk, 1)), 0)
        s_mask = offs_s < used
        d_mask = offs_d < tl.where(used > 0, HEAD_DIM, 0)
    else:
        # every used suffix split (the new token's among them: a finite max), then the
        # prefix's lanes where the row took part (an empty prefix split weighs 0)
        used = tl.cdiv(n_kv, tl.maximum(chunk, 1))
        prefix_lanes = tl.where(seq_len > tl.load(PrefixLen), PREFIX_SPLITS, 0)
        s_mask = (offs_s < used) | ((offs_s >= NUM_SPLITS)
                                    & (offs_s < NUM_SPLITS + prefix_lanes))
        d_mask = offs_d < HEAD_DIM
    ws_row = (b * NUM_HEADS + h) * (NUM_SPLITS + PREFIX_SPLITS) + offs_s
    # unused lanes read NEG_FLOOR: weight exactly 0 next to the used splits' max
    # (weight 1); a one-pass row (no lane used) computes a 0 it does not store
    lse = tl.load(WorkLse + ws_row, mask=s_mask, other=NEG_FLOOR)
    w = tl.exp2(lse - tl.max(lse, 0))
    acc = tl.load(WorkAcc + ws_row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_mask)
