"""Tile sizes and the split of K for the FP8 matrix-vector kernels (``fp8_gemv.py``).

The default (``choose_tiles``) is one K slice a program, whole rows of K up to 4096
columns, no chunk requested ahead: timed on the GPU, it beats the split-K tiling below
on every projection of the 8B shape at one and two rows. The split-K tiling
(``split_k_tiles``) stays as the sweep's alternative; what follows is its reasoning,
which the timings did not bear out (the chunks' pipelining and the slices' reduction
cost more than the fuller rounds of programs gain).

A decode step's projection is bound by its weight bytes only while every SM keeps
enough loads in flight until the last byte arrives. Two things break that:

* too few programs: with one program per BLOCK_N outputs, N = 4096 gives 512 programs
  of 32 KB, about two rounds of the 132 SMs' resident programs, each round requesting
  its tiles at once, waiting for them, then computing while the bus idles;
* a long serial K loop (14336 columns for the 8B down projection) that waits for each
  chunk before requesting the next.

So every program streams its part of K in chunks of BLOCK_N x BLOCK_K, two chunks ahead
through shared memory (async copies: the chunks in flight take no registers, so about
100 registers a thread at one row and 4-5 programs an SM, each with 32 KB requested);
and where the tiles of BLOCK_N outputs leave resident slots unused, K is split:
``split`` programs share each tile, one K slice each, and the slices' float32 partial
sums are added in a fixed order by the last program to finish (``fp8_gemv.py`` says
how). Large grids (the gate/up projection's 3584 programs at one row) keep one whole
row a program, which reaches 87% of the bandwidth.

The input prologue sets the chunk's shape. A thread holds 16-column strips of the
chunk (16-byte loads) and computes the prologue (the norm's 10-15 instructions an input,
SiLU's about 20, against about 8 a weight that an H200 SM can issue at 4.2 TB/s) once
per strip it holds, whatever the rows of the strip: it costs ``16 * e / weights a
thread holds`` a weight and input row. 16 x 1024 chunks at 4 warps give 128 weights a
thread (e / 8) at one row; at two rows 8 warps (64 weights a thread, e / 4), since
the widened weights stay in registers for both rows (128 registers; 4 warps would take
about 220). From 3 rows (the tool's timings only) 8 x 1024
at 4 warps. Compiled for sm_90, the chunk loop issues 3.8 (o), 4.4 (qkv) and 5.5
(down) instructions a weight at one row, 6.2-7.9 at two.
``tools/gpu/check_fp8.py --parts gemv`` (without ``--no-sweep``) times these choices
against others.
"""
from __future__ import annotations

from typing import NamedTuple

import triton

H200_SMS = 132  # the SM count assumed off the GPU (interpreter tests take the H200's tiles)
# from this many programs an SM (8 x K tiles) the grid already streams well with whole
# rows (gate/up at 1 row: 27 programs an SM, 87% of the bandwidth)
WHOLE_ROW_PROGRAMS_PER_SM = 12
# programs of the chunked tiles resident on one SM (65536 registers, 228 KB of shared
# memory), by rows: 1: 94-113 registers a thread at 4 warps and 37-45 KB for the chunks
# in flight; 2: 104-128 registers at 8 warps (sm_90, as tests/test_fp8_gemv_tiles.py
# compiles them)
RESIDENT_PROGRAMS = {1: 4, 2: 2}


class GemvTiles(NamedTuple):
    """One launch's tiling: BLOCK_N outputs by BLOCK_K inputs a chunk, ``warps`` warps
    a program, K cut into ``split`` slices (one program each) per BLOCK_N outputs.
    ``stages - 1`` chunks are requested ahead through shared memory (async copies,
    Triton's pipelining; 1: each chunk waited for, as before split K). ``persist`` > 0
    (whole rows, one slice): ``persist`` programs an SM, each streaming several tiles
    (``fp8_gemv_stream.py``); 0: one program a tile."""
    block_n: int
    block_k: int
    warps: int
    split: int = 1
    stages: int = 1
    persist: int = 0  # > 0: whole rows, this many programs an SM walking the tiles


def choose_tiles(n: int, k: int, rows: int) -> GemvTiles:
    """The default tiles for an [N, K] float8 weight and ``rows`` input rows: whole
    rows of K a program where K <= 4096 (``elements`` float8 weights a program: 32768 at
    one row, 16384 from two), else 2048-column chunks; one K slice, no chunk ahead.

    Measured, not derived: on an H100 (and on the H200 before split K) these tiles beat
    the split-K rule (``split_k_tiles``) at one row by 1.0-2.3x a projection of the 8B
    shape and at two rows by 1.0-1.9x (``tools/gpu/check_fp8.py --parts gemv``, same
    call). They do not depend on the SM count (``split_k_tiles`` does)."""
    elements = 32768 if rows == 1 else 16384
    if k <= 4096:
        block_k = triton.next_power_of_2(k)
        block_n = max(1, min(16, elements // block_k))
        return GemvTiles(block_n, block_k, 8 if block_n * block_k >= 8192 else 4)
    return GemvTiles(elements // 4096, 2048, 8)


def split_k_tiles(n: int, k: int, rows: int, sms: int = H200_SMS) -> GemvTiles:
    """The split-K alternative the sweep times against ``choose_tiles``: the rule above
    this module's docstring describes (chunks streamed ahead, K split to fill one round
    of resident programs; whole rows for large grids at one row)."""
    if rows == 1 and triton.cdiv(n, 8) >= WHOLE_ROW_PROGRAMS_PER_SM * sms:
        # one 8 x K tile a program up to K = 4096 (else 8 x 2048 chunks), 8 warps
        return GemvTiles(8, min(triton.next_power_of_2(k), 4096 if k <= 4096 else 2048), 8)
    block_n, warps = {1: (16, 4), 2: (16, 8)}.get(rows, (8, 4))
    block_k = min(triton.next_power_of_2(k), 1024)
    return GemvTiles(block_n, block_k, warps, filling_split(n, k, block_n, block_k, rows, sms),
                     stages=3)


def filling_split(n: int, k: int, block_n: int, block_k: int, rows: int,
                  sms: int = H200_SMS) -> int:
    """As many K slices as keep every program resident at once (one round: all of them
    stream side by side and end together, where a partial second round would leave most
    SMs idle at the end), each slice at least two chunks."""
    tiles, chunks = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    slots = RESIDENT_PROGRAMS.get(rows, 2) * sms
    return max(1, min(slots // tiles, chunks // 2))


class KSlices(NamedTuple):
    """K cut for a launch: ``count`` slices of ``columns`` columns (the last shorter)."""
    columns: int
    count: int


def k_slice(k: int, tiles: GemvTiles) -> KSlices:
    """``split`` slices of whole chunks covering K, the last one shorter when K does not
    divide (never an empty slice, so ``count`` may be below ``split``)."""
    columns = triton.cdiv(triton.cdiv(k, tiles.split), tiles.block_k) * tiles.block_k
    return KSlices(columns, triton.cdiv(k, columns))
