"""Triton kernels vs. the TorchAttention reference, on CPU via the Triton interpreter.

Triton picks interpreter vs. compiler when ``triton.language`` itself is imported, and
other test modules may import triton first (xgrammar does), so the cases cannot run in
the pytest process. The ``results`` fixture runs this file once as a worker subprocess
with TRITON_INTERPRET=1; the worker runs every case and prints one JSON line
``{case_id: "ok" | traceback}``; each pytest test asserts its own case.
"""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases
from kv_batches import shuffled_kv_batch

FP32_TOL = 1e-4


def _compare(prefix_lens, ext_lens, h, kvh, d, seed, tol=FP32_TOL, dtype=torch.float32,
             window=0, softcap=0.0, min_split_len=None):
    """TritonAttention.forward == TorchAttention.forward, outputs and pool contents
    (``min_split_len``: the backend's decode rows split only past it)."""
    from backend.core.layers.attention import TorchAttention
    from backend.core.layers.triton_attention import TritonAttention
    kv = shuffled_kv_batch(prefix_lens, ext_lens, h, kvh, d, seed, dtype=dtype)
    (ref_pool, tri_pool), r2t, batch = kv.pools, kv.req_to_token, kv.batch
    q, k, v = kv.q, kv.k, kv.v
    scale = 0.7 / d ** 0.5  # not the default 1/sqrt(d): proves the scale is honoured
    options = dict(window=window, softcap=softcap)
    ref = TorchAttention(ref_pool, r2t).forward(q, k, v, 0, batch, scale, **options)
    if window or softcap:
        _check_reference(ref, q, ref_pool, r2t, batch, scale, tol=tol, **options)
    backend = TritonAttention(tri_pool, r2t, num_heads=h, min_split_len=min_split_len)
    backend.prepare(batch)
    out = backend.forward(q, k, v, 0, batch, scale, **options)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err < tol, f"max abs error {err}"
    # store_kv wrote exactly what the reference wrote, and nothing else
    assert torch.equal(tri_pool.k_buffer[0], ref_pool.k_buffer[0])
    assert torch.equal(tri_pool.v_buffer[0], ref_pool.v_buffer[0])
    if batch.is_decode:
        assert backend.num_kv_splits(batch.batch_size) == 8  # CPU default
        layout = backend.split_layout(batch.batch_size, batch.max_seq_len)
        assert layout.min_split_len == (min_split_len or 0)
        assert max(batch.seq_lens_cpu) > 8 > min(batch.seq_lens_cpu)


def _check_reference(out, q, pool, r2t, batch, scale, window, softcap, tol):
    """TorchAttention's window / soft cap against attention written out by definition,
    one query at a time; and the window really hides keys (the output differs from full
    attention wherever a row is longer than the window)."""
    group = q.shape[1] // pool.k_buffer[0].shape[1]
    row = 0
    for b, (prefix, n) in enumerate(zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)):
        slots = r2t[batch.req_pool_indices[b], :prefix + n].long()
        keys = pool.k_buffer[0][slots].float().repeat_interleave(group, dim=1)  # [S, H, D]
        values = pool.v_buffer[0][slots].float().repeat_interleave(group, dim=1)
        for j in range(n):
            pos = prefix + j
            lo = max(0, pos - window + 1) if window else 0
            scores = torch.einsum("hd,shd->hs", q[row].float(), keys[lo:pos + 1]) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            want = torch.einsum("hs,shd->hd", scores.softmax(-1), values[lo:pos + 1])
            assert (out[row].float() - want).abs().max() < tol
            if window and pos >= window:
                full = torch.einsum("hs,shd->hd", (torch.einsum(
                    "hd,shd->hs", q[row].float(), keys[:pos + 1]) * scale).softmax(-1),
                    values[:pos + 1])
                assert (full - want).abs().max() > 1e-3
            row += 1


def _decode_direct(splits, seq_lens_override=None, min_split_len=0):
    """decode_attention called directly with a given split layout and a NaN-filled
    workspace (every element it reads must have been written this call): (out, torch
    reference, workspace after the call). Rows of 1, 7 and 91 positions; fp32 KV tiles
    are 32 positions."""
    from backend.core.kernels import decode_attention, decode_workspace_numel
    from backend.core.layers.attention import TorchAttention
    kv = shuffled_kv_batch([0, 6, 90], [1, 1, 1], 4, 2, 64, seed=splits, num_pools=1)
    pool, r2t, batch, q, k, v = kv.pools[0], kv.req_to_token, kv.batch, kv.q, kv.k, kv.v
    ref = TorchAttention(pool, r2t).forward(q, k, v, 0, batch, 0.125)  # also stores K/V
    seq_lens = batch.seq_lens if seq_lens_override is None else torch.tensor(seq_lens_override)
    out = torch.full_like(q, float("nan"))
    ws = torch.full((decode_workspace_numel(3, 4, 64, splits),), float("nan"))
    decode_attention(q, out, pool.k_buffer[0], pool.v_buffer[0], r2t, batch.req_pool_indices,
                     seq_lens, 0.125, splits, workspace=ws, min_split_len=min_split_len)
    return out, ref, ws


def _case_decode_splits(splits, min_split_len=0):
    out, ref, _ = _decode_direct(splits, min_split_len=min_split_len)
    assert (out - ref).abs().max().item() < FP32_TOL


def _case_decode_one_pass_all():
    # min_split_len past every row: each row is one pass, written by its split 0; the
    # workspace is never touched (still all NaN) and the merge reads none of it
    out, ref, ws = _decode_direct(4, min_split_len=100)  # 100 -> 128: holds the 91-row
    assert (out - ref).abs().max().item() < FP32_TOL
    assert ws.numel() > 0 and torch.isnan(ws).all()


def _case_decode_one_pass_mixed():
    # min_split_len 64 over 4 splits: rows 1 and 7 run in one pass, the 91-row splits in
    # two 64-position chunks, and only those two go through the workspace
    out, ref, ws = _decode_direct(4, min_split_len=64)
    assert (out - ref).abs().max().item() < FP32_TOL
    written = (~torch.isnan(ws)).sum().item()
    # row 2's 4 heads x 2 used splits x (64 acc + 1 lse): nothing for rows 0 and 1
    assert written == 4 * 2 * (64 + 1)


def _case_decode_single_split_no_workspace():
    # one split: no workspace at all (numel 0), every row one pass, no second launch
    from backend.core.kernels import decode_attention, decode_workspace_numel
    from backend.core.layers.attention import TorchAttention
    assert decode_workspace_numel(3, 4, 64, 1) == 0
    kv = shuffled_kv_batch([0, 6, 90], [1, 1, 1], 4, 2, 64, seed=21, num_pools=1)
    pool, r2t, batch, q, k, v = kv.pools[0], kv.req_to_token, kv.batch, kv.q, kv.k, kv.v
    ref = TorchAttention(pool, r2t).forward(q, k, v, 0, batch, 0.125)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, out, pool.k_buffer[0], pool.v_buffer[0], r2t, batch.req_pool_indices,
                     batch.seq_lens, 0.125, 1)
    assert (out - ref).abs().max().item() < FP32_TOL


def _case_decode_padding_row(splits=4, min_split_len=0):
    # seq_len 0 (a CUDA-graph padding row) gives exactly 0, not NaN; others unaffected
    out, ref, _ = _decode_direct(splits, seq_lens_override=[1, 0, 91], min_split_len=min_split_len)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert (out[2] - ref[2]).abs().max().item() < FP32_TOL
    assert torch.isfinite(out).all()


def _case_store_kv_strided_cast():
    from backend.core.kernels import store_kv
    gen = torch.Generator().manual_seed(11)
    kvh, d, n = 2, 80, 9
    # k/v as views of one fused projection output: token stride 3*kvh*d, not kvh*d
    fused = torch.randn(n, 3 * kvh, d, generator=gen)
    k, v = fused[:, kvh:2 * kvh], fused[:, 2 * kvh:]
    k_buf = torch.zeros(50, kvh, d, dtype=torch.float16)
    v_buf = torch.zeros(50, kvh, d, dtype=torch.float16)
    loc = torch.randperm(49, generator=gen)[:n] + 1
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k.half()) and torch.equal(v_buf[loc], v.half())
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[loc] = False
    assert k_buf[untouched].abs().sum().item() == 0 and v_buf[untouched].abs().sum().item() == 0


def _case_decode_rope(h, kvh, d, splits, dtype=torch.float32, tol=FP32_TOL, window=0,
                      min_split_len=0):
    """decode_attention with ``rope`` == the layer's rotation, the pool store and the
    plain decode kernel: same output, same pool, q and k left as they were; a padding
    row (seq_len 0) writes nothing."""
    from types import SimpleNamespace
    from backend.core.kernels import DecodeRope, decode_attention, decode_workspace_numel
    from backend.core.layers.attention import TorchAttention
    from backend.core.layers.rotary import RotaryEmbedding
    # 64 = 2 whole 32-slot chunks: the new token opens no split of its own
    prefix_lens = [0, 2, 44, 299, 63, 5]
    kv = shuffled_kv_batch(prefix_lens, [1] * 6, h, kvh, d, seed=d * splits + h, dtype=dtype)
    (ref_pool, pool), r2t, batch, q, k, v = kv.pools, kv.req_to_token, kv.batch, kv.q, kv.k, kv.v
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), d, max_positions=320)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    ref_q, ref_k = rot(batch.positions, q.clone(), k.clone())
    ref = TorchAttention(ref_pool, r2t).forward(ref_q, ref_k, v, 0, batch, 0.1, window=window)
    # the last row is graph padding: seq_len 0, and its slot must stay untouched
    seq_lens = batch.seq_lens.clone()
    seq_lens[-1] = 0
    pad_slot = int(batch.out_cache_loc[-1])
    out = torch.full_like(q, float("nan"))
    ws = torch.full((decode_workspace_numel(6, h, d, splits),), float("nan"))
    rope = DecodeRope(k, v, batch.positions, rot.cos, rot.sin, batch.out_cache_loc)
    decode_attention(q, out, pool.k_buffer[0], pool.v_buffer[0], r2t, batch.req_pool_indices,
                     seq_lens, 0.1, splits, workspace=ws, rope=rope, window=window,
                     min_split_len=min_split_len)
    err = (out[:-1].float() - ref[:-1].float()).abs().max().item()
    assert err < tol, f"max abs error {err}"
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert torch.equal(q, q_before) and torch.equal(k, k_before) and torch.equal(v, v_before)
    for got, want in ((pool.k_buffer[0], ref_pool.k_buffer[0]), (pool.v_buffer[0], ref_pool.v_buffer[0])):
        got, want = got.clone(), want.clone()
        assert torch.equal(got[pad_slot], torch.zeros_like(got[pad_slot]))  # never written
        got[pad_slot] = want[pad_slot] = 0
        assert (got.float() - want.float()).abs().max().item() <= tol / 10


# prefix 0 and > 0; an extend of 1 (a decode row in a mixed batch); an extend of 70 spans
# two 64-row query blocks; 32-slot KV tiles straddle the prefix/new boundary
EXTEND = dict(prefix_lens=[0, 5, 37, 0], ext_lens=[7, 1, 70, 33])
# seq_lens 1 and 3 are below the 8 splits; 300 fills five 64-slot chunks
DECODE = dict(prefix_lens=[0, 2, 44, 299], ext_lens=[1, 1, 1, 1])
HEADS = [(2, 2, 64), (4, 2, 80), (4, 1, 64)]  # GQA ratios 1, 2, 4; head_dim 80 is padded

CASES = {}
for _h, _kvh, _d in HEADS:
    CASES[f"extend-h{_h}-kvh{_kvh}-d{_d}"] = (_compare, dict(EXTEND, h=_h, kvh=_kvh, d=_d, seed=_d + _h))
    CASES[f"decode-h{_h}-kvh{_kvh}-d{_d}"] = (_compare, dict(DECODE, h=_h, kvh=_kvh, d=_d, seed=_d - _h))
for _d in (32, 256):
    CASES[f"extend-d{_d}"] = (_compare, dict(prefix_lens=[0, 12], ext_lens=[5, 18], h=2, kvh=1, d=_d, seed=_d))
    CASES[f"decode-d{_d}"] = (_compare, dict(prefix_lens=[0, 40], ext_lens=[1, 1], h=2, kvh=1, d=_d, seed=_d))
# fp16 pools: fp32 accumulation keeps the error at output rounding. bf16 is left to
# tools/check_kernels_gpu.py: the interpreter's tl.dot multiplies bf16 operands as
# their raw uint16 bit patterns.
for _d in (96, 128):
    CASES[f"extend-fp16-d{_d}"] = (_compare, dict(prefix_lens=[3, 0], ext_lens=[9, 20], h=4, kvh=2, d=_d,
                                                  seed=_d, dtype=torch.float16, tol=2e-3))
    CASES[f"decode-fp16-d{_d}"] = (_compare, dict(prefix_lens=[3, 30], ext_lens=[1, 1], h=4, kvh=2, d=_d,
                                                  seed=_d, dtype=torch.float16, tol=2e-3))
for _s in (1, 3, 16, 32):
    CASES[f"decode-splits{_s}"] = (_case_decode_splits, dict(splits=_s))
CASES["decode-padding-row"] = (_case_decode_padding_row, {})
# one-pass rows (min_split_len): all rows, a mix with a split row, one split without a
# workspace, a padding row among them, a short minimum over many splits
CASES["decode-one-pass-all"] = (_case_decode_one_pass_all, {})
CASES["decode-one-pass-mixed"] = (_case_decode_one_pass_mixed, {})
CASES["decode-single-split-no-workspace"] = (_case_decode_single_split_no_workspace, {})
CASES["decode-one-pass-padding-row"] = (_case_decode_padding_row, dict(splits=8, min_split_len=64))
CASES["decode-splits32-min40"] = (_case_decode_splits, dict(splits=32, min_split_len=40))
CASES["decode-one-pass-backend"] = (_compare, dict(DECODE, h=4, kvh=2, d=64, seed=8, min_split_len=64))
CASES["decode-one-pass-fp16"] = (_compare, dict(prefix_lens=[3, 30, 150], ext_lens=[1, 1, 1], h=4,
                                                kvh=2, d=128, seed=9, dtype=torch.float16,
                                                tol=2e-3, min_split_len=64))
# the split holding the new token: the last of 8 (long rows), an early one (short rows)
for _h, _kvh, _d in HEADS:
    CASES[f"decode-rope-h{_h}-kvh{_kvh}-d{_d}"] = (_case_decode_rope, dict(h=_h, kvh=_kvh, d=_d, splits=8))
CASES["decode-rope-splits1"] = (_case_decode_rope, dict(h=4, kvh=2, d=64, splits=1))
# one pass: the 300-row splits in 64-position chunks, the others (the 64-row too) do not
CASES["decode-rope-one-pass"] = (_case_decode_rope, dict(h=4, kvh=1, d=64, splits=8,
                                                         min_split_len=64))
CASES["decode-rope-fp16"] = (_case_decode_rope, dict(h=4, kvh=2, d=128, splits=4,
                                                     dtype=torch.float16, tol=2e-3))
CASES["store-kv-strided-cast"] = (_case_store_kv_strided_cast, {})
# Sliding windows: shorter and longer than the rows, not a multiple of a KV tile; a query
# block (64 rows) whose window starts tiles before it; GQA; decode rows of every split.
for _w in (1, 5, 40):
    CASES[f"extend-window{_w}"] = (_compare, dict(EXTEND, h=4, kvh=2, d=64, seed=_w, window=_w))
    CASES[f"decode-window{_w}"] = (_compare, dict(DECODE, h=4, kvh=2, d=64, seed=_w, window=_w))
CASES["extend-window-fp16"] = (_compare, dict(prefix_lens=[3, 40], ext_lens=[70, 20], h=4, kvh=1,
                                              d=128, seed=3, dtype=torch.float16, tol=2e-3,
                                              window=33))
for _w in (1, 7, 100):
    CASES[f"decode-rope-window{_w}"] = (_case_decode_rope, dict(h=4, kvh=2, d=64, splits=8,
                                                                window=_w))
CASES["extend-softcap"] = (_compare, dict(EXTEND, h=4, kvh=2, d=64, seed=5, softcap=2.0))
CASES["decode-softcap-window"] = (_compare, dict(DECODE, h=4, kvh=2, d=64, seed=6, softcap=2.0,
                                                 window=9))
# one pass under a window: rows whose window fits one chunk, and the 300-row whose 100
# visible positions split in two
CASES["decode-window100-one-pass"] = (_compare, dict(DECODE, h=4, kvh=2, d=64, seed=10, window=100,
                                                     min_split_len=64))
CASES["decode-softcap-one-pass"] = (_compare, dict(DECODE, h=4, kvh=2, d=64, seed=11, softcap=2.0,
                                                   min_split_len=64))
for _w in (7, 100):
    CASES[f"decode-rope-window{_w}-one-pass"] = (_case_decode_rope, dict(
        h=4, kvh=2, d=64, splits=8, window=_w, min_split_len=64))


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    import backend.core.kernels.kv_store as kv_store
    assert isinstance(kv_store._store_kv_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
