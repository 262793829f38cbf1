"""The FP8 matrix-vector kernels' tiles (backend/core/kernels/fp8_gemv_tiles.py): the
rule's choices for the 8B projections and how it scales, the K slices it cuts, and
the default tiles compiled for the H200 (sm_90) without spilling registers, which the
interpreter (test_fp8_gemv.py) cannot tell."""
from __future__ import annotations

import pytest

from sm90_compile import compile_for_h200


def test_the_default_tiles_are_whole_rows_of_k_up_to_4096_one_slice_nothing_ahead():
    """What the GPU timed fastest for Llama-3.1-8B's projections: at one row 32768
    float8 weights a program (8 whole rows of 4096), at two 16384 (4 rows); K = 14336
    (down) in 2048-column chunks; never a split, never a chunk ahead."""
    from backend.core.kernels.fp8_gemv_tiles import GemvTiles, choose_tiles
    assert choose_tiles(6144, 4096, 1) == GemvTiles(8, 4096, 8, 1, 1)
    assert choose_tiles(4096, 4096, 1) == GemvTiles(8, 4096, 8)
    assert choose_tiles(28672, 4096, 1) == GemvTiles(8, 4096, 8)
    assert choose_tiles(4096, 14336, 1) == GemvTiles(8, 2048, 8)
    assert choose_tiles(6144, 4096, 2) == GemvTiles(4, 4096, 8)
    assert choose_tiles(4096, 14336, 2) == GemvTiles(4, 2048, 8)
    # narrow K: up to 16 rows a program, fewer warps below 8192 weights
    assert choose_tiles(576, 576, 1) == GemvTiles(16, 1024, 8)
    assert choose_tiles(100, 300, 2) == GemvTiles(16, 512, 8)
    assert choose_tiles(100, 200, 2) == GemvTiles(16, 256, 4)


def test_the_split_k_alternative_fills_one_round_of_resident_programs():
    """The sweep's split-K tiling for the 8B shape on an H200 (132 SMs, 4 resident
    programs an SM at one row, 2 at two): o and down at one row (256 tiles of 16
    outputs) split K in two, qkv (384 tiles) would overflow the 528 slots and does not;
    gate/up at one row (3584 tiles of 8) keeps a whole row a program; at two rows (264
    slots) nothing splits."""
    from backend.core.kernels.fp8_gemv_tiles import GemvTiles, k_slice, split_k_tiles
    assert split_k_tiles(4096, 4096, 1) == GemvTiles(16, 1024, 4, 2, stages=3)
    assert split_k_tiles(4096, 14336, 1) == GemvTiles(16, 1024, 4, 2, stages=3)
    assert k_slice(14336, split_k_tiles(4096, 14336, 1)) == (7168, 2)  # 7 chunks each
    assert split_k_tiles(6144, 4096, 1) == GemvTiles(16, 1024, 4, 1, stages=3)
    assert split_k_tiles(28672, 4096, 1) == GemvTiles(8, 4096, 8, 1)
    assert split_k_tiles(4096, 14336, 2) == GemvTiles(16, 1024, 8, 1, stages=3)
    assert split_k_tiles(28672, 4096, 2) == GemvTiles(16, 1024, 8, 1, stages=3)
    assert split_k_tiles(4096, 14336, 8) == GemvTiles(8, 1024, 4, 1, stages=3)


def test_fewer_outputs_or_more_sms_split_k_further_but_never_below_two_chunks():
    from backend.core.kernels.fp8_gemv_tiles import GemvTiles, split_k_tiles
    assert split_k_tiles(2048, 8192, 1) == GemvTiles(16, 1024, 4, 4, stages=3)  # 8 chunks
    assert split_k_tiles(2048, 8192, 2) == GemvTiles(16, 1024, 8, 2, stages=3)
    assert split_k_tiles(4096, 14336, 1, sms=264) == GemvTiles(16, 1024, 4, 4, stages=3)
    assert split_k_tiles(64, 2048, 1) == GemvTiles(16, 1024, 4, 1, stages=3)  # 2 chunks


@pytest.mark.parametrize("k", [1, 64, 600, 1000, 4097, 14336])
@pytest.mark.parametrize("split", [1, 2, 3, 5, 16])
def test_k_slices_are_whole_chunks_that_cover_k_and_none_is_empty(k, split):
    from backend.core.kernels.fp8_gemv_tiles import GemvTiles, k_slice
    per_slice, slices = k_slice(k, GemvTiles(8, 64, 4, split))
    assert per_slice % 64 == 0 and 1 <= slices <= split
    assert (slices - 1) * per_slice < k <= slices * per_slice


def _compile_for_h200(prologue, rows, tiles, block, k, pdl=False):
    """The kernel compiled ahead of time for sm_90 (the H200); ptxas' resource line for it."""
    import triton

    from backend.core.kernels import fp8_gemv
    from backend.core.kernels.fp8_gemv_tiles import k_slice
    pointers = {"X": "*bf16", "Res": "*bf16", "NormW": "*bf16", "W": "*fp8e4nv",
                "Scale": "*fp32", "Bias": "*bf16", "Out": "*bf16", "ResOut": "*bf16",
                "Partial": "*fp32", "Counts": "*i32"}
    ints = dict.fromkeys(["N", "K", "k_slice", "stride_x", "stride_r", "stride_wn",
                          "stride_sn", "scale_rows"], "i32")
    consts = dict(PROLOGUE=prologue, HAS_BIAS=False, SCALE_BLOCK=block, ROWS=rows,
                  ROWS_PAD=triton.next_power_of_2(rows), BLOCK_N=tiles.block_n,
                  BLOCK_K=tiles.block_k, SPLIT=k_slice(k, tiles).count,
                  WHOLE_ROW=tiles.block_k >= k, STAGES=tiles.stages,
                  NORM_BLOCK=min(triton.next_power_of_2(k), 4096), PDL=pdl)
    signature = {**pointers, **ints, "eps": "fp32", **dict.fromkeys(consts, "constexpr")}
    aligned = list(pointers) + ["N", "K", "k_slice", "stride_x", "stride_r", "stride_wn"]
    return compile_for_h200(fp8_gemv._fp8_gemv_kernel, signature, consts, aligned,
                            num_warps=tiles.warps, launch_pdl=pdl)


@pytest.mark.parametrize("prologue, rows, block, n, k", [
    (2, 1, 0, 6144, 4096), (2, 1, 0, 28672, 4096), (0, 1, 128, 4096, 4096),
    (3, 1, 0, 4096, 14336), (2, 2, 128, 6144, 4096), (2, 2, 0, 28672, 4096),
    (3, 2, 0, 4096, 14336), (3, 8, 0, 4096, 14336)])
def test_the_kernels_compile_for_the_h200_without_spilling_registers(prologue, rows, block,
                                                                      n, k):
    """The interpreter cannot tell whether the GPU compiler takes a kernel: the 8B
    shapes' default tiles (add-norm before qkv/gate_up, plain, SiLU before down; whole
    rows and 2048-column chunks) compile for sm_90 and keep everything in registers (no
    local memory)."""
    from backend.core.kernels.fp8_gemv_tiles import choose_tiles
    usage = _compile_for_h200(prologue, rows, choose_tiles(n, k, rows), block, k).resources
    assert "LOCAL:0 " in usage, usage


@pytest.mark.parametrize("prologue, n, k", [(2, 6144, 4096), (0, 4096, 4096), (3, 4096, 14336)])
def test_with_dependent_launch_only_weights_are_read_before_the_previous_kernel_ends(
        prologue, n, k):
    """Launched with programmatic dependent launch (pdl.py), a program may run while
    the kernel before it still writes: in the compiled code, the wait for that kernel
    comes before every load of an activation and every store, and after the weight
    requests it may overlap (whole rows: the tile itself; chunks: L2 prefetches of the
    first chunk). Without the attribute, none of the griddepcontrol instructions."""
    import re

    from backend.core.kernels.fp8_gemv_tiles import choose_tiles
    tiles = choose_tiles(n, k, 1)
    plain = _compile_for_h200(prologue, 1, tiles, 0, k).ptx
    assert "griddepcontrol" not in plain and "prefetch.global.L2" not in plain
    body = _compile_for_h200(prologue, 1, tiles, 0, k, pdl=True).ptx
    wait = body.index("griddepcontrol.wait")
    assert body.index("griddepcontrol.launch_dependents") > wait
    before = body[:wait]
    assert "st.global" not in before and "atom." not in before
    # before the wait: the whole-row tile's own 16-byte loads and nothing else (an
    # activation load moved up would add to them), or the first chunk's prefetches
    if tiles.block_k >= k:
        tile_loads = tiles.block_n * tiles.block_k // (32 * tiles.warps * 16)
        assert len(re.findall(r"ld\.global\.v4", before)) == tile_loads
        assert len(re.findall(r"ld\.global", before)) == tile_loads
    else:
        assert "prefetch.global.L2" in before and "ld.global" not in before
    assert len(re.findall(r"ld\.global", body[wait:])) >= 1


def test_the_interpreter_split_k_cases_do_split_k():
    """test_fp8_gemv.py's split-K-tile cases (N = 48, K = 4100) run the split and
    pipelined path only while that tiling splits them."""
    from backend.core.kernels.fp8_gemv_tiles import split_k_tiles
    for rows in (1, 2):
        tiles = split_k_tiles(48, 4100, rows)
        assert tiles.split == 2 and tiles.stages == 3 and tiles.block_k < 4100, tiles


def _compile_stream_for_h200(prologue, rows, tiles, block):
    """The streaming whole-row kernel (fp8_gemv_stream.py) compiled for sm_90."""
    import triton

    from backend.core.kernels import fp8_gemv_stream
    pointers = {"X": "*bf16", "Res": "*bf16", "NormW": "*bf16", "W": "*fp8e4nv",
                "Scale": "*fp32", "Bias": "*bf16", "Out": "*bf16", "ResOut": "*bf16"}
    ints = dict.fromkeys(["N", "K", "n_tiles", "stride_x", "stride_r", "stride_wn",
                          "stride_sn", "scale_rows"], "i32")
    consts = dict(PROLOGUE=prologue, HAS_BIAS=False, SCALE_BLOCK=block, ROWS=rows,
                  ROWS_PAD=triton.next_power_of_2(rows), BLOCK_N=tiles.block_n,
                  BLOCK_K=tiles.block_k, STAGES=tiles.stages)
    signature = {**pointers, **ints, "eps": "fp32", **dict.fromkeys(consts, "constexpr")}
    aligned = list(pointers) + ["N", "K", "stride_x", "stride_r", "stride_wn"]
    return compile_for_h200(fp8_gemv_stream._fp8_gemv_stream_kernel, signature, consts,
                            aligned, num_warps=tiles.warps).resources


@pytest.mark.parametrize("prologue, rows, tiles", [
    (2, 1, (4, 4096, 8, 1, 1, 4)), (0, 1, (8, 4096, 8, 1, 2, 2)),
    (3, 1, (2, 16384, 16, 1, 1, 1)), (2, 2, (4, 4096, 8, 1, 1, 4))])
def test_the_streaming_kernel_keeps_its_tiles_in_registers_and_few_of_them(prologue, rows,
                                                                           tiles):
    """A streaming program holds its input rows for all its tiles: at the 8B shapes'
    tiles it must neither spill nor take so many registers that fewer than two programs
    fit an SM (65536 registers) -- a float8 tile carried from one iteration to the next
    in registers took a register a byte (174 a thread), which is why the tile ahead goes
    through shared memory."""
    import re

    from backend.core.kernels.fp8_gemv_tiles import GemvTiles
    tiles = GemvTiles(*tiles)
    usage = _compile_stream_for_h200(prologue, rows, tiles, 0)
    assert "LOCAL:0 " in usage and "STACK:0 " in usage, usage
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    assert 2 * registers * 32 * tiles.warps <= 65536, usage
