"""Fused RMSNorm / rotary / silu-and-mul kernels vs. the production torch modules
(layers/basic.py, layers/rotary.py), on CPU via the Triton interpreter.

As in test_triton_kernels.py, the interpreter must be chosen before anything imports
triton, so the ``results`` fixture runs this file once as a TRITON_INTERPRET=1 worker
subprocess that prints ``{case_id: "ok" | traceback}``. bf16 is left to
tools/check_fused_gpu.py: the interpreter's float32 -> bf16 cast does not round to
nearest like torch's, so it would be off by one bf16 ulp regardless of the kernel.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from interpreter_cases import REPO, run_cases

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _err(a, b):
    """Max abs error; for half types also require (almost) every element bit-equal: the
    kernels round where torch rounds, so only a float32 rounding tie may flip an element,
    while a misplaced rounding (e.g. weight multiply before the cast) flips many."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype == torch.float16:
        differ = (a != b).float().mean().item()
        assert differ < 0.01, f"{differ:.2%} of elements differ from torch"
    return (a.float() - b.float()).abs().max().item()


def _norm_module(hidden, dtype, gen, eps=1e-5, weight_dtype=None):
    from backend.core.layers.basic import RMSNorm
    norm = RMSNorm(hidden, eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=gen))
    return norm.to(weight_dtype or dtype)


def _strided_rows(t, hidden, gen, dtype):
    """x as the first `hidden` columns of a wider buffer: row stride != hidden."""
    buf = torch.randn(t, hidden + 7, generator=gen).to(dtype)
    return buf[:, :hidden]


def _case_rmsnorm(hidden, dtype, t=5, in_place=False, weight_dtype=None):
    from backend.core.kernels import fused
    gen = torch.Generator().manual_seed(hidden)
    norm = _norm_module(hidden, dtype, gen, weight_dtype=weight_dtype)
    x = _strided_rows(t, hidden, gen, dtype) * 3  # scale must not matter
    with torch.no_grad():
        ref = norm(x)
    x_before = x.clone()
    out = fused.rmsnorm(x, norm.weight.detach(), norm.eps, out=x if in_place else None)
    assert _err(out, ref) < TOL[dtype], _err(out, ref)
    if in_place:
        assert out.data_ptr() == x.data_ptr()
    else:
        assert torch.equal(x, x_before)  # input untouched


def _case_add_rmsnorm(hidden, dtype, t=6, mode="new"):
    """mode: "new" (fresh outputs), "inplace" (residual_out=residual, out=x) or
    "prealloc" (separate preallocated out/residual_out, NaN-filled)."""
    from backend.core.kernels import fused
    gen = torch.Generator().manual_seed(hidden + 1)
    norm = _norm_module(hidden, dtype, gen, eps=1e-6)
    x = _strided_rows(t, hidden, gen, dtype)
    residual = torch.randn(t, hidden, generator=gen).to(dtype) * 4
    ref_res = x + residual  # the layer's `x = x + attn(...)`
    with torch.no_grad():
        ref = norm(ref_res)
    kwargs = {}
    if mode == "inplace":
        kwargs = dict(out=x, residual_out=residual)
    elif mode == "prealloc":
        kwargs = dict(out=torch.full((t, hidden), float("nan"), dtype=dtype),
                      residual_out=torch.full((t, hidden), float("nan"), dtype=dtype))
    normed, new_res = fused.fused_add_rmsnorm(x, residual, norm.weight.detach(), norm.eps,
                                              **kwargs)
    assert torch.equal(new_res, ref_res)  # same float32 add + one rounding as torch
    assert _err(normed, ref) < TOL[dtype], _err(normed, ref)
    for name, given in kwargs.items():
        assert (normed if name == "out" else new_res).data_ptr() == given.data_ptr()


def _case_looped(hidden, residual, in_place=False):
    """Rows wider than MAX_NORM_BLOCK take the two-pass chunked path."""
    from backend.core.kernels import fused
    saved = fused.MAX_NORM_BLOCK
    fused.MAX_NORM_BLOCK = 64  # 96 -> 2 chunks (last half-masked), 320 -> 5 chunks
    try:
        if residual:
            _case_add_rmsnorm(hidden, torch.float32, mode="inplace" if in_place else "new")
            _case_add_rmsnorm(hidden, torch.float16, mode="inplace" if in_place else "new")
        else:
            _case_rmsnorm(hidden, torch.float32, in_place=in_place)
            _case_rmsnorm(hidden, torch.float16, in_place=in_place)
    finally:
        fused.MAX_NORM_BLOCK = saved


def _case_rotary(h, kvh, d, dtype, t=9):
    from backend.core.kernels import fused
    from backend.core.layers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(h * d)
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), d, max_positions=512)
    # q, k, v as views of one fused projection output: token stride (h + 2 kvh) * d
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(dtype)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v_before = qkv[:, (h + kvh) * d:].clone()
    # out of order, repeated, and reaching the last table row
    positions = torch.tensor([300, 7, 0, 511, 7, 45, 2, 130, 64][:t], dtype=torch.int64)
    q_before, k_before = q.clone(), k.clone()
    ref_q, ref_k = rot(positions, q_before, k_before)
    fused.rotary_embedding_(q, k, positions, rot.cos, rot.sin)
    assert _err(q, ref_q) < TOL[dtype], _err(q, ref_q)
    assert _err(k, ref_k) < TOL[dtype], _err(k, ref_k)
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)  # v (and nothing else) untouched
    # position 0 is the identity rotation (bit-exact); every other row really moved
    at0 = positions == 0
    assert torch.equal(q[at0], q_before[at0]) and torch.equal(k[at0], k_before[at0])
    assert ((q[~at0] - q_before[~at0]).abs().amax(dim=(1, 2)) > 1e-2).all()


def _case_rotary_store(h, kvh, d, dtype, t=7, pool_dtype=None):
    """rotary_store_kv == the layer's rotation followed by store_kv, and leaves k as is."""
    from backend.core.kernels import fused
    from backend.core.layers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(h * d + 1)
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), d, max_positions=256)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(dtype)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    positions = torch.tensor([200, 3, 0, 255, 17, 3, 64][:t], dtype=torch.int64)
    loc = torch.tensor([5, 1, 9, 2, 12, 7, 3][:t], dtype=torch.int64)
    pool = pool_dtype or dtype
    k_buf = torch.full((14, kvh, d), float("nan"), dtype=pool)
    v_buf = torch.full((14, kvh, d), float("nan"), dtype=pool)
    ref_q, ref_k = rot(positions, q.clone(), k.clone())
    k_before, v_before = k.clone(), v.clone()
    fused.rotary_store_kv(q, k, v, positions, rot.cos, rot.sin, k_buf, v_buf, loc)
    assert _err(q, ref_q) < TOL[dtype], _err(q, ref_q)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # only the pool copy moves
    got_k, ref_k = k_buf[loc], ref_k.to(pool)
    assert (got_k.float() - ref_k.float()).abs().max().item() < TOL[dtype]
    assert torch.equal(v_buf[loc], v.to(pool))
    untouched = torch.ones(14, dtype=torch.bool)
    untouched[loc] = False
    assert torch.isnan(k_buf[untouched]).all() and torch.isnan(v_buf[untouched]).all()


def _case_silu_and_mul(inter, dtype, t=4, strided=False, prealloc=False):
    from torch import nn
    from backend.core.kernels import fused
    from backend.core.layers.basic import GatedMLP
    gen = torch.Generator().manual_seed(inter)
    hidden = 32
    mlp = GatedMLP(hidden, inter)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(2 * inter, hidden, generator=gen) * 0.2)
    mlp.down_proj = nn.Identity()  # GatedMLP.forward then returns F.silu(gate) * up
    mlp = mlp.to(dtype)
    x = torch.randn(t, hidden, generator=gen).to(dtype)
    with torch.no_grad():
        ref = mlp(x)
        gate_up = mlp.gate_up_proj(x)
    if strided:  # gate_up as a column slice of a wider buffer: row stride 2I + 5
        buf = torch.zeros(t, 2 * inter + 5, dtype=dtype)
        buf[:, :2 * inter] = gate_up
        gate_up = buf[:, :2 * inter]
    assert gate_up.abs().max() > 3  # silu's saturating and negative regions are exercised
    out = torch.full((t, inter), float("nan"), dtype=dtype) if prealloc else None
    got = fused.silu_and_mul(gate_up, out=out)
    assert _err(got, ref) < TOL[dtype], _err(got, ref)
    if prealloc:
        assert got.data_ptr() == out.data_ptr()


def _case_gemma_rmsnorm(hidden, dtype, t=5, residual=False):
    """unit_offset: GemmaRMSNorm's math (scale 1 + w, one rounding at the end), alone and
    after the residual add, in the input's dtype."""
    from backend.core.kernels import fused
    from backend.core.layers.basic import GemmaRMSNorm
    gen = torch.Generator().manual_seed(hidden + 2)
    norm = GemmaRMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.randn(hidden, generator=gen))  # around 0: 1 + w ~ 1
    norm = norm.to(dtype)
    x = _strided_rows(t, hidden, gen, dtype) * 3
    res = torch.randn(t, hidden, generator=gen).to(dtype) if residual else None
    with torch.no_grad():
        ref = norm(x) if res is None else norm(x, res)[0]
    if res is None:
        got = fused.rmsnorm(x, norm.weight.detach(), norm.eps, unit_offset=True)
    else:
        got, new_res = fused.fused_add_rmsnorm(x, res, norm.weight.detach(), norm.eps,
                                               unit_offset=True)
        assert torch.equal(new_res, x + res)
    assert got.dtype == dtype and _err(got, ref) < TOL[dtype], _err(got, ref)
    # the 1 is really added: the plain kernel gives a visibly different row
    plain = fused.rmsnorm(x, norm.weight.detach(), norm.eps)
    assert (plain.float() - ref.float()).abs().max() > 0.1


def _case_empty():
    from backend.core.kernels import fused
    x = torch.empty(0, 96)
    w = torch.ones(96)
    assert fused.rmsnorm(x, w, 1e-5).shape == (0, 96)
    normed, res = fused.fused_add_rmsnorm(x, x.clone(), w, 1e-5)
    assert normed.shape == res.shape == (0, 96)
    fused.rotary_embedding_(torch.empty(0, 4, 8), torch.empty(0, 2, 8),
                            torch.empty(0, dtype=torch.int64), torch.ones(5, 4), torch.ones(5, 4))
    assert fused.silu_and_mul(torch.empty(0, 20)).shape == (0, 10)


CASES = {}
for _dt, _tag in ((torch.float32, "fp32"), (torch.float16, "fp16")):
    for _h in (96, 320, 2048):
        CASES[f"rmsnorm-{_tag}-h{_h}"] = (_case_rmsnorm, dict(hidden=_h, dtype=_dt))
        CASES[f"add-rmsnorm-{_tag}-h{_h}"] = (_case_add_rmsnorm, dict(hidden=_h, dtype=_dt))
    CASES[f"rmsnorm-{_tag}-inplace"] = (_case_rmsnorm, dict(hidden=320, dtype=_dt, in_place=True))
    for _m in ("inplace", "prealloc"):
        CASES[f"add-rmsnorm-{_tag}-{_m}"] = (_case_add_rmsnorm, dict(hidden=96, dtype=_dt, mode=_m))
    # GQA 2 and 6 (6 q heads: non-power-of-two head blocks); head_dim 80: half 40 is masked
    for _h, _kvh, _d in ((4, 2, 64), (6, 1, 80), (2, 2, 16)):
        CASES[f"rotary-{_tag}-h{_h}-kvh{_kvh}-d{_d}"] = (_case_rotary, dict(h=_h, kvh=_kvh, d=_d, dtype=_dt))
    for _h, _kvh, _d in ((4, 2, 64), (6, 1, 80)):
        CASES[f"rotary-store-{_tag}-h{_h}-kvh{_kvh}-d{_d}"] = (
            _case_rotary_store, dict(h=_h, kvh=_kvh, d=_d, dtype=_dt))
    for _h in (96, 2048):
        CASES[f"gemma-rmsnorm-{_tag}-h{_h}"] = (_case_gemma_rmsnorm, dict(hidden=_h, dtype=_dt))
        CASES[f"gemma-add-rmsnorm-{_tag}-h{_h}"] = (
            _case_gemma_rmsnorm, dict(hidden=_h, dtype=_dt, residual=True))
    CASES[f"silu-mul-{_tag}-i96"] = (_case_silu_and_mul, dict(inter=96, dtype=_dt))
    # 1100 = two full 512 blocks + a masked partial one
    CASES[f"silu-mul-{_tag}-i1100-strided-out"] = (
        _case_silu_and_mul, dict(inter=1100, dtype=_dt, strided=True, prealloc=True))
# fp32 weight with fp16 activations: output promotes to fp32 exactly as torch's RMSNorm
# an fp16 model over a float32 pool: the rotated k is rounded to fp16 first, like the
# unfused rotation's in-place store
CASES["rotary-store-fp16-fp32pool"] = (_case_rotary_store, dict(h=4, kvh=2, d=64,
                                                                dtype=torch.float16,
                                                                pool_dtype=torch.float32))
CASES["rmsnorm-fp16-fp32weight"] = (_case_rmsnorm, dict(hidden=320, dtype=torch.float16,
                                                        weight_dtype=torch.float32))
for _h in (96, 320):
    CASES[f"looped-rmsnorm-h{_h}"] = (_case_looped, dict(hidden=_h, residual=False))
    CASES[f"looped-add-rmsnorm-h{_h}"] = (_case_looped, dict(hidden=_h, residual=True))
CASES["looped-add-rmsnorm-inplace"] = (_case_looped, dict(hidden=320, residual=True, in_place=True))
CASES["looped-rmsnorm-inplace"] = (_case_looped, dict(hidden=96, residual=False, in_place=True))
CASES["empty-batch"] = (_case_empty, {})


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels import fused
    assert isinstance(fused._rmsnorm_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_fused_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
