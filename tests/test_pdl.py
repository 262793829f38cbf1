"""Programmatic dependent launch (backend/core/kernels/pdl.py): a kernel launched with it
may run while the kernel before it still writes, so in the code compiled for sm_90 the
wait for that kernel must come before every read of an activation and every write; only
weights (which no kernel writes) may be requested before it. Off the GPU, and below
sm_90, nothing is launched that way. The interpreter cannot run the wait, so these
tests read the PTX that Triton's sm_90 compiler makes (tests/sm90_compile.py); the
GPU check of the same bits with and without it is in docs/benchmarks/fp8.md."""
from __future__ import annotations

import re

import pytest
import torch

from sm90_compile import compile_for_h200


def test_nothing_is_launched_early_off_the_gpu():
    from backend.core.kernels import pdl
    assert pdl.dependent_launch(torch.device("cpu")) is False
    assert pdl.dependent_launch("cpu") is False


def _before_and_after_wait(ptx: str) -> tuple[str, str]:
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") > wait, \
        "the next kernel may only start once this one has waited"
    return ptx[:wait], ptx[wait:]


def _gemv_ptx(k: int, pdl: bool) -> str:
    from backend.core.kernels import gemv
    block_n, block_k, warps = gemv._config(4096, k)
    pointers = {"X": "*bf16", "Res": "*bf16", "NormW": "*bf16", "W": "*bf16",
                "Bias": "*bf16", "Out": "*bf16", "ResOut": "*bf16"}
    consts = dict(PROLOGUE=2, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl)
    signature = {**pointers, "N": "i32", "K": "i32", "stride_wn": "i32", "eps": "fp32",
                 **dict.fromkeys(consts, "constexpr")}
    return compile_for_h200(gemv._gemv_kernel, signature, consts,
                            list(pointers) + ["N", "K", "stride_wn"], num_warps=warps,
                            launch_pdl=pdl).ptx


@pytest.mark.parametrize("k", [4096, 14336])
def test_the_bf16_matrix_vector_product_reads_only_its_weights_before_the_wait(k):
    """K is a run-time argument, so the kernel holds both paths, each with its wait.
    Whole rows: the weight tile's own 16-byte loads are issued before the wait and
    nothing else (an input load moved up would add to them). Chunks (the branch taken
    when K is wider than the tile): only L2 prefetches of the first chunk. The input
    row, the norm's residual write and the outputs come after the waits."""
    from backend.core.kernels import gemv
    plain = _gemv_ptx(k, pdl=False)
    assert "griddepcontrol" not in plain and "prefetch.global.L2" not in plain
    ptx = _gemv_ptx(k, pdl=True)
    assert ptx.count("griddepcontrol.wait") == 2
    whole_row, _ = _before_and_after_wait(ptx)
    block_n, block_k, warps = gemv._config(4096, k)
    tile_loads = block_n * block_k // (32 * warps * 8)  # bf16: 8 weights a 16-byte load
    assert len(re.findall(r"ld\.global", whole_row)) == tile_loads
    assert len(re.findall(r"ld\.global\.v4", whole_row)) == tile_loads
    assert "st.global" not in whole_row and "prefetch" not in whole_row
    chunked_label = re.search(r"@%p\d+ bra\s+(\$L__BB\d+_\d+);", ptx).group(1)
    chunked = ptx[ptx.index(chunked_label + ":"):]
    before, after = _before_and_after_wait(chunked)
    assert "ld.global" not in before and "st.global" not in before
    assert "prefetch.global.L2" in before
    assert "ld.global" in after and "st.global" in after


def _stage_ptx(stage: int, pdl: bool, prefix_splits: int = 0) -> str:
    """PTX of a decode stage (``prefix_splits`` > 0: its cascade form)."""
    from backend.core.kernels import decode_stages
    if stage == 1:
        pointers = {"Q": "*bf16", "O": "*bf16", "KBuf": "*bf16", "VBuf": "*bf16",
                    "ReqToToken": "*i32", "ReqPoolIdx": "*i64", "SeqLens": "*i64",
                    "PrefixLen": "*i64", "WorkAcc": "*fp32", "WorkLse": "*fp32",
                    "Pos": "*i64", "Cos": "*fp32", "Sin": "*fp32", "KNew": "*bf16",
                    "VNew": "*bf16", "Loc": "*i64", "KScale": "*fp32", "VScale": "*fp32"}
        scalars = {"sm_scale": "fp32", "softcap": "fp32", "min_split_len": "i32",
                   **dict.fromkeys(["stride_qb", "stride_qh", "stride_ob", "stride_oh",
                                    "stride_kbs", "stride_kbh", "stride_vbs", "stride_vbh",
                                    "stride_rt", "stride_cos", "stride_sin", "stride_knb",
                                    "stride_knh", "stride_vnb", "stride_vnh"], "i32")}
        consts = dict(GROUP=4, NUM_HEADS=32, HEAD_DIM=128, NUM_SPLITS=8, BLOCK_G=16,
                      BLOCK_N=64, BLOCK_D=128, DOT_PRECISION="tf32", ROPE=True, WINDOW=0,
                      SOFTCAP=False, KV_FP8=False, PDL=pdl, PREFIX_SPLITS=prefix_splits)
        kernel, warps = decode_stages._decode_stage1, 4
    else:
        pointers = {"WorkAcc": "*fp32", "WorkLse": "*fp32", "O": "*bf16", "SeqLens": "*i64",
                    "PrefixLen": "*i64"}
        scalars = {"min_split_len": "i32", "stride_ob": "i32", "stride_oh": "i32"}
        consts = dict(NUM_HEADS=32, HEAD_DIM=128, NUM_SPLITS=8,
                      BLOCK_S=16 if prefix_splits else 8, BLOCK_N=64,
                      BLOCK_D=128, WINDOW=0, PDL=pdl, PREFIX_SPLITS=prefix_splits)
        kernel, warps = decode_stages._decode_stage2, 4
    signature = {**pointers, **scalars, **dict.fromkeys(consts, "constexpr")}
    return compile_for_h200(kernel, signature, consts, list(pointers), num_warps=warps,
                            launch_pdl=pdl).ptx


@pytest.mark.parametrize("prefix_splits", [0, 8])
@pytest.mark.parametrize("stage", [1, 2])
def test_the_decode_attention_stages_wait_before_anything_else(stage, prefix_splits):
    """Stage 1 reads q and the new K/V that the QKV projection just wrote (and writes
    the pool), stage 2 reads stage 1's splits (and, cascaded, the prefix kernel's): with
    the attribute, both wait before their first load or store, and let the next kernel
    start only after that."""
    plain = _stage_ptx(stage, pdl=False, prefix_splits=prefix_splits)
    assert "griddepcontrol" not in plain
    before, after = _before_and_after_wait(_stage_ptx(stage, pdl=True,
                                                      prefix_splits=prefix_splits))
    assert "ld.global" not in before and "st.global" not in before
    assert "ld.global" in after and "st.global" in after
