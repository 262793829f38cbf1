"""When the Triton backend cascades a decode batch (reads the rows' shared prefix once),
with how many prefix splits, and how large its one workspace is. No kernel runs here:
``decode_attention`` is replaced by a recorder where a test needs to see the choice."""
from __future__ import annotations

import pytest
import torch

from backend import model_config
from backend.core.forward_batch import ForwardBatch
from backend.core.kernels import decode_workspace_numel
from backend.core.layers import triton_attention
from backend.core.layers.triton_attention import (CASCADE_MIN_BATCH, CASCADE_MIN_PREFIX,
                                                  TritonAttention)
from backend.core.memory_pool import KVPool, ReqToTokenPool

H100_SMS = 132


def _backend(kv_heads=8, head_dim=128, num_sms=0, **options) -> TritonAttention:
    pool = KVPool(64, 1, kv_heads, head_dim, torch.float32, "cpu")
    backend = TritonAttention(pool, ReqToTokenPool(32, 64, "cpu").req_to_token, **options)
    backend.num_sms = num_sms  # the GPU's SM count (0 on CPU)
    return backend


def test_cascade_starts_at_256_shared_positions_and_16_rows():
    assert (CASCADE_MIN_PREFIX, CASCADE_MIN_BATCH) == (256, 16)
    backend = _backend()
    assert ([backend.cascade_min_prefix(b) for b in (1, 4, 15, 16, 64, 512)]
            == [0, 0, 0, 256, 256, 256])


def test_disabled_cascade_never_cascades():
    backend = _backend(cascade=False)
    assert all(backend.cascade_min_prefix(b) == 0 for b in (1, 4, 64, 512))


def test_prefix_splits_fill_about_two_waves_of_the_sms():
    """Prefix programs: (row tiles of 64 query rows) x kv heads x splits ~ 2 x SMs."""
    gpu = _backend(num_sms=H100_SMS)
    # 8B: 32 heads over 8 kv heads, 16 requests a tile
    assert gpu.prefix_splits(64, 32) == 8  # 4 tiles x 8 kv heads = 32 programs a split
    assert gpu.prefix_splits(128, 32) == 4
    assert gpu.prefix_splits(512, 32) == 1  # 256 programs already
    assert gpu.prefix_splits(4, 32) == 16  # one tile: capped at MAX_PREFIX_SPLITS
    # without GQA a tile holds 64 requests of one head each: 1 tile x 32 kv heads
    assert _backend(kv_heads=32, num_sms=H100_SMS).prefix_splits(64, 32) == 8
    assert _backend(kv_heads=32, num_sms=H100_SMS).prefix_splits(256, 32) == 2
    assert _backend().prefix_splits(64, 32) == 4  # CPU: a fixed few, as the kv splits


def test_decode_workspace_numel_holds_the_prefix_splits_after_the_suffix_ones():
    assert decode_workspace_numel(3, 4, 64, 8) == 3 * 4 * 8 * 65  # unchanged without
    assert decode_workspace_numel(3, 4, 64, 1) == 0  # every row one pass
    assert decode_workspace_numel(3, 4, 64, 1, prefix_splits=2) == 3 * 4 * 3 * 65
    assert decode_workspace_numel(3, 4, 64, 8, prefix_splits=4) == 3 * 4 * 12 * 65


def test_the_workspace_bound_is_the_worst_batch_cascaded_or_not():
    gpu = _backend(num_sms=H100_SMS)
    worst = max(decode_workspace_numel(b, 32, 128, gpu.num_kv_splits(b),
                                       gpu.prefix_splits(b, 32) if b >= CASCADE_MIN_BATCH else 0)
                for b in range(1, 65))
    assert gpu.workspace_bound(64, 32) == worst
    assert worst > _backend(num_sms=H100_SMS, cascade=False).workspace_bound(64, 32)


def test_the_workspace_is_allocated_once_and_never_moves(launches):
    """CUDA graphs capture its address: neither prepare() nor a cascaded decode of the
    largest batch may reallocate it, in any order."""
    backend = _backend(kv_heads=2, head_dim=16, num_heads=4, max_batch_size=16)
    assert backend._workspace.numel() == backend.workspace_bound(16, 4)
    address = backend._workspace.data_ptr()
    for rows, shared in ((16, 0), (16, 300), (15, 300), (3, 300)):
        batch = _decode_batch(rows, shared)
        backend.prepare(batch)
        backend._attend(torch.zeros(rows, 4, 16), 0, batch,
                        triton_attention._Scoring(0.25, 0, 0.0))
        assert backend._workspace.data_ptr() == address
    assert [p is not None for p in launches] == [False, True, False, False]


def _decode_batch(rows: int, shared: int) -> ForwardBatch:
    return ForwardBatch.build_decode(input_ids=[1] * rows, req_pool_indices=list(range(rows)),
                                     positions=[300] * rows, out_cache_loc=[5] * rows,
                                     device="cpu", shared_prefix_len=shared)


@pytest.fixture
def launches(monkeypatch):
    """The shared_prefix argument of every decode launch (None: not cascaded)."""
    seen = []

    def record(*args, shared_prefix=None, workspace=None, **kwargs):
        seen.append(shared_prefix)
        need = decode_workspace_numel(args[0].shape[0], args[0].shape[1], args[0].shape[2],
                                      args[8], shared_prefix.num_splits if shared_prefix else 0)
        assert workspace.numel() >= need

    monkeypatch.setattr(triton_attention, "decode_attention", record)
    return seen


@pytest.mark.parametrize("rows, shared, window, cascade, expected", [
    (16, 256, 0, True, True),
    (32, 1000, 0, True, True),
    (15, 1000, 0, True, False),  # too few rows
    (16, 255, 0, True, False),  # too short a prefix
    (16, 1000, 16, True, False),  # a sliding-window layer
    (16, 1000, 0, False, False),  # turned off
])
def test_decode_cascades_when_the_batch_shares_enough(launches, rows, shared, window, cascade,
                                                      expected):
    backend = _backend(kv_heads=2, head_dim=16, cascade=cascade)
    backend._attend(torch.zeros(rows, 4, 16), 0, _decode_batch(rows, shared),
                    triton_attention._Scoring(0.25, window, 0.0))
    (prefix,) = launches
    assert (prefix is not None) == expected
    if expected:  # the device's length (the kernels read it), the policy's splits
        assert prefix.length.tolist() == [shared] and prefix.num_splits == 4


def test_engine_config_turns_cascade_on_by_default_and_off_by_parameter(tmp_path):
    (tmp_path / "m").mkdir()
    base = {"model_path": str(tmp_path / "m")}
    assert model_config.engine_config_from_parameters(base, []).enable_cascade_attention
    off = model_config.engine_config_from_parameters(
        dict(base, enable_cascade_attention="false"), [])
    assert off.enable_cascade_attention is False
