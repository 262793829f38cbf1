"""The few-row half-precision GEMM (``half_small_gemm`` in backend/core/kernels/small_gemm.py)
against ``F.linear`` on CPU via the Triton interpreter, for row counts and dimensions that
fit no tile (masked rows and outputs, K not a multiple of BLOCK_K), with and without a
bias. Half precision is fp16 here (the interpreter has no bf16 dot); bf16 on the tensor
cores, and the timing against cuBLAS, are checked on the GPU by
tools/gpu/half_small_gemm_checks.py."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from interpreter_cases import REPO, run_cases

SMALL_TILES = dict(block_n=32, block_m=16, block_k=32, warps=4, stages=2)


def _case_half(m, n, k, bias):
    from backend.core.kernels.small_gemm import SmallGemmTiles, half_small_gemm
    gen = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).half()
    x = torch.randn(m, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    got = half_small_gemm(x, w, b, tiles=SmallGemmTiles(**SMALL_TILES))
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (m, n) and got.dtype == torch.float16
    # float32 sums in another order, then one rounding to fp16
    magnitude = x.float().abs() @ w.float().abs().T + (0 if b is None else b.float().abs())
    assert ((got.float() - ref).abs() <= 2.0 ** -11 * ref.abs() + 2.0 ** -20 * magnitude).all()


def _case_out_dtype():
    from backend.core.kernels.small_gemm import SmallGemmTiles, half_small_gemm
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(40, 64, generator=gen).half(), torch.randn(3, 64, generator=gen).half()
    got = half_small_gemm(x, w, out_dtype=torch.float32, tiles=SmallGemmTiles(**SMALL_TILES))
    assert got.dtype == torch.float32
    assert torch.allclose(got, x.float() @ w.float().T, rtol=1e-5, atol=1e-5)


def _case_no_rows():
    from backend.core.kernels.small_gemm import half_small_gemm
    got = half_small_gemm(torch.empty(0, 64, dtype=torch.float16),
                          torch.zeros(48, 64, dtype=torch.float16))
    assert got.shape == (0, 48) and got.dtype == torch.float16


CASES = {}
for _m, _n, _k in [(2, 32, 32), (3, 100, 96), (16, 64, 128), (17, 70, 200), (40, 33, 64)]:
    for _bias in (False, True):
        CASES[f"half-{_m}x{_n}x{_k}-bias{_bias}"] = (_case_half, dict(m=_m, n=_n, k=_k, bias=_bias))
CASES["out-dtype"] = (_case_out_dtype, {})
CASES["no-rows"] = (_case_no_rows, {})


def test_off_cuda_every_batch_stays_on_f_linear():
    """So that CPU results match the reference implementations exactly."""
    from backend.core.layers import basic
    w = torch.zeros(16, 16, dtype=torch.bfloat16)
    assert basic.small_gemm_shape(4, *w.shape)  # a shape it would take on CUDA
    assert not basic.small_gemm_rows(torch.zeros(4, 16, dtype=torch.bfloat16), w, None)
    meta = torch.empty(4, 16, dtype=torch.bfloat16, device="meta")
    assert not basic.small_gemm_rows(meta, w, None)


def test_it_takes_two_to_32_rows_of_projections_at_least_as_wide_as_deep():
    from backend.core.layers.basic import small_gemm_shape
    qkv, o, down, lm_head = (6144, 4096), (4096, 4096), (4096, 14336), (128256, 4096)
    assert [small_gemm_shape(r, *qkv) for r in (1, 2, 32, 33, 64, 128)] == \
        [False, True, True, False, False, False]
    assert [small_gemm_shape(8, *w) for w in (qkv, o, down, lm_head)] == [True, True, False, True]


def test_wrong_operands_are_refused():
    from backend.core.kernels.small_gemm import half_small_gemm
    with pytest.raises(AssertionError, match="one dtype"):
        half_small_gemm(torch.zeros(2, 32, dtype=torch.float16), torch.zeros(8, 32))
    with pytest.raises(AssertionError, match="one dtype"):
        half_small_gemm(torch.zeros(2, 32), torch.zeros(8, 32))


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels import small_gemm
    assert isinstance(small_gemm._small_gemm_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_half_small_gemm_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
