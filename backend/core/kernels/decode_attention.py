"""Split-KV ("flash-decoding") attention for one new query token per request: the launch.

``decode_attention`` checks its arguments, carves the workspace and launches the two
kernels of ``decode_stages.py``, whose docstring gives the algorithm and the split
layout: stage 1 computes each (request, kv head, split)'s partial output over a chunk
of the row's KV, stage 2 merges a row's splits.

Splitting buys parallelism at small batch and long rows, and costs a workspace round
trip and a second launch. ``min_split_len`` (0: one tile) is how short a chunk may get:
a caller whose batch already fills the GPU sets it high, so short rows run in one pass
and only long rows split (for balance). With ``num_kv_splits == 1`` every row is one
pass: stage 2 is not launched and no workspace is needed.

CUDA-graph invariants: grid and workspace shapes depend only on (batch, heads, splits),
never on seq_lens values; the kernels read seq_lens on the device; with a caller-owned
workspace nothing is allocated and nothing syncs. A request with seq_len 0 (graph
padding) is a one-pass row with no key: its output is 0, not NaN.

Optionally (``rope``) stage 1 also applies the rotary embedding to q and writes the new
token's rotated K and its V to the pool, which saves the model a launch per layer.

A sliding-window layer (``window`` W > 0) attends to the last W positions only: the
splits then divide ``max(0, seq_len - W) .. seq_len - 1`` instead of the whole row, so
its cost stops growing with the context. ``softcap`` as in the extend kernel, and so is
an FP8 pool (``k_scale``, ``v_scale``).

Cascade (``shared_prefix``): where the rows share the pool slots of a long prefix (a
few-shot prompt cached once), a third kernel (``decode_prefix.py``) reads that prefix
once per tile of 64 query rows instead of once per row, and the two stages cover and
merge the rest. Launch order: prefix kernel, stage 1, stage 2. The first two are
independent (each rotates q itself; stage 1 stores the new K/V past the prefix), so the
order only has to put both before stage 2; with dependent launch each waits for the
kernel before it, which chains stage 2 after both.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from . import pdl
from .decode_prefix import _decode_prefix
from .decode_stages import _decode_stage1, _decode_stage2
from .fused import check_rotary
from .scales import check_kv_scales

class DecodeTiles(NamedTuple):
    """Stage 1's KV tile (positions per loop step) and its launch options."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_tiles(dot_dtype: torch.dtype, head_dim: int) -> DecodeTiles:
    """The default stage-1 tiles: 64 positions (32 for fp32 dots or wide heads, so the
    K/V tiles and their pipeline copies stay within shared memory)."""
    wide = max(16, triton.next_power_of_2(head_dim)) > 128
    return DecodeTiles(32 if (dot_dtype == torch.float32 or wide) else 64, 4, 2)


class PrefixTiles(NamedTuple):
    """The prefix kernel's query tile (query rows: requests x GROUP heads), KV tile and
    launch options."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


PREFIX_ROWS = 64  # query rows a prefix program takes: the prefix read once per 64 rows


def prefix_rows(group: int) -> int:
    """Query rows of a prefix tile: PREFIX_ROWS, or one request's GROUP heads if more."""
    return max(PREFIX_ROWS, triton.next_power_of_2(group))


def prefix_tiles(dot_dtype: torch.dtype, head_dim: int, group: int) -> PrefixTiles:
    """64 query rows over KV tiles of 64 positions (32 for fp32 dots or wide heads, as
    stage 1), 8 warps for a [64, 128] accumulator."""
    block_m = prefix_rows(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if (dot_dtype == torch.float32 or block_d > 128) else 64
    return PrefixTiles(block_m, block_n, 8 if block_m * block_d >= 64 * 128 else 4, 2)


def decode_workspace_numel(batch_size: int, num_heads: int, head_dim: int,
                           num_kv_splits: int, prefix_splits: int = 0) -> int:
    """float32 elements ``decode_attention`` needs: partial outputs then their lse, for
    every row's splits and (cascade) prefix splits; none for a single split without a
    prefix (every row is one pass)."""
    if num_kv_splits <= 1 and prefix_splits == 0:
        return 0
    return batch_size * num_heads * (num_kv_splits + prefix_splits) * (head_dim + 1)


class DecodeRope(NamedTuple):
    """The new tokens' rotary embedding and K/V store, folded into ``decode_attention``.

    k, v: [B, KVH, D], k not yet rotated (views of a fused QKV output are fine: unit
    stride on D); positions: int64 [B]; cos, sin: [max_pos, D/2] (``RotaryEmbedding``'s
    tables); loc: int64 [B], each token's pool slot, which ``req_to_token`` must already
    list at position ``seq_lens[b] - 1``.
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    loc: torch.Tensor


class SharedPrefix(NamedTuple):
    """Cascade attention's shared prefix: positions 0 .. L-1 hold the same pool slots in
    every row longer than L (rows no longer than L, CUDA-graph padding, attend alone).

    length: int64 [1] on the device, L (a CUDA graph replays with it rewritten: the grid
    never depends on it); num_splits: prefix splits, the prefix kernel's grid's last
    dimension (``decode_prefix.py``).
    """

    length: torch.Tensor
    num_splits: int


def decode_attention(q: torch.Tensor, o: torch.Tensor, k_buffer: torch.Tensor,
                     v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, num_kv_splits: int,
                     workspace: torch.Tensor | None = None,
                     rope: DecodeRope | None = None, window: int = 0,
                     softcap: float = 0.0, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, min_split_len: int = 0,
                     tiles: DecodeTiles | None = None,
                     shared_prefix: SharedPrefix | None = None) -> None:
    """Write into ``o`` [B, H, D] the attention of ``q`` [B, H, D] (one token per request)
    over positions ``0 .. seq_lens[b] - 1`` of row ``req_pool_indices[b]``.

    num_kv_splits, min_split_len: the split layout (decode_stages.py); the grid is
    (B, KVH, num_kv_splits) whatever the lengths. workspace: optional contiguous float32
    tensor with at least ``decode_workspace_numel(B, H, D, num_kv_splits)`` elements;
    pass one (and fixed splits) when capturing CUDA graphs so the call allocates nothing.

    rope: with it, ``q`` is taken before its rotary embedding (and left as it is), and
    the new tokens' K/V (``rope.k`` rotated) are written to their pool slots by the
    same launch: ``fused.rotary_store_kv`` followed by this call, without the launch
    in between (a batch-1 step of a small model is mostly launch latency).

    window, softcap: see the module docstring (0: off). k_scale, v_scale: float32 [KVH],
    required for a float8 pool. tiles: stage 1's tile and launch options
    (``decode_tiles`` when None).

    shared_prefix: cascade (module docstring); the workspace then needs
    ``decode_workspace_numel(B, H, D, num_kv_splits, shared_prefix.num_splits)``.
    Not with a window.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0 and k_buffer.shape[2] == head_dim
    assert o.shape == q.shape and q.stride(-1) == 1 and o.stride(-1) == 1
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1 and req_to_token.stride(1) == 1
    assert num_kv_splits >= 1 and min_split_len >= 0
    prefix_splits = shared_prefix.num_splits if shared_prefix is not None else 0
    if shared_prefix is not None:
        assert prefix_splits >= 1 and window <= 0, "cascade: prefix splits, no window"
        assert shared_prefix.length.shape == (1,) and shared_prefix.length.dtype == torch.int64
    if batch == 0:
        return
    numel = decode_workspace_numel(batch, num_heads, head_dim, num_kv_splits, prefix_splits)
    if numel == 0:  # one pass for every row: placeholders for the unused pointers
        work_acc = work_lse = o
    else:
        if workspace is None:
            workspace = torch.empty(numel, dtype=torch.float32, device=q.device)
        assert (workspace.dtype == torch.float32 and workspace.is_contiguous()
                and workspace.numel() >= numel)
        n_acc = batch * num_heads * (num_kv_splits + prefix_splits) * head_dim
        work_acc = workspace[:n_acc]
        work_lse = workspace[n_acc:numel]

    if rope is not None:
        check_rotary(q, rope.k, rope.positions, rope.cos, rope.sin)
        assert rope.v.shape == rope.k.shape == (batch, num_kv_heads, head_dim)
        assert rope.v.stride(-1) == 1 and rope.loc.shape == (batch,)
        assert rope.loc.dtype == torch.int64
        r = rope
    else:  # placeholders for the unused pointers (ROPE=False compiles them out)
        r = DecodeRope(q, q, seq_lens, q, q, seq_lens)
    fp8 = check_kv_scales(k_buffer, k_scale, v_scale)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_dtype = q.dtype if fp8 else k_buffer.dtype
    fp32 = dot_dtype == torch.float32
    tiles = tiles or decode_tiles(dot_dtype, head_dim)
    window = max(0, int(window))
    # programmatic dependent launch (pdl.py): each stage starts while the kernel before
    # it ends and waits for it before reading anything
    early = pdl.dependent_launch(q.device, pdl.DECODE_ATTENTION)
    # the shared prefix's length (placeholder without one: PREFIX_SPLITS=0 never reads it)
    shared = shared_prefix.length if shared_prefix is not None else seq_lens
    if shared_prefix is not None:
        pt = prefix_tiles(dot_dtype, head_dim, group)
        row_tiles = triton.cdiv(batch, pt.block_m // group)
        _decode_prefix[(row_tiles, num_kv_heads, prefix_splits)](
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, shared,
            work_acc, work_lse, r.positions, r.cos, r.sin,
            k_scale if fp8 else q, v_scale if fp8 else q, sm_scale, softcap, batch,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
            r.cos.stride(0), r.sin.stride(0),
            GROUP=group, NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_kv_splits,
            PREFIX_SPLITS=prefix_splits, BLOCK_M=pt.block_m, BLOCK_N=pt.block_n,
            BLOCK_D=block_d, DOT_PRECISION="ieee" if fp32 else "tf32",
            ROPE=rope is not None, SOFTCAP=softcap > 0, KV_FP8=fp8, PDL=early,
            num_warps=pt.num_warps, num_stages=pt.num_stages, launch_pdl=early,
        )
    _decode_stage1[(batch, num_kv_heads, num_kv_splits)](
        q, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, shared,
        work_acc, work_lse,
        r.positions, r.cos, r.sin, r.k, r.v, r.loc,
        k_scale if fp8 else q, v_scale if fp8 else q, sm_scale, softcap, min_split_len,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_buffer.stride(0),
        k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        r.cos.stride(0), r.sin.stride(0), r.k.stride(0), r.k.stride(1),
        r.v.stride(0), r.v.stride(1),
        GROUP=group, NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_kv_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if fp32 else "tf32", ROPE=rope is not None,
        WINDOW=window, SOFTCAP=softcap > 0, KV_FP8=fp8,
        PDL=early, PREFIX_SPLITS=prefix_splits, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, launch_pdl=early,
    )
    if num_kv_splits + prefix_splits > 1:
        _decode_stage2[(batch, num_heads)](
            work_acc, work_lse, o, seq_lens, shared, min_split_len, o.stride(0), o.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_kv_splits,
            BLOCK_S=triton.next_power_of_2(num_kv_splits + prefix_splits),
            BLOCK_N=tiles.block_n, BLOCK_D=block_d, WINDOW=window, PDL=early,
            PREFIX_SPLITS=prefix_splits, num_warps=4, launch_pdl=early,
        )
