"""The extend kernel (kernels/extend_attention.py) as Triton's sm_90 compiler builds it,
without a GPU (tests/sm90_compile.py): the tiles ``extend_tiles`` picks for the 8B
shape's short extends keep the query and accumulator tiles in registers up to a small
spill (64 bytes a thread in bf16, none over a float8 pool; the one-head-a-program kernel
this replaced spilled 352 and 272), a group of 7 padded to 8 heads stays as small, and
both dots run on the tensor cores."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton.backends.nvidia")
from sm90_compile import compile_for_h200  # noqa: E402


def _extend(length, fp8=False, group=4, window=0, softcap=False):
    from backend.core.kernels import extend_tiles
    from backend.core.kernels.extend_attention import _extend_attn_kernel as kernel
    tiles = extend_tiles(torch.bfloat16, 128, group, length)
    kv = "*fp8e4nv" if fp8 else "*bf16"
    pointers = {"Q": "*bf16", "O": "*bf16", "KBuf": kv, "VBuf": kv, "ReqToToken": "*i32",
                "ReqPoolIdx": "*i64", "SeqLens": "*i64", "PrefixLens": "*i64",
                "QoIndptr": "*i64", "KScale": "*fp32", "VScale": "*fp32"}
    scalars = {"sm_scale": "fp32", "softcap": "fp32", **dict.fromkeys(
        ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kbs", "stride_kbh",
         "stride_vbs", "stride_vbh", "stride_rt"], "i32")}
    consts = dict(GROUP=group, HEADS=tiles.heads, HEAD_DIM=128, BLOCK_M=tiles.block_m,
                  BLOCK_N=tiles.block_n, BLOCK_D=128, DOT_PRECISION="tf32", WINDOW=window,
                  SOFTCAP=softcap, KV_FP8=fp8)
    signature = {**pointers, **scalars, **dict.fromkeys(consts, "constexpr")}
    assert list(signature) == list(kernel.arg_names)
    return compile_for_h200(kernel, signature, consts, list(pointers),
                            num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _stack_bytes(compiled) -> int:
    stack = re.search(r"STACK:(\d+)", compiled.resources)
    assert stack, compiled.resources
    return int(stack.group(1))


# (variant, stack bytes a thread at most): a 32-token question takes 128 rows of 4 heads;
# a long extend 64 tokens x 2 heads, which spills more (like the one-head kernel it
# replaced) and still ran 4-6% faster than 4 heads on 2,048- and 256-token prefills
# (H100, docs/benchmarks/profiles.md)
@pytest.mark.parametrize("variant, most", [
    (dict(length=32), 64), (dict(length=32, fp8=True), 0), (dict(length=32, softcap=True), 64),
    (dict(length=5), 64), (dict(length=32, group=7), 96),
    (dict(length=1024), 400), (dict(length=1024, fp8=True), 256)])
def test_the_extend_kernel_keeps_its_tiles_in_registers_up_to_a_small_spill(variant, most):
    compiled = _extend(**variant)
    assert _stack_bytes(compiled) <= most, compiled.resources
    assert re.search(r"\b(mma|wgmma)\.", compiled.ptx), "the dots must use the tensor cores"
