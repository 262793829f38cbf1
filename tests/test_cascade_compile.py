"""The cascade prefix kernel (kernels/decode_prefix.py) as Triton's sm_90 compiler builds
it, without a GPU (tests/sm90_compile.py): the tiles ``prefix_tiles`` picks for the 8B
shape fit in registers (no spill to local memory), the scores and the value sum run on
the tensor cores, and with dependent launch (pdl.py) nothing is read or written before
the wait for the previous kernel. The stages' cascade forms are in test_pdl.py."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton.backends.nvidia")
from sm90_compile import compile_for_h200  # noqa: E402


def _prefix(pdl=False, rope=False, fp8=False, softcap=False, group=4):
    from backend.core.kernels import decode_prefix
    from backend.core.kernels.decode_attention import prefix_tiles
    kv = "*fp8e4nv" if fp8 else "*bf16"
    tiles = prefix_tiles(torch.bfloat16, 128, group)
    pointers = {"Q": "*bf16", "KBuf": kv, "VBuf": kv, "ReqToToken": "*i32",
                "ReqPoolIdx": "*i64", "SeqLens": "*i64", "PrefixLen": "*i64",
                "WorkAcc": "*fp32", "WorkLse": "*fp32", "Pos": "*i64", "Cos": "*fp32",
                "Sin": "*fp32", "KScale": "*fp32", "VScale": "*fp32"}
    scalars = {"sm_scale": "fp32", "softcap": "fp32", "batch": "i32",
               **dict.fromkeys(["stride_qb", "stride_qh", "stride_kbs", "stride_kbh",
                                "stride_vbs", "stride_vbh", "stride_rt", "stride_cos",
                                "stride_sin"], "i32")}
    consts = dict(GROUP=group, NUM_HEADS=8 * group, HEAD_DIM=128, NUM_SPLITS=8,
                  PREFIX_SPLITS=8, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                  BLOCK_D=128, DOT_PRECISION="tf32", ROPE=rope, SOFTCAP=softcap,
                  KV_FP8=fp8, PDL=pdl)
    signature = {**pointers, **scalars, **dict.fromkeys(consts, "constexpr")}
    return compile_for_h200(decode_prefix._decode_prefix, signature, consts, list(pointers),
                            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                            launch_pdl=pdl)


def test_the_8b_tiles_are_64_query_rows_over_64_positions_with_8_warps():
    from backend.core.kernels.decode_attention import prefix_tiles
    assert prefix_tiles(torch.bfloat16, 128, 4) == (64, 64, 8, 2)
    assert prefix_tiles(torch.float32, 64, 2) == (64, 32, 4, 2)  # the interpreter tests'


@pytest.mark.parametrize("variant", [dict(), dict(rope=True), dict(fp8=True),
                                     dict(softcap=True), dict(rope=True, fp8=True, group=7)])
def test_the_prefix_kernel_keeps_its_tiles_in_registers_and_uses_the_tensor_cores(variant):
    compiled = _prefix(**variant)
    local = re.search(r"LOCAL:(\d+)", compiled.resources)
    assert local and local.group(1) == "0", compiled.resources
    assert re.search(r"\b(mma|wgmma)\.", compiled.ptx), "the dots must use the tensor cores"


@pytest.mark.parametrize("rope", [False, True])
def test_the_prefix_kernel_waits_for_the_previous_kernel_before_anything_else(rope):
    """It reads q (the QKV projection's, just written) and writes the workspace that the
    previous layer's stage 2 may still be reading: under dependent launch, every load
    and store comes after the wait, and the next kernel starts only after it."""
    assert "griddepcontrol" not in _prefix(pdl=False, rope=rope).ptx
    ptx = _prefix(pdl=True, rope=rope).ptx
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") > wait
    assert "ld.global" not in ptx[:wait] and "st.global" not in ptx[:wait]
    assert "ld.global" in ptx[wait:] and "st.global" in ptx[wait:]
