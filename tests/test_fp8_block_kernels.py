"""The block-scaled FP8 kernels (backend/core/kernels/fp8_block_gemm.py) on CPU via the
Triton interpreter: the activation group quantizer against its torch form, the W8A8
GEMM against dequantize-then-matmul in float32 for shapes that fit no block (partial
last blocks on both sides), 1-row scale blocks, a bias and every tile order; then a
block-FP8 model whose batches of 1-2 rows take the weight-only kernels, against its
dequantized reference. Cases run in a worker subprocess (interpreter_cases.py). Last,
the GEMM's default tiles compile for the H200 (sm_90) without spilling registers."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases
from sm90_compile import compile_for_h200

FP8 = torch.float8_e4m3fn


def _weights(n, k, block, seed):
    """(float8 weight [n, k], block scales, dequantized float32 weight): blocks of very
    different ranges, so that a scale applied to the wrong block shows."""
    from backend.core.layers.fp8_block_linear import dequantize_blocks, quantize_blocks
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    w[:, : k // 3] *= 16
    w[: n // 2] *= 0.05
    q, scale = quantize_blocks(w, block)
    return q, scale, dequantize_blocks(q, scale, block)


def _case_group_quant(m, k, group):
    from test_fp8_kernels import _cast_matches
    from backend.core.kernels.fp8_block_gemm import group_quant
    from backend.core.layers.fp8_block_linear import quantize_groups
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, : group // 2] *= 1e4  # an outlier scales its own group only
    x[-1] = 0.0  # an all-zero token: zeros, no NaN
    q, scale = group_quant(x, group)
    want_q, want_scale = quantize_groups(x, group)
    assert q.dtype == FP8 and scale.shape == (m, -(-k // group)) and scale.dtype == torch.float32
    assert torch.equal(scale, want_scale)
    assert _cast_matches(q.float(), want_q.float()).all()
    assert torch.equal(q[-1].float(), torch.zeros(k))
    # each group's largest magnitude lands on 448, the outlier's neighbours keep theirs
    assert q[0, :group].float().abs().max() == 448.0
    assert q[0, group:2 * group].float().abs().max() == 448.0
    assert scale[0, 0] > 1000 * scale[0, 1]


def _case_gemm(m, n, k, block, out_dtype=torch.float32, bias=False, config=None):
    from backend.core.kernels.fp8_block_gemm import GemmConfig, block_gemm, group_quant
    from backend.core.layers.fp8_block_linear import dequantize_blocks
    block_n, group = block
    wq, w_scale, w = _weights(n, k, block, seed=n * k + m)
    gen = torch.Generator().manual_seed(m + n)
    xq, x_scale = group_quant(torch.randn(m, k, generator=gen) * 2, group)
    x = dequantize_blocks(xq, x_scale, (1, group))  # the kernel's own operands
    b = torch.randn(n, generator=gen).to(out_dtype) if bias else None
    ref = torch.nn.functional.linear(x, w, None if b is None else b.float())
    got = block_gemm(xq, x_scale, wq, w_scale, block_n, group, out_dtype, b,
                     config=GemmConfig(*config) if config else None)
    assert got.dtype == out_dtype and got.shape == (m, n)
    # float32 sums in another order (per group, then scaled), one rounding to out_dtype
    ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10}[out_dtype]
    bound = 2 * ulp * ref.abs() + 2.0 ** -18 * (x.abs() @ w.abs().T) + 1e-6
    diff = (got.float() - ref).abs()
    assert (diff <= bound).all(), diff.max().item()
    # and the block scales matter: one scale for the whole weight is far off
    flat = torch.nn.functional.linear(x, wq.float() * w_scale.mean())
    assert (flat - ref).abs().max() > 100 * bound.max()


def _case_gemm_no_rows():
    from backend.core.kernels.fp8_block_gemm import block_gemm
    wq, w_scale, _ = _weights(40, 64, (32, 32), seed=0)
    out = block_gemm(torch.zeros(0, 64).to(FP8), torch.zeros(0, 2), wq, w_scale, 32, 32,
                     torch.float32)
    assert out.shape == (0, 40)


def _case_layer_kernel_product(n, k, block, bias):
    """The layer's CUDA product (group quantization, then the GEMM, as its forward calls
    them) against the same quantized operands dequantized and multiplied in float32 (the
    layer's CPU product quantizes with torch, whose float8 cast the interpreter's differs
    from on a few values: test_fp8_kernels._cast_matches)."""
    from torch import nn

    from backend.core.kernels.fp8_block_gemm import group_quant
    from backend.core.layers.fp8_block_linear import Fp8BlockLinear, emulated_block_mm
    torch.manual_seed(n)
    layer = Fp8BlockLinear.from_linear(nn.Linear(k, n, bias=bias), block)
    rows = torch.randn(7, k) * 3
    got = layer.kernel_product(rows)
    want = emulated_block_mm(*group_quant(rows, block[1]), layer.weight, layer.weight_scale,
                             block, layer.bias)
    assert got.shape == (7, n) and (got - want).abs().max() <= 1e-5 * want.abs().max()


def _case_model(prompt_len):
    """A tiny Llama with ``quantization="fp8_block"`` (128 x 128 blocks over 64-wide
    layers: one partial block each): with ``fuse_rows`` (as the runner sets it on CUDA)
    batches of up to WEIGHT_ONLY_ROWS rows take the weight-only kernels, the numbers of
    the dequantized weights up to float32 sum order; one row more stays W8A8, the
    same numbers as with ``fuse_rows`` off."""
    import tempfile
    from pathlib import Path

    import model_factory as mf
    from engine_helpers import ARCH_OVERRIDES, make_engine
    from backend.core.layers.fp8_block_linear import WEIGHT_ONLY_ROWS
    from backend.core.layers.fp8_linear import dequantize_linears
    quality = mf._tools_module("fp8_quality")
    folder = mf.build_tiny_model(Path(tempfile.mkdtemp()) / "llama", arch="llama",
                                 **ARCH_OVERRIDES["llama"])
    prompt = [5 + (7 * i) % 150 for i in range(prompt_len)]
    fused, w8a8, ref = (make_engine(folder, quantization="fp8_block").runner for _ in range(3))
    for module in fused.model.modules():
        if hasattr(module, "fuse_rows"):
            module.fuse_rows = True
    assert dequantize_linears(ref.model, torch.float32) == 4 * len(ref.model.layers)
    got, plain, want = (quality.text_logits(r, [prompt])[0] for r in (fused, w8a8, ref))
    err = ((got - want).abs().max() / want.abs().max()).item()
    if prompt_len <= WEIGHT_ONLY_ROWS:
        assert err < 1e-5, err
        w8a8_err = ((plain - want).abs().max() / want.abs().max()).item()
        assert w8a8_err > 100 * err, (w8a8_err, err)  # the activations' own rounding
    else:
        assert torch.equal(got, plain)


CASES = {
    "group-quant-128": (_case_group_quant, dict(m=5, k=300, group=128)),
    "group-quant-32-many-programs": (_case_group_quant, dict(m=3, k=1000, group=32)),
    "gemm-one-row-partial-blocks": (_case_gemm, dict(m=1, n=70, k=300, block=(128, 128))),
    "gemm-partial-blocks": (_case_gemm, dict(m=5, n=200, k=300, block=(128, 128))),
    "gemm-row-blocks": (_case_gemm, dict(m=33, n=130, k=257, block=(1, 128))),
    "gemm-block32": (_case_gemm, dict(m=20, n=96, k=100, block=(32, 32))),
    "gemm-bias-fp16": (_case_gemm, dict(m=3, n=48, k=64, block=(16, 16),
                                        out_dtype=torch.float16, bias=True)),
    # several row tiles walked GROUP_M = 2 at a time, a partial group at the end
    "gemm-grouped-tile-order": (_case_gemm, dict(m=70, n=150, k=260, block=(128, 128),
                                                 config=(16, 32, 2, 4, 2))),
    "gemm-no-rows": (_case_gemm_no_rows, {}),
    "layer-kernel-product": (_case_layer_kernel_product, dict(n=200, k=300, block=(128, 128),
                                                              bias=True)),
    "layer-kernel-product-row-blocks": (_case_layer_kernel_product, dict(
        n=70, k=100, block=(1, 32), bias=False)),
    "model-weight-only-rows": (_case_model, dict(prompt_len=2)),
    "model-one-row-more-w8a8": (_case_model, dict(prompt_len=3)),
}


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels import fp8_block_gemm
    assert isinstance(fp8_block_gemm._block_gemm_kernel, InterpretedFunction), \
        "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_fp8_block_kernel_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    _worker()


def _compile_for_h200(config, has_bias: bool) -> str:
    """The GEMM compiled ahead of time for sm_90 (the H200); ptxas' resource line for it."""
    from backend.core.kernels import fp8_block_gemm
    pointers = {"A": "*fp8e4nv", "AScale": "*fp32", "B": "*fp8e4nv", "BScale": "*fp32",
                "Bias": "*bf16", "C": "*bf16"}
    ints = dict.fromkeys(["M", "N", "K", "stride_am", "stride_asm", "stride_bn",
                          "stride_bsn", "stride_cm"], "i32")
    consts = dict(SCALE_ROWS=128, HAS_BIAS=has_bias, BLOCK_M=config.block_m,
                  BLOCK_N=config.block_n, BLOCK_K=128, GROUP_M=config.group_m)
    signature = {**pointers, **ints, **dict.fromkeys(consts, "constexpr")}
    aligned = list(pointers) + ["N", "K", "stride_am", "stride_bn", "stride_cm"]
    compiled = compile_for_h200(fp8_block_gemm._block_gemm_kernel, signature, consts, aligned,
                                num_warps=config.num_warps, num_stages=config.num_stages)
    assert "wgmma" in compiled.ptx or "mma.sync" in compiled.ptx
    return compiled.resources


@pytest.mark.parametrize("m, n", [(3, 6144), (32, 4096), (128, 28672), (1024, 4096)])
def test_the_default_tiles_compile_for_the_h200_without_spilling_registers(m, n):
    """The interpreter cannot tell whether the GPU compiler takes the float8 GEMM: the
    8B shapes' default tiles at decode and prefill batch sizes compile for sm_90 and keep
    everything in registers (no local memory)."""
    from backend.core.kernels.fp8_block_gemm import default_config
    usage = _compile_for_h200(default_config(m, n), has_bias=False)
    assert "LOCAL:0 " in usage, usage
