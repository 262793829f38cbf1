"""The cascade prefix kernel (kernels/decode_prefix.py) as Triton's sm_90 compiler builds
it, without a GPU (tests/sm90_compile.py): the tiles ``prefix_tiles`` picks for the 8B
shape fit in registers (no spill to local memory), the scores and the value sum run on
the tensor cores, and with dependent launch (pdl.py) nothing is read or written before
the wait for the previous kernel. The same for the launch that runs the prefix programs
and stage 1's together (``_decode_prefix_stage1``), which also holds the prefix programs
on an SM as the prefix kernel alone does. The stages' cascade forms are in test_pdl.py."""
from __future__ import annotations

import re

import pytest
import torch
import triton

pytest.importorskip("triton.backends.nvidia")
from sm90_compile import compile_for_h200  # noqa: E402


_STRIDES = ["stride_qb", "stride_qh", "stride_kbs", "stride_kbh", "stride_vbs",
            "stride_vbh", "stride_rt", "stride_cos", "stride_sin"]
_NEW_KV_STRIDES = ["stride_knb", "stride_knh", "stride_vnb", "stride_vnh"]


def _pointers(fp8: bool, new_kv: bool) -> dict:
    kv = "*fp8e4nv" if fp8 else "*bf16"
    pointers = {"Q": "*bf16", "KBuf": kv, "VBuf": kv, "ReqToToken": "*i32",
                "ReqPoolIdx": "*i64", "SeqLens": "*i64", "PrefixLen": "*i64",
                "WorkAcc": "*fp32", "WorkLse": "*fp32", "Pos": "*i64", "Cos": "*fp32",
                "Sin": "*fp32"}
    if new_kv:
        pointers.update(KNew="*bf16", VNew="*bf16", Loc="*i64")
    return {**pointers, "KScale": "*fp32", "VScale": "*fp32"}


def _compile(kernel, pointers, scalars, consts, warps, stages, pdl):
    signature = {**pointers, **scalars, **dict.fromkeys(consts, "constexpr")}
    return compile_for_h200(kernel, signature, consts, list(pointers), num_warps=warps,
                            num_stages=stages, launch_pdl=pdl)


def _prefix(pdl=False, rope=False, fp8=False, softcap=False, group=4):
    from backend.core.kernels import decode_prefix
    from backend.core.kernels.decode_attention import prefix_tiles
    tiles = prefix_tiles(torch.bfloat16, 128, group)
    scalars = {"sm_scale": "fp32", "softcap": "fp32", "batch": "i32",
               **dict.fromkeys(_STRIDES, "i32")}
    consts = dict(GROUP=group, NUM_HEADS=8 * group, HEAD_DIM=128, NUM_SPLITS=8,
                  PREFIX_SPLITS=8, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                  BLOCK_D=128, DOT_PRECISION="tf32", ROPE=rope, SOFTCAP=softcap,
                  KV_FP8=fp8, PDL=pdl)
    return _compile(decode_prefix._decode_prefix, _pointers(fp8, new_kv=False), scalars,
                    consts, tiles.num_warps, tiles.num_stages, pdl)


def _fused(pdl=False, rope=False, fp8=False, softcap=False, group=4):
    """The prefix programs and stage 1's in one kernel, as ``decode_attention`` launches
    it for the 8B shape (8 kv heads, head_dim 128) cascaded."""
    from backend.core.kernels import decode_prefix
    from backend.core.kernels.decode_attention import decode_tiles, prefix_tiles
    pt, st = prefix_tiles(torch.bfloat16, 128, group), decode_tiles(torch.bfloat16, 128)
    scalars = {"sm_scale": "fp32", "softcap": "fp32", "min_split_len": "i32", "batch": "i32",
               **dict.fromkeys(_STRIDES + _NEW_KV_STRIDES, "i32")}
    consts = dict(GROUP=group, NUM_HEADS=8 * group, HEAD_DIM=128, NUM_SPLITS=8,
                  PREFIX_SPLITS=8, BLOCK_M=pt.block_m, PREFIX_BLOCK_N=pt.block_n,
                  BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=st.block_n,
                  BLOCK_D=128, DOT_PRECISION="tf32", ROPE=rope, SOFTCAP=softcap,
                  KV_FP8=fp8, PDL=pdl)
    return _compile(decode_prefix._decode_prefix_stage1, _pointers(fp8, new_kv=True),
                    scalars, consts, max(pt.num_warps, st.num_warps),
                    max(pt.num_stages, st.num_stages), pdl)


def _stage1(rope=False, fp8=False, softcap=False, group=4):
    """Stage 1 alone in its cascade form (the two-launch reference's second kernel)."""
    from backend.core.kernels import decode_stages
    from backend.core.kernels.decode_attention import decode_tiles
    st = decode_tiles(torch.bfloat16, 128)
    pointers = _pointers(fp8, new_kv=True)
    pointers = {"Q": pointers.pop("Q"), "O": "*bf16", **pointers}
    scalars = {"sm_scale": "fp32", "softcap": "fp32", "min_split_len": "i32",
               **dict.fromkeys(_STRIDES[:2] + ["stride_ob", "stride_oh"] + _STRIDES[2:]
                               + _NEW_KV_STRIDES, "i32")}
    consts = dict(GROUP=group, NUM_HEADS=8 * group, HEAD_DIM=128, NUM_SPLITS=8,
                  BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=st.block_n,
                  BLOCK_D=128, DOT_PRECISION="tf32", ROPE=rope, WINDOW=0, SOFTCAP=softcap,
                  KV_FP8=fp8, PDL=False, PREFIX_SPLITS=8)
    return _compile(decode_stages._decode_stage1, pointers, scalars, consts, st.num_warps,
                    st.num_stages, pdl=False)


def _resident(compiled) -> int:
    """Programs of a kernel one sm_90 SM holds at once: 64K registers (a warp's taken in
    units of 256), 228 KiB of shared memory (1 KiB reserved a program), 64 warps."""
    registers = compiled.num_warps * 32 * -(-compiled.registers // 8) * 8
    return min(65536 // registers, 228 * 1024 // (compiled.shared + 1024),
               64 // compiled.num_warps)


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


_VARIANTS = [dict(), dict(rope=True), dict(fp8=True), dict(softcap=True),
             dict(rope=True, fp8=True, group=7)]


@pytest.mark.parametrize("variant", _VARIANTS)
def test_the_fused_launch_keeps_its_tiles_in_registers_and_uses_the_tensor_cores(variant):
    compiled = _fused(**variant)
    local = re.search(r"LOCAL:(\d+)", compiled.resources)
    stack = re.search(r"STACK:(\d+)", compiled.resources)
    assert local and local.group(1) == "0" and stack.group(1) == "0", compiled.resources
    assert re.search(r"\b(mma|wgmma)\.", compiled.ptx), "the dots must use the tensor cores"


@pytest.mark.parametrize("rope", [False, True])
def test_the_fused_launch_waits_for_the_previous_kernel_before_anything_else(rope):
    """Both kinds of program read q (the QKV projection's) and write the workspace that
    the previous layer's stage 2 may still read; stage 1's also store the new K/V. One
    wait at the top, before either range's first load or store."""
    assert "griddepcontrol" not in _fused(pdl=False, rope=rope).ptx
    ptx = _fused(pdl=True, rope=rope).ptx
    assert ptx.count("griddepcontrol.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") > wait
    assert "ld.global" not in ptx[:wait] and "st.global" not in ptx[:wait]


@pytest.mark.parametrize("variant", _VARIANTS)
def test_the_fused_launch_holds_the_prefix_programs_on_an_sm_as_the_prefix_kernel_does(
        variant):
    """One kernel, one footprint: the prefix tile's 8 warps and shared memory (the larger
    of the two kernels', not their sum), registers enough for both bodies. The prefix
    programs keep their residency (1 an SM). Stage 1's take the same footprint: 1 an SM
    where stage 1 alone fits at least 2 of 4 warps (3 with rotary under Triton 3.9),
    the price of the one launch that the GPU timing (tools/gpu/bench_cascade.py) weighs."""
    fused, prefix, stage1 = _fused(**variant), _prefix(**variant), _stage1(**variant)
    assert (fused.num_warps, prefix.num_warps, stage1.num_warps) == (8, 8, 4)
    assert fused.shared == max(prefix.shared, stage1.shared)
    assert _resident(fused) == _resident(prefix) == 1
    assert _resident(stage1) >= 2
