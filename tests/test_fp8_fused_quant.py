"""The norm and SiLU-and-mul before an FP8 projection, fused with the per-token
quantization of their output (backend/core/kernels/fp8_fused_quant.py): on CPU via the
Triton interpreter, the float8 bytes, scales and residual sums are exactly those of the
two launches they replace (``fused.rmsnorm`` / ``fused.fused_add_rmsnorm`` /
``fused.silu_and_mul``, then ``fp8_quant.per_token_quant``). Cases run in a worker
subprocess (see interpreter_cases.py); on the GPU, tools/gpu/fp8_small_gemm_checks.py
checks the same equality and the layers' outputs with and without the fusion."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases


def _rows(rows, cols, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # rows of very different ranges (and an all-zero row): each row's scale matters
    ranges = torch.tensor([50.0, 1e-3, 1.0, 0.0, 7.0, 0.3])[torch.arange(rows) % 6]
    return (torch.randn(rows, cols, generator=gen) * ranges[:, None]).to(dtype)


def _same_bytes(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _case_rmsnorm(rows, cols, dtype, residual):
    from backend.core.kernels.fp8_fused_quant import rmsnorm_quant
    from backend.core.kernels.fp8_quant import per_token_quant
    from backend.core.kernels.fused import fused_add_rmsnorm, rmsnorm
    x = _rows(rows, cols, dtype, rows * cols)
    res = _rows(rows, cols, dtype, rows + cols) if residual else None
    weight = (1 + 0.5 * torch.randn(cols, generator=torch.Generator().manual_seed(cols))).to(dtype)
    (q, scale), res_out = rmsnorm_quant(x, res, weight, 1e-5)
    if residual:
        normed, want_res = fused_add_rmsnorm(x, res, weight, 1e-5)
        assert torch.equal(res_out, want_res)
    else:
        normed, want_res = rmsnorm(x, weight, 1e-5), x
        assert res_out is x  # no residual: the stream is x itself, as RMSNorm.linear returns
    want_q, want_scale = per_token_quant(normed)
    _same_bytes(q, want_q)
    assert torch.equal(scale, want_scale) and scale.shape == (rows, 1)
    if rows > 3:  # the all-zero row: zeros and the least scale, no NaN
        assert torch.equal(q[3].float(), torch.zeros(cols)) and scale[3].item() > 0


def _case_silu_mul(rows, inter, dtype, strided):
    from backend.core.kernels.fp8_fused_quant import silu_mul_quant
    from backend.core.kernels.fp8_quant import per_token_quant
    from backend.core.kernels.fused import silu_and_mul
    gate_up = _rows(rows, 2 * inter + (8 if strided else 0), dtype, inter)[:, : 2 * inter]
    q, scale = silu_mul_quant(gate_up)
    want_q, want_scale = per_token_quant(silu_and_mul(gate_up))
    _same_bytes(q, want_q)
    assert torch.equal(scale, want_scale) and q.shape == (rows, inter)


def _case_no_rows():
    from backend.core.kernels.fp8_fused_quant import rmsnorm_quant, silu_mul_quant
    (q, scale), _ = rmsnorm_quant(torch.empty(0, 64, dtype=torch.bfloat16), None,
                                  torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert q.shape == (0, 64) and scale.shape == (0, 1)
    q, scale = silu_mul_quant(torch.empty(0, 64, dtype=torch.bfloat16))
    assert q.shape == (0, 32) and scale.shape == (0, 1)


CASES = {}
for _rows_n, _cols in [(1, 64), (6, 96), (7, 200)]:
    for _dtype in (torch.bfloat16, torch.float16):
        for _res in (False, True):
            CASES[f"rmsnorm-{_rows_n}x{_cols}-{_dtype}-residual{_res}"] = (
                _case_rmsnorm, dict(rows=_rows_n, cols=_cols, dtype=_dtype, residual=_res))
for _rows_n, _inter, _strided in [(1, 64, False), (6, 150, True), (9, 96, False)]:
    for _dtype in (torch.bfloat16, torch.float16):
        CASES[f"silu-mul-{_rows_n}x{_inter}-{_dtype}-strided{_strided}"] = (
            _case_silu_mul, dict(rows=_rows_n, inter=_inter, dtype=_dtype, strided=_strided))
CASES["no-rows"] = (_case_no_rows, {})


def test_which_inputs_the_fused_kernels_take():
    from backend.core.kernels.fp8_fused_quant import (NORM_MAX_COLS, SILU_MAX_COLS,
                                                      fusable_norm, fusable_silu_mul)
    bf16 = torch.bfloat16
    # CPU tensors never: the layers quantize them with torch, as the GPU kernels would
    assert not fusable_norm(torch.zeros(2, 64, dtype=bf16), torch.ones(64, dtype=bf16))
    assert not fusable_silu_mul(torch.zeros(2, 64, dtype=bf16))
    if torch.cuda.is_available():
        cuda = dict(device="cuda", dtype=bf16)
        assert fusable_norm(torch.zeros(2, NORM_MAX_COLS, **cuda), torch.ones(NORM_MAX_COLS, **cuda))
        assert not fusable_norm(torch.zeros(2, 2 * NORM_MAX_COLS, **cuda),
                                torch.ones(2 * NORM_MAX_COLS, **cuda))
        assert not fusable_norm(torch.zeros(2, 64, **cuda), torch.ones(64, device="cuda"))
        assert fusable_silu_mul(torch.zeros(2, 2 * SILU_MAX_COLS, **cuda))
        assert not fusable_silu_mul(torch.zeros(2, 4 * SILU_MAX_COLS, **cuda))


def test_layers_without_fuse_rows_never_fuse():
    from backend.core.layers.fp8_linear import Fp8Linear
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32, bias=False))
    x = torch.zeros(4, 64)
    assert not layer.fuses_norm(x, torch.ones(64)) and not layer.fuses_silu_mul(x)


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels import fp8_fused_quant
    assert isinstance(fp8_fused_quant._rmsnorm_quant_kernel, InterpretedFunction), \
        "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_fp8_fused_quant_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
