"""The batch-1 projection kernels (backend/core/kernels/gemv.py) vs. the torch modules
they replace (RMSNorm then nn.Linear, SiLU-and-mul then nn.Linear), on CPU via the Triton
interpreter; see test_fused_kernels.py for why cases run in a worker subprocess and why
half precision is fp16 here (bf16 is checked on the GPU by tools/check_gemv_gpu.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases


def _bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 sums in another order, then one rounding to ``dtype``: a few ulps of the
    output plus a sliver of the row's scale (cancellation)."""
    ulp = {torch.float32: 2.0 ** -22, torch.float16: 2.0 ** -10}[dtype]
    return 2 * ulp * ref.abs() + 4 * ulp * ref.abs().max() + 1e-6


def _check(got, ref, dtype):
    assert got.dtype == dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
    diff = (got.float() - ref.float()).abs()
    assert (diff <= _bound(ref.float(), dtype)).all(), diff.max().item()


def _setup(n, k, dtype, bias, seed):
    from torch import nn
    gen = torch.Generator().manual_seed(seed)
    proj = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(n, k, generator=gen) * k ** -0.5)
        if bias:
            proj.bias.copy_(torch.randn(n, generator=gen))
    return proj.to(dtype), gen


def _case_norm_linear(n, k, dtype, residual, bias=False):
    from backend.core.kernels import gemv
    from backend.core.layers.basic import RMSNorm
    proj, gen = _setup(n, k, dtype, bias, n * k)
    norm = RMSNorm(k, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(k, generator=gen))
    norm = norm.to(dtype)
    x = (torch.randn(1, k, generator=gen) * 3).to(dtype)
    res = torch.randn(1, k, generator=gen).to(dtype) if residual else None
    ref, ref_res = norm.linear(proj, x, res)  # the module path (fuse_rows off on CPU)
    got, got_res = gemv.rmsnorm_linear_rows(x, res, norm.weight, norm.eps, proj.weight,
                                            proj.bias)
    _check(got, ref, dtype)
    assert torch.equal(got_res, ref_res)  # the new residual: one float32 add, one rounding
    if not residual:
        assert got_res is x


def _case_silu_linear(n, k, dtype):
    from backend.core.kernels import gemv
    from backend.core.layers.basic import GatedMLP
    proj, gen = _setup(n, k, dtype, False, n + k)
    mlp = GatedMLP(n, k).to(dtype)
    mlp.down_proj = proj
    gate_up = (torch.randn(1, 2 * k, generator=gen) * 3).to(dtype)  # silu's tails too
    ref = mlp.down(gate_up)
    _check(gemv.silu_mul_linear_rows(gate_up, proj.weight), ref, dtype)


def _case_linear(n, k, dtype, bias=False, out_dtype=None):
    from backend.core.kernels import gemv
    proj, gen = _setup(n, k, dtype, bias, 3 * n + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    ref = proj(x)
    got = gemv.linear_rows(x, proj.weight, proj.bias, out_dtype=out_dtype)
    if out_dtype is None:
        _check(got, ref, dtype)
    else:  # logits: the model-dtype product, widened
        assert got.dtype == out_dtype
        _check(got.to(dtype), ref, dtype)
        assert torch.equal(got, got.to(dtype).to(out_dtype))


def _case_norm_logits(n, k, dtype):
    """The final norm with the LM head (``RMSNorm.linear_weight``, float32 logits): the
    model-dtype product, widened, as the unfused module path gives it."""
    from backend.core.kernels import gemv
    from backend.core.layers.basic import RMSNorm
    proj, gen = _setup(n, k, dtype, False, 7 * n + k)
    norm = RMSNorm(k, 1e-6).to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    res = (torch.randn(1, k, generator=gen) * 2).to(dtype)
    ref, ref_res = norm.linear_weight(proj.weight, None, x, res, torch.float32)
    assert ref.dtype == torch.float32
    got, got_res = gemv.rmsnorm_linear_rows(x, res, norm.weight, norm.eps, proj.weight,
                                            out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got_res, ref_res)
    _check(got.to(dtype), ref.to(dtype), dtype)
    assert torch.equal(got, got.to(dtype).to(torch.float32))


def _case_refuses_batches():
    from backend.core.kernels import gemv
    w = torch.randn(8, 16)
    with pytest.raises(AssertionError, match="rows"):
        gemv.linear_rows(torch.randn(2, 16), w)


CASES = {}
for _dt, _tag in ((torch.float32, "fp32"), (torch.float16, "fp16")):
    # K in one tile (48, 600) and past 4096 (5000: looped 1024/2048-wide chunks, the last
    # one partial); N not a multiple of the 4-row block
    for _n, _k in ((37, 48), (130, 600), (9, 5000)):
        CASES[f"norm-linear-{_tag}-n{_n}-k{_k}"] = (
            _case_norm_linear, dict(n=_n, k=_k, dtype=_dt, residual=False))
        CASES[f"add-norm-linear-{_tag}-n{_n}-k{_k}"] = (
            _case_norm_linear, dict(n=_n, k=_k, dtype=_dt, residual=True))
        CASES[f"silu-linear-{_tag}-n{_n}-k{_k}"] = (_case_silu_linear, dict(n=_n, k=_k, dtype=_dt))
        CASES[f"linear-{_tag}-n{_n}-k{_k}"] = (_case_linear, dict(n=_n, k=_k, dtype=_dt))
    CASES[f"add-norm-linear-bias-{_tag}"] = (
        _case_norm_linear, dict(n=70, k=96, dtype=_dt, residual=True, bias=True))
    CASES[f"linear-bias-{_tag}"] = (_case_linear, dict(n=70, k=96, dtype=_dt, bias=True))
CASES["linear-fp16-float32-logits"] = (_case_linear, dict(n=300, k=64, dtype=torch.float16,
                                                         out_dtype=torch.float32))
CASES["norm-logits-fp16"] = (_case_norm_logits, dict(n=300, k=64, dtype=torch.float16))
CASES["norm-logits-fp16-looped"] = (_case_norm_logits, dict(n=20, k=5000, dtype=torch.float16))
CASES["refuses-batches"] = (_case_refuses_batches, {})


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels import gemv
    assert isinstance(gemv._gemv_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_gemv_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
