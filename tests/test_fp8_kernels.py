"""FP8 in the Triton kernels, on CPU via the Triton interpreter (as test_triton_kernels.py).

A float8 KV pool: the kernels' stores give the same bytes as the torch backend's
``KVPool.store`` (except where the interpreter's own float8 cast flushes subnormals to
zero: there within one subnormal step), and attention over it matches the torch
backend reading the same pool. The per-token activation quantizer matches its torch
reference.
"""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases
from kv_batches import shuffled_kv_batch

FP8 = torch.float8_e4m3fn
SCALES_K = [0.004, 0.02]  # per KV head: values reach about 4 / scale, well past 448 for none
SCALES_V = [0.01, 0.003]


def _pools(prefix_lens, ext_lens, h, d, seed, outlier=False):
    """Two float8 pools with the same scales and the same stored prefixes, a request
    table and a batch of new tokens (kv_batches.shuffled_kv_batch, float8 pools)."""
    kv = shuffled_kv_batch(prefix_lens, ext_lens, h, 2, d, seed)
    (ref, tri), r2t, batch, q, k, v = kv.pools, kv.req_to_token, kv.batch, kv.q, kv.k, kv.v
    from backend.core.memory_pool import KVPool
    pools = [KVPool(ref.size, 1, 2, d, FP8, "cpu") for _ in range(2)]
    for pool, src in zip(pools, (ref, tri)):
        pool.set_scales(torch.tensor([SCALES_K]), torch.tensor([SCALES_V]))
        used = src.k_buffer[0].abs().sum((1, 2)) > 0  # the prefix slots it filled
        pool.store(0, used.nonzero().view(-1), src.k_buffer[0][used] * 0.1,
                   src.v_buffer[0][used] * 0.05)
    if outlier:
        k[0, 0, 0] = 1e4  # past 448 * scale: stored as +448 * scale, never NaN
    return pools, r2t, batch, q, k * 0.1, v * 0.05


def _same_store(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel stored what ``KVPool.store`` stores, as far as the interpreter can
    tell: ``_cast_matches`` everywhere (the GPU check compares the bytes exactly)."""
    assert torch.isfinite(got.float()).all()
    ok = _cast_matches(got.float(), want.float())
    assert ok.all(), (got.float()[~ok][:5], want.float()[~ok][:5])


def _cast_matches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where the interpreter's float32 -> float8 cast agrees with torch's. It has two
    known faults: a value that rounds up into the next power of two comes out at half
    of it (the carry out of the mantissa is lost), and it flushes subnormals (below
    2^-6, and the values that round up to 2^-6) to zero. Everything else must be equal."""
    carry = (got * 2 == want) & (torch.frexp(want)[0].abs() == 0.5)
    subnormal = (want.abs() <= 2.0 ** -6) & ((got - want).abs() <= 2.0 ** -6)
    return (got == want) | carry | subnormal


def _case_attention(prefix_lens, ext_lens, h, d, seed, outlier=False, tol=1e-4,
                    min_split_len=None):
    from backend.core.layers.attention import TorchAttention
    from backend.core.layers.triton_attention import TritonAttention, _Scoring
    (ref_pool, tri_pool), r2t, batch, q, k, v = _pools(prefix_lens, ext_lens, h, d, seed, outlier)
    scale = 0.7 / d ** 0.5
    ref = TorchAttention(ref_pool, r2t).forward(q, k, v, 0, batch, scale)
    backend = TritonAttention(tri_pool, r2t, num_heads=h, min_split_len=min_split_len)
    backend.prepare(batch)
    out = backend.forward(q, k, v, 0, batch, scale)
    _same_store(tri_pool.k_buffer[0], ref_pool.k_buffer[0])
    _same_store(tri_pool.v_buffer[0], ref_pool.v_buffer[0])
    if outlier:
        slot = int(batch.out_cache_loc[0])
        assert tri_pool.k_buffer[0][slot, 0, 0].float().item() == 448.0
    # attention over the very same pool: the kernels' math against the reference's
    tri_pool.k_buffer[0].copy_(ref_pool.k_buffer[0])
    tri_pool.v_buffer[0].copy_(ref_pool.v_buffer[0])
    out = backend._attend(q, 0, batch, _Scoring(scale, 0, 0.0))
    err = (out - ref).abs().max().item()
    assert err < tol, f"max abs error {err}"
    # and the scales matter: the same bytes read with scale 1 give another answer
    assert (ref - TorchAttention(_unit(ref_pool), r2t).forward(q, k, v, 0, batch, scale)
            ).abs().max() > 1e-3


def _unit(pool):
    from backend.core.memory_pool import KVPool
    other = KVPool(pool.size, 1, 2, pool.k_buffer[0].shape[2], FP8, "cpu")
    other.k_buffer[0].copy_(pool.k_buffer[0])
    other.v_buffer[0].copy_(pool.v_buffer[0])
    return other


def _case_decode_rope(d, splits, min_split_len=0):
    """The decode kernel's own rotary + float8 store + attention == rotary, the torch
    store and the torch reference."""
    from types import SimpleNamespace
    from backend.core.kernels import DecodeRope, decode_attention, decode_workspace_numel
    from backend.core.layers.attention import TorchAttention
    from backend.core.layers.rotary import RotaryEmbedding
    (ref_pool, pool), r2t, batch, q, k, v = _pools([0, 2, 44, 299], [1] * 4, 4, d, seed=d)
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), d, max_positions=320)
    ref_q, ref_k = rot(batch.positions, q.clone(), k.clone())
    ref = TorchAttention(ref_pool, r2t).forward(ref_q, ref_k, v, 0, batch, 0.1)
    out = torch.full_like(q, float("nan"))
    ws = torch.full((decode_workspace_numel(4, 4, d, splits),), float("nan"))
    decode_attention(q, out, pool.k_buffer[0], pool.v_buffer[0], r2t, batch.req_pool_indices,
                     batch.seq_lens, 0.1, splits, workspace=ws,
                     rope=DecodeRope(k, v, batch.positions, rot.cos, rot.sin, batch.out_cache_loc),
                     k_scale=pool.k_scale[0], v_scale=pool.v_scale[0],
                     min_split_len=min_split_len)
    _same_store(pool.k_buffer[0], ref_pool.k_buffer[0])
    _same_store(pool.v_buffer[0], ref_pool.v_buffer[0])
    assert (out - ref).abs().max().item() < 0.05  # the interpreter's cast faults, above
    # over the pool the kernel wrote, the torch reference reads the kernel's answer
    ref = TorchAttention(pool, r2t)._decode(ref_q, 0, batch, 0.1, 0, 0.0)
    assert (out - ref).abs().max().item() < 1e-4


def _case_per_token_quant():
    from backend.core.kernels.fp8_quant import per_token_quant
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=gen) * torch.tensor([[1.0], [1e-3], [50.0], [0.0], [7.0]])
    q, scale = per_token_quant(x)
    assert q.dtype == FP8 and scale.shape == (5, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(-1, keepdim=True)
    want_scale = (amax / 448.0).clamp(min=1e-12)
    assert torch.allclose(scale, want_scale, rtol=1e-6)
    assert torch.equal(q[3].float(), torch.zeros(300))  # an all-zero row: zeros, no NaN
    # each row is x / scale cast to float8 (as torch casts it, up to the interpreter's
    # faults), and its largest value lands on +-448
    want = (x / scale).clamp(-448, 448).to(FP8).float()
    assert _cast_matches(q.float(), want).all()
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 2, 4]], torch.full((4,), 448.0))

CASES = {
    "extend-fp8": (_case_attention, dict(prefix_lens=[0, 5, 37], ext_lens=[7, 1, 70], h=4, d=64, seed=1)),
    "extend-fp8-outlier": (_case_attention, dict(prefix_lens=[3], ext_lens=[9], h=4, d=32, seed=2,
                                                 outlier=True)),
    "decode-fp8": (_case_attention, dict(prefix_lens=[0, 2, 44, 299], ext_lens=[1] * 4, h=4, d=64,
                                         seed=3)),
    "decode-fp8-gqa4": (_case_attention, dict(prefix_lens=[9, 60], ext_lens=[1, 1], h=8, d=80,
                                              seed=4)),
    "decode-rope-fp8": (_case_decode_rope, dict(d=64, splits=8)),
    # one-pass rows (only the 300-row splits) and a single split (no workspace)
    "decode-fp8-one-pass": (_case_attention, dict(prefix_lens=[0, 2, 44, 299], ext_lens=[1] * 4,
                                                  h=4, d=64, seed=5, min_split_len=64)),
    "decode-rope-fp8-one-pass": (_case_decode_rope, dict(d=64, splits=8, min_split_len=64)),
    "decode-rope-fp8-splits1": (_case_decode_rope, dict(d=64, splits=1)),
    "per-token-quant": (_case_per_token_quant, {}),
}


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    import backend.core.kernels.kv_store as kv_store
    assert isinstance(kv_store._store_kv_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_fp8_kernel_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    _worker()
