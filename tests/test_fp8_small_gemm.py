"""The few-row FP8 GEMM (backend/core/kernels/small_gemm.py) on CPU via the Triton
interpreter: against the float32 product of the same float8 operands, with and without a
bias, for row counts and
dimensions that fit no tile (masked rows and outputs, K not a multiple of BLOCK_K).
Cases run in a worker subprocess (see interpreter_cases.py); bf16 and the float8 tensor
cores are checked on the GPU by tools/gpu/fp8_small_gemm_checks.py."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases

SMALL_TILES = dict(block_n=32, block_m=16, block_k=32, warps=4, stages=2)


def _operands(m, n, k, seed):
    from backend.core.fp8 import quantize_rows
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[:, : k // 3] *= 4  # rows of different ranges: each row's scale matters
    wq, ws = quantize_rows(w)
    x = torch.randn(m, k, generator=gen)
    return x, wq, ws.view(-1), wq.float() * ws, torch.randn(n, generator=gen)


def _case_w8a8(m, n, k, bias):
    from backend.core.fp8 import quantize_rows
    from backend.core.kernels.small_gemm import SmallGemmTiles, small_gemm
    x, wq, ws, deq, b = _operands(m, n, k, m * n + k)
    xq, xs = quantize_rows(x)
    got = small_gemm(xq, xs, wq, ws, b if bias else None, torch.float32,
                     SmallGemmTiles(**SMALL_TILES))
    ref = (xq.float() * xs) @ deq.T + (b if bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # the same products summed in another order: float32 rounding of K terms
    magnitude = (xq.float() * xs).abs() @ deq.abs().T
    assert ((got - ref).abs() <= 2.0 ** -20 * magnitude + 1e-6).all()


def _case_no_rows():
    from backend.core.kernels.small_gemm import small_gemm
    _, wq, ws, _, _ = _operands(1, 48, 64, 0)
    got = small_gemm(torch.empty(0, 64, dtype=wq.dtype), torch.empty(0, 1), wq, ws, None,
                     torch.bfloat16)
    assert got.shape == (0, 48) and got.dtype == torch.bfloat16


CASES = {}
for _m, _n, _k in [(1, 32, 32), (3, 100, 96), (16, 64, 128), (17, 70, 200), (40, 33, 64)]:
    for _bias in (False, True):
        CASES[f"w8a8-{_m}x{_n}x{_k}-bias{_bias}"] = (_case_w8a8, dict(m=_m, n=_n, k=_k, bias=_bias))
CASES["no-rows"] = (_case_no_rows, {})


def test_default_tiles_take_every_row_of_a_decode_batch_up_to_64():
    from backend.core.kernels.small_gemm import choose_tiles
    assert [choose_tiles(r).block_m for r in (1, 2, 16, 17, 32, 33, 64, 128)] == \
        [16, 16, 16, 32, 32, 64, 64, 64]


def test_few_rows_take_it_and_narrow_projections_take_it_twice_as_far():
    from backend.core.layers.fp8_linear import SMALL_GEMM_ROWS, Fp8Linear
    wide = Fp8Linear.from_linear(torch.nn.Linear(32, 96, bias=False))  # like qkv, gate/up
    narrow = Fp8Linear.from_linear(torch.nn.Linear(96, 32, bias=False))  # like o, down
    assert [wide.takes_small_gemm(r) for r in (2, SMALL_GEMM_ROWS, SMALL_GEMM_ROWS + 1)] == \
        [True, True, False]
    assert [narrow.takes_small_gemm(r) for r in (2, 2 * SMALL_GEMM_ROWS, 2 * SMALL_GEMM_ROWS + 1)] == \
        [True, True, False]


def test_activations_must_be_float8_rows_with_a_scale_each():
    from backend.core.kernels.small_gemm import small_gemm
    _, wq, ws, _, _ = _operands(2, 32, 32, 1)
    with pytest.raises(AssertionError, match="a scale each"):
        small_gemm(torch.zeros(2, 32), torch.ones(2, 1), wq, ws, None, torch.float32)
    with pytest.raises(AssertionError, match="a scale each"):
        small_gemm(torch.zeros(2, 32, dtype=wq.dtype), torch.ones(1, 1), wq, ws, None,
                   torch.float32)


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels import small_gemm
    assert isinstance(small_gemm._small_gemm_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_fp8_small_gemm_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
