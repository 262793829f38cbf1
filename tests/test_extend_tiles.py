"""The extend kernel's tiles: which ``extend_tiles`` picks, which lengths warm-up runs to
compile them all, and the kernel's output under tiles other than the default (several
head blocks for one KV head, padded heads, one head a program, full tiles before the
causal edge) against TorchAttention, on CPU under the Triton interpreter (a worker
subprocess, as in test_triton_kernels.py).
"""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases
from kv_batches import shuffled_kv_batch


# ---------------------------------------------------------------- the tile choice
def test_the_8b_shape_packs_a_question_as_32_tokens_x_4_heads_and_a_prefill_as_64_x_2():
    from backend.core.kernels import ExtendTiles, extend_tiles
    # 32 query heads over 8 KV heads: a 32-token question fills 128 rows with all 4 heads
    assert extend_tiles(torch.bfloat16, 128, 4, 32) == ExtendTiles(128, 64, 4, 8, 2)
    # longer extends keep a 64-position KV tile's worth of tokens a program
    assert extend_tiles(torch.bfloat16, 128, 4, 33) == ExtendTiles(128, 64, 2, 8, 2)
    assert extend_tiles(torch.bfloat16, 128, 4, 4096) == ExtendTiles(128, 64, 2, 8, 2)


@pytest.mark.parametrize("length, rows", [(1, 16), (4, 16), (5, 32), (8, 32), (9, 64),
                                          (16, 64), (17, 128)])
def test_short_extends_take_the_fewest_rows_that_hold_them(length, rows):
    """A decode row in a mixed batch is 4 rows of a 16-row tile, not of a 128-row one."""
    from backend.core.kernels import extend_tiles
    tiles = extend_tiles(torch.bfloat16, 128, 4, length)
    assert (tiles.block_m, tiles.heads) == (rows, 4)


@pytest.mark.parametrize("group, heads", [(1, 1), (2, 2), (7, 8), (12, 16), (16, 16), (32, 16)])
def test_a_group_is_padded_to_a_power_of_two_and_split_past_sixteen_heads(group, heads):
    from backend.core.kernels import extend_tiles
    assert extend_tiles(torch.float16, 128, group, 1).heads == heads


def test_fp32_dots_and_wide_heads_keep_smaller_tiles():
    from backend.core.kernels import ExtendTiles, extend_tiles
    assert extend_tiles(torch.float32, 64, 2, 300) == ExtendTiles(64, 32, 2, 4, 2)
    assert extend_tiles(torch.float32, 256, 2, 300) == ExtendTiles(32, 32, 1, 4, 2)
    assert extend_tiles(torch.bfloat16, 256, 8, 300) == ExtendTiles(64, 32, 2, 8, 2)
    assert extend_tiles(torch.bfloat16, 64, 4, 300) == ExtendTiles(128, 64, 2, 4, 2)


@pytest.mark.parametrize("dtype, head_dim, group", [(torch.bfloat16, 128, 4),
                                                    (torch.bfloat16, 128, 1),
                                                    (torch.float16, 64, 7),
                                                    (torch.float32, 64, 2),
                                                    (torch.bfloat16, 256, 16)])
def test_warm_up_lengths_reach_every_tile_a_prefill_can_take(dtype, head_dim, group):
    from backend.core.kernels import extend_tiles, extend_warmup_lens
    lens = extend_warmup_lens(dtype, head_dim, group)
    assert lens == sorted(set(lens)) and lens[0] == 1
    warmed = {extend_tiles(dtype, head_dim, group, n) for n in lens}
    assert len(warmed) == len(lens)  # one length per tile, no repeats
    taken = {extend_tiles(dtype, head_dim, group, n) for n in range(1, 5000)}
    assert taken == warmed


def test_the_8b_warm_up_covers_extends_of_5_to_8_and_of_33_tokens():
    """Round warm-up lengths (1, 16, 32, ...) never build the 32-row tile that 5-8 new
    tokens take at GROUP 4, nor the two-head tile from 33 on; without them the first such
    request compiles mid-serving."""
    from backend.core.kernels import extend_warmup_lens
    assert extend_warmup_lens(torch.bfloat16, 128, 4) == [1, 5, 9, 17, 33]


def test_the_triton_backend_warms_up_the_tiles_of_its_pool():
    from backend.core.layers.attention import TorchAttention
    from backend.core.layers.triton_attention import TritonAttention
    from backend.core.memory_pool import KVPool, ReqToTokenPool
    table = ReqToTokenPool(2, 64, "cpu").req_to_token
    bf16 = KVPool(8, 1, 8, 128, torch.bfloat16, "cpu")
    assert TritonAttention(bf16, table).extend_warmup_lens(32, torch.bfloat16) == [1, 5, 9, 17, 33]
    # a float8 pool's dots run in the model's dtype: fp32 models keep fp32's tiles
    fp8 = KVPool(8, 1, 2, 64, torch.float8_e4m3fn, "cpu")
    assert (TritonAttention(fp8, table).extend_warmup_lens(4, torch.float32)
            == [1, 9, 17])
    assert TorchAttention(bf16, table).extend_warmup_lens(32, torch.bfloat16) == []


# ---------------------------------------------------------------- the kernel, interpreted
def _case_tiles(prefix_lens, ext_lens, h, kvh, d, tiles=None, seed=0, window=0):
    """extend_attention with the given tiles == TorchAttention on a pool of shuffled slots."""
    from backend.core.kernels import ExtendTiles, extend_attention, store_kv
    from backend.core.layers.attention import TorchAttention
    kv = shuffled_kv_batch(prefix_lens, ext_lens, h, kvh, d, seed,
                           pool_size=sum(prefix_lens) + sum(ext_lens) + 8,
                           rows=len(ext_lens) + 1,
                           max_ctx=max(p + n for p, n in zip(prefix_lens, ext_lens)))
    (ref_pool, pool), table, batch = kv.pools, kv.req_to_token, kv.batch
    scale = 0.6 / d ** 0.5
    want = TorchAttention(ref_pool, table).forward(kv.q, kv.k, kv.v, 0, batch, scale,
                                                   window=window)
    store_kv(pool.k_buffer[0], pool.v_buffer[0], batch.out_cache_loc, kv.k, kv.v)
    got = torch.full_like(kv.q, float("nan"))
    extend_attention(kv.q, got, pool.k_buffer[0], pool.v_buffer[0], table,
                     batch.req_pool_indices, batch.seq_lens, batch.extend_prefix_lens,
                     batch.qo_indptr, batch.max_extend_len, scale, window=window,
                     tiles=ExtendTiles(*tiles) if tiles else None)
    err = (got - want).abs().max().item()  # NaN (a row never written) fails too
    assert err < 1e-4, f"max abs error {err}"


# a cached prefix of several 32-slot tiles (the unmasked loop) before a short question,
# beside a prefill from 0 and a decode row; fp32 tiles are 64 x 32 unless given
FEW_SHOT = dict(prefix_lens=[150, 0, 96], ext_lens=[11, 40, 1], d=32)
CASES = {
    "default-group4": (_case_tiles, dict(FEW_SHOT, h=8, kvh=2)),
    # two head blocks of 2 heads for each KV head; several token blocks per request
    "two-head-blocks": (_case_tiles, dict(FEW_SHOT, h=8, kvh=2, tiles=(16, 32, 2, 4, 2))),
    "one-head-a-program": (_case_tiles, dict(FEW_SHOT, h=8, kvh=2, tiles=(16, 32, 1, 4, 2))),
    # GROUP 3 in 4 rows a token: the padded head rows are read as 0 and never written
    "padded-group3": (_case_tiles, dict(FEW_SHOT, h=6, kvh=2)),
    # GROUP 32: two blocks of 16 heads, one token a 16-row tile
    "group32": (_case_tiles, dict(prefix_lens=[70, 0], ext_lens=[3, 5], h=32, kvh=1, d=16,
                                  tiles=(16, 32, 16, 4, 2))),
    "no-gqa": (_case_tiles, dict(FEW_SHOT, h=2, kvh=2)),
    # a tile edge exactly at the first question token (prefix 64 = two full tiles)
    "prefix-on-a-tile-edge": (_case_tiles, dict(prefix_lens=[64, 63], ext_lens=[9, 2], h=4,
                                                kvh=1, d=32, seed=3)),
    "window-few-shot": (_case_tiles, dict(FEW_SHOT, h=8, kvh=2, window=45, seed=4)),
}


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels.extend_attention import _extend_attn_kernel
    assert isinstance(_extend_attn_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_extend_tiles_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
