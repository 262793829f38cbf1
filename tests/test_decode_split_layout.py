"""How TritonAttention splits decode rows, as a function of the batch and a bound on its
longest row (the kernel's results do not depend on it: tests/test_triton_kernels.py)."""
from __future__ import annotations

import torch

from backend.core.layers.triton_attention import ONE_PASS_LEN, SplitLayout, TritonAttention
from backend.core.memory_pool import KVPool, ReqToTokenPool


def _backend(num_sms: int, num_kv_heads: int = 8) -> TritonAttention:
    """The backend of the 8B shape (8 KV heads) as on a GPU with ``num_sms`` SMs."""
    pool = KVPool(16, 1, num_kv_heads, 128, torch.bfloat16, "cpu")
    backend = TritonAttention(pool, ReqToTokenPool(2, 64, "cpu").req_to_token, num_heads=32)
    backend.num_sms = num_sms  # what it reads from the device's properties on a GPU
    return backend


def test_large_batch_of_short_rows_is_one_split():
    # 128 x 8 (request, kv head) programs fill 132 SMs: no split, no merge launch
    assert _backend(132).split_layout(128, 250) == SplitLayout(1, 0)
    assert _backend(132).split_layout(128, ONE_PASS_LEN) == SplitLayout(1, 0)


def test_large_batch_with_long_rows_splits_only_past_the_one_pass_length():
    assert _backend(132).split_layout(128, 4096) == SplitLayout(4, ONE_PASS_LEN)
    assert _backend(132).split_layout(33, ONE_PASS_LEN + 1) == SplitLayout(4, ONE_PASS_LEN)


def test_small_batches_split_every_row_for_parallelism():
    # 1 x 8 programs: 32 splits (capped), each as short as one tile
    assert _backend(132).split_layout(1, 4096) == SplitLayout(32, 0)
    assert _backend(132).split_layout(1, 100) == SplitLayout(32, 0)
    # 16 x 8 = 128 programs, under one per SM: 4 splits
    assert _backend(132).split_layout(16, 250) == SplitLayout(4, 0)


def test_one_program_per_sm_is_enough_for_one_pass_rows():
    # 17 x 8 = 136 programs cover 132 SMs
    assert _backend(132).split_layout(17, 250) == SplitLayout(1, 0)
    assert _backend(132).split_layout(32, ONE_PASS_LEN) == SplitLayout(1, 0)
    assert _backend(132).split_layout(32, ONE_PASS_LEN + 1) == SplitLayout(4, ONE_PASS_LEN)


def test_graph_length_classes_only_where_the_layout_changes():
    assert _backend(132).decode_len_classes(128, 8192) == [ONE_PASS_LEN, 8192]
    assert _backend(132).decode_len_classes(128, 300) == [300]
    assert _backend(132).decode_len_classes(1, 8192) == [8192]
    assert _backend(0).decode_len_classes(128, 8192) == [8192]  # CPU: 8 splits always


def test_fixed_choices_override_the_policy():
    pool = KVPool(16, 1, 8, 128, torch.bfloat16, "cpu")
    r2t = ReqToTokenPool(2, 64, "cpu").req_to_token
    assert TritonAttention(pool, r2t, num_kv_splits=3).split_layout(128, 100) == SplitLayout(3, 0)
    fixed = TritonAttention(pool, r2t, min_split_len=64)
    assert fixed.split_layout(128, 100) == SplitLayout(8, 64)
