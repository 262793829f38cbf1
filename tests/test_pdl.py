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
import triton
import triton.language as tl

from backend.core.kernels.pdl import prefetch_to_l2
from sm90_compile import compile_for_h200


def test_nothing_is_launched_early_off_the_gpu():
    from backend.core.kernels import pdl
    for family in pdl.FAMILIES:
        assert pdl.dependent_launch(torch.device("cpu"), family) is False
        assert pdl.dependent_launch("cpu", family) is False


def test_by_default_the_batched_rows_kernels_launch_early_and_the_batch_1_chain_does_not(monkeypatch):
    # an H200 ran the 8B bf16 batch-1 row 10% slower with the matrix-vector products and
    # the attention stages launched early; an H100 ran the 32-row step 3.2% faster with
    # the bf16 norms and SiLU-and-mul launched early between the few-row GEMMs (pdl.py)
    from backend.core.kernels import pdl
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.enabled_families() == {pdl.FEW_ROW_GEMM, pdl.NORM_ACTIVATION}
    monkeypatch.setenv(pdl.ENV, "  ")
    assert pdl.enabled_families() == {pdl.FEW_ROW_GEMM, pdl.NORM_ACTIVATION}
    # on an sm_90 device (stood in for: no GPU here), the launch follows the families
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    launch = pdl.dependent_launch.__wrapped__  # uncached: the environment changes here
    assert [launch("cuda", f) for f in pdl.FAMILIES] == [False, False, True, True]
    monkeypatch.setenv(pdl.ENV, "matrix-vector")
    assert [launch("cuda", f) for f in pdl.FAMILIES] == [True, False, False, False]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert launch("cuda", pdl.MATRIX_VECTOR) is False


@pytest.mark.parametrize("value, families", [
    ("all", {"matrix-vector", "decode-attention", "few-row-gemm", "norm-activation"}),
    ("none", set()),
    ("matrix-vector", {"matrix-vector"}),
    (" decode-attention , few-row-gemm,", {"decode-attention", "few-row-gemm"}),
])
def test_the_environment_names_the_families_that_launch_early(monkeypatch, value, families):
    from backend.core.kernels import pdl
    monkeypatch.setenv(pdl.ENV, value)
    assert pdl.enabled_families() == families


def test_an_unknown_family_is_refused_with_the_names_it_takes(monkeypatch):
    from backend.core.kernels import pdl
    monkeypatch.setenv(pdl.ENV, "gemv")
    with pytest.raises(ValueError, match="unknown \\['gemv'\\].*matrix-vector, decode-attention"):
        pdl.enabled_families()
    with pytest.raises(ValueError, match="unknown kernel family"):
        pdl.dependent_launch.__wrapped__("cpu", "gemv")


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



def _ptx(kernel, pointers: dict, scalars: dict, consts: dict, warps: int, pdl: bool,
         aligned: tuple[str, ...] = (), **options) -> str:
    """``kernel`` compiled for sm_90 with ``consts`` and PDL=pdl (launched early or not);
    the pointers and the ``aligned`` scalars 16-divisible, as the 8B shape's are."""
    consts = {**consts, "PDL": pdl}
    signature = {**pointers, **scalars, **dict.fromkeys(consts, "constexpr")}
    return compile_for_h200(kernel, signature, consts, list(pointers) + list(aligned),
                            num_warps=warps, launch_pdl=pdl, **options).ptx


@triton.jit
def _prefetch_only(W, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    prefetch_to_l2(W, rn, N, 0, K, stride_wn, BLOCK_N, BLOCK_K)


@pytest.mark.parametrize("dtype, block_n, block_k, warps, per_thread", [
    ("fp8e4nv", 64, 256, 4, 1),  # 64 rows x 2 lines = 128 addresses, 128 threads
    ("bf16", 64, 256, 4, 2),     # 64 rows x 4 lines
    ("fp8e4nv", 64, 512, 4, 2),  # 64 rows x 4 lines
    ("bf16", 64, 512, 4, 4),     # 64 rows x 8 lines
    ("bf16", 16, 32, 1, 1),      # half a line: still one address a row (16 for 32 threads)
])
def test_a_prefetched_chunk_is_asked_for_once_per_128_byte_line(dtype, block_n, block_k,
                                                                 warps, per_thread):
    """A line is 128 float8 or 64 bf16 columns: a chunk of BLOCK_K columns is
    max(BLOCK_K // line, 1) addresses a row, spread over the program's threads (each
    thread issues its share; a chunk with fewer addresses than threads repeats some)."""
    ptx = _ptx(_prefetch_only, {"W": "*" + dtype}, {"N": "i32", "K": "i32", "stride_wn": "i32"},
               dict(BLOCK_N=block_n, BLOCK_K=block_k), warps, pdl=False)
    assert ptx.count("prefetch.global.L2") == per_thread


def _small_gemm_ptx(block_m: int, even_k: bool, pdl: bool,
                    half: bool = False) -> tuple[str, object]:
    from backend.core.kernels import small_gemm
    t = (small_gemm.choose_half_tiles if half else small_gemm.choose_tiles)(block_m)
    op = "*bf16" if half else "*fp8e4nv"
    pointers = {"X": op, "XScale": "*fp32", "W": op, "WScale": "*fp32",
                "Bias": "*bf16", "Y": "*bf16"}
    scalars = dict.fromkeys(["M", "N", "K", "stride_x", "stride_w", "stride_y"], "i32")
    consts = dict(HAS_SCALES=not half, HAS_BIAS=True, EVEN_K=even_k, BLOCK_N=t.block_n, BLOCK_M=t.block_m,
                  BLOCK_K=t.block_k, STAGES=t.stages)
    return _ptx(small_gemm._small_gemm_kernel, pointers, scalars, consts, t.warps, pdl,
                ("K", "stride_x", "stride_w", "stride_y"), num_stages=t.stages), t


@pytest.mark.parametrize("block_m, even_k, half", [(32, True, False), (64, True, False),
                                                   (64, False, False), (32, True, True)])
def test_the_small_gemm_prefetches_its_weight_strip_then_waits(block_m, even_k, half):
    """The batched decode product (32 to 128 rows): before the wait only L2 prefetches of
    the STAGES - 1 weight chunks the pipeline copies first (BLOCK_K float8 or bf16
    columns: a 128-byte line is 128 or 64 of them, for each of BLOCK_N rows, over the
    program's threads); the activations, their scales and every write come after it."""
    plain, _ = _small_gemm_ptx(block_m, even_k, pdl=False, half=half)
    assert "griddepcontrol" not in plain and "prefetch.global.L2" not in plain
    ptx, t = _small_gemm_ptx(block_m, even_k, pdl=True, half=half)
    before, after = _before_and_after_wait(ptx)
    lines = (t.stages - 1) * t.block_n * (t.block_k // (64 if half else 128))
    assert before.count("prefetch.global.L2") == lines // (32 * t.warps) == 4
    assert "prefetch.global.L2" not in after
    for access in ("ld.global", "cp.async", "st.global", "ld.shared", "st.shared"):
        assert access not in before, access
    assert "cp.async" in after and "st.global" in after


def _rmsnorm_quant_ptx(residual: bool, pdl: bool) -> str:
    from backend.core.kernels import fp8_fused_quant
    pointers = {"X": "*bf16", "Res": "*bf16", "W": "*bf16", "ResOut": "*bf16",
                "Q": "*fp8e4nv", "S": "*fp32"}
    scalars = {**dict.fromkeys(["stride_x", "stride_r", "stride_ro", "stride_q", "N"], "i32"),
               "eps": "fp32", "fp8_max": "fp32", "min_scale": "fp32"}
    consts = dict(HAS_RESIDUAL=residual, BLOCK=4096)
    return _ptx(fp8_fused_quant._rmsnorm_quant_kernel, pointers, scalars, consts,
                fp8_fused_quant._norm_warps(4096), pdl, tuple(scalars)[:5])


@pytest.mark.parametrize("residual", [False, True])
def test_the_fused_norm_and_quant_reads_only_its_weight_before_the_wait(residual):
    """A 4096-wide bf16 row over 16 warps is one 16-byte load a thread per tensor: before
    the wait only the norm's weight (one load); x, the residual, the new residual's
    store and the float8 row come after it."""
    assert "griddepcontrol" not in _rmsnorm_quant_ptx(residual, pdl=False)
    before, after = _before_and_after_wait(_rmsnorm_quant_ptx(residual, pdl=True))
    assert len(re.findall(r"ld\.global", before)) == 1
    assert "st.global" not in before
    # and that load's address is the weight's pointer (argument 2) plus the column
    weight = re.search(r"ld\.param\.[bu]64\s+(%rd\d+), \[\w+_param_2\]", before).group(1)
    address = re.search(r"ld\.global\.v4\.b32\s+\{[^}]*\}, \[ ?(%rd\d+)", before).group(1)
    assert re.search(rf"add\.s64\s+{address}, {weight}, ", before)
    assert len(re.findall(r"ld\.global\.v4", after)) == (2 if residual else 1)
    assert "st.global" in after


def _quant_ptx(kernel_name: str, pdl: bool) -> str:
    from backend.core.kernels import fp8_fused_quant, fp8_quant
    scalars = {"fp8_max": "fp32", "min_scale": "fp32"}
    if kernel_name == "silu_mul_quant":
        pointers = {"GateUp": "*bf16", "Q": "*fp8e4nv", "S": "*fp32"}
        scalars = {**dict.fromkeys(["stride_g", "stride_q", "I"], "i32"), **scalars}
        kernel, block, warps = fp8_fused_quant._silu_mul_quant_kernel, 16384, 16
    else:
        pointers = {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32"}
        scalars = {**dict.fromkeys(["stride_x", "stride_q", "K"], "i32"), **scalars}
        kernel, block, warps = fp8_quant._per_token_quant_kernel, 4096, 4
    return _ptx(kernel, pointers, scalars, dict(BLOCK=block), warps, pdl, tuple(scalars)[:3])


@pytest.mark.parametrize("kernel_name", ["silu_mul_quant", "per_token_quant"])
def test_the_activation_quantizers_wait_before_anything_else(kernel_name):
    """SiLU-and-mul's and the attention output's quantization read only activations:
    with the attribute, both wait before their first load or store."""
    assert "griddepcontrol" not in _quant_ptx(kernel_name, pdl=False)
    before, after = _before_and_after_wait(_quant_ptx(kernel_name, pdl=True))
    assert "ld.global" not in before and "st.global" not in before
    assert "ld.global" in after and "st.global" in after


def _norm_activation_ptx(kernel_name: str, pdl: bool, residual: bool = False,
                         chunks: int = 1) -> str:
    from backend.core.kernels import fused
    if kernel_name == "silu_and_mul":
        pointers = {"GateUp": "*bf16", "Out": "*bf16"}
        scalars = dict.fromkeys(["stride_g", "stride_o", "I"], "i32")
        return _ptx(fused._silu_and_mul_kernel, pointers, scalars, dict(BLOCK=512), 4, pdl,
                    tuple(scalars))
    pointers = {"X": "*bf16", "Res": "*bf16", "W": "*bf16", "Out": "*bf16", "ResOut": "*bf16"}
    scalars = {**dict.fromkeys(["stride_x", "stride_r", "stride_o", "stride_ro", "N"], "i32"),
               "eps": "fp32"}
    consts = dict(HAS_RESIDUAL=residual, BLOCK=4096, NUM_CHUNKS=chunks, UNIT_OFFSET=False)
    return _ptx(fused._rmsnorm_kernel, pointers, scalars, consts, 16, pdl, tuple(scalars)[:5])


@pytest.mark.parametrize("kernel_name, shape", [
    ("rmsnorm", dict(residual=False)),
    ("rmsnorm", dict(residual=True)),
    ("rmsnorm", dict(residual=True, chunks=2)),  # a row wider than one block
    ("silu_and_mul", {}),
])
def test_the_half_precision_norm_and_silu_wait_before_anything_else(kernel_name, shape):
    """The bf16 decode step's RMSNorm (with and without the residual add) and
    SiLU-and-mul read only activations and the norm's weight: with the attribute, every
    load and store comes after the wait."""
    assert "griddepcontrol" not in _norm_activation_ptx(kernel_name, False, **shape)
    before, after = _before_and_after_wait(_norm_activation_ptx(kernel_name, True, **shape))
    assert "ld.global" not in before and "st.global" not in before
    assert "ld.global" in after and "st.global" in after
