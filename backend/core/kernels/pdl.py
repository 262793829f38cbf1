"""Programmatic dependent launch (sm_90 and later) for the decode chain.

A decode step at one row is a chain of short kernels, each of which reads what the one
before wrote; between two of them the GPU drains the first kernel's last programs (the
tail, with most SMs idle) and only then starts the next one's (the ramp, with no bytes
in flight yet). With programmatic dependent launch, a kernel launched with the
attribute may start as soon as every program of the kernel before it has signalled
(``gdc_launch_dependents``) or ended. Its programs then request what no kernel writes
(the layer's weights) and wait (``gdc_wait``) for the previous kernel to end and its
writes to become visible before they read an activation or write anything. The weight
stream of the next projection then covers the previous kernel's tail. A CUDA graph keeps
the launch attribute. A kernel launched normally after one with the attribute waits for
it in full, as before.

Able to launch this way on sm_90: the matrix-vector products (``gemv.py``, ``fp8_gemv.py``'s
one-program-a-tile kernel) and both decode attention stages; for the FP8 batched decode
rows, the few-row GEMM (``small_gemm.py``, which prefetches the chunks its pipeline
copies first) and the activation quantizers before it (``fp8_quant.per_token_quant``,
``fp8_fused_quant``'s RMSNorm, which reads its weight before the wait, and SiLU-and-mul);
for the bf16 batched rows, the RMSNorm and SiLU-and-mul kernels of ``fused.py`` that sit
between those GEMMs.
On an H100 the 8B shape's batch-1 step went 3.559 -> 3.490 ms with FP8 weights and
5.517 -> 5.468 ms in bf16; asking for every line of a bf16 chunk instead of every other
one left the bf16 step where it was (5.465 -> 5.460 ms, one machine). The batched FP8
launches took the 8B step at 32 rows from 4.602 to 4.304 ms and at 128 rows from 5.767
to 5.640 ms (docs/benchmarks/fp8.md).

On an H200 the batch-1 chain went the other way: the 8B bf16 batch-1 row of
``bench_engine.py`` fell from 241 to 217 tokens/s (4.14 -> 4.59 ms a step, repeated in
one machine) at the commit that launched the matrix-vector products and the attention
stages early, while its 32- and 128-row rows stayed within 0.6%. So each kernel family
launches early only where it is switched on (``enabled_families``): by default the
few-row GEMM and its quantizers, and the bf16 norm and activation kernels between the
few-row GEMMs (``norm-activation``), not the matrix-vector products or the attention
stages. On an H100 the norm and activation kernels launched early took the 8B bf16 step
at 32 rows from 6.505 to 6.297 ms and left it at 128 rows (7.762 -> 7.780 ms); the FP8
rows' norm and activation quantizers, which launch early with the few-row GEMM, are
the same kind of kernel. Not yet timed on an H200. ``RADIXLM_DEPENDENT_LAUNCH`` sets the families for a process (``all``, ``none`` or a
comma list of FAMILIES), to set them side by side on another GPU.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


# The kernel families that can launch early
MATRIX_VECTOR = "matrix-vector"  # gemv.py and fp8_gemv.py: the batch-1 products
DECODE_ATTENTION = "decode-attention"  # decode_attention.py's stages, at every batch size
FEW_ROW_GEMM = "few-row-gemm"  # small_gemm.py and the FP8 quantizers that feed it
NORM_ACTIVATION = "norm-activation"  # fused.py's RMSNorm and SiLU-and-mul (half precision)
FAMILIES = (MATRIX_VECTOR, DECODE_ATTENTION, FEW_ROW_GEMM, NORM_ACTIVATION)
DEFAULT_FAMILIES = frozenset({FEW_ROW_GEMM, NORM_ACTIVATION})
ENV = "RADIXLM_DEPENDENT_LAUNCH"


def enabled_families() -> frozenset[str]:
    """The families ``RADIXLM_DEPENDENT_LAUNCH`` switches on: ``all``, ``none``, or a
    comma list of FAMILIES; unset or empty, DEFAULT_FAMILIES."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return DEFAULT_FAMILIES
    if value in ("all", "none"):
        return frozenset(FAMILIES if value == "all" else ())
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    unknown = sorted(names - set(FAMILIES))
    if unknown:
        raise ValueError(f"{ENV}={value!r}: unknown {unknown}; "
                         f"expected all, none or a comma list of {', '.join(FAMILIES)}")
    return names


@functools.lru_cache(maxsize=None)
def dependent_launch(device: torch.device, family: str) -> bool:
    """Whether kernels of ``family`` on ``device`` use programmatic dependent launch: the
    family is switched on (``enabled_families``, read once a process), and the device is
    NVIDIA's with compute capability 9 or later (the ``griddepcontrol`` instructions need
    sm_90; a ROCm build also names its devices "cuda", with capabilities of its own)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}")
    device = torch.device(device)
    return (family in enabled_families() and device.type == "cuda"
            and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9)


@triton.jit
def await_previous_kernel():
    """Wait for the kernel before to end and its writes to be visible (every read of an
    activation, and every write, must come after this), then let the next kernel start
    its programs (it waits in the same way before it reads what this one writes)."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(W, rn, N, k_lo, k_hi, stride_wn, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Ask L2 for the chunk [k_lo, k_lo + BLOCK_K) of weight rows ``rn``: a hint with no
    result, so the chunk loop's first loads find it there. One address per 128-byte L2
    line, LINE = 1024 // bitwidth elements apart (128 for float8, 64 for bf16), so
    max(BLOCK_K // LINE, 1) of them a row; rows past N and columns past k_hi are clamped
    onto the last ones (a line asked twice costs an issue slot, nothing else). A chunk
    that does not start on a line boundary spans one line more than it is asked for; the
    loop's own loads bring that one."""
    LINE: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth
    LINES: tl.constexpr = BLOCK_K // LINE if BLOCK_K >= LINE else 1
    lines = tl.minimum(k_lo + tl.arange(0, LINES) * LINE, k_hi - 1)
    rows = tl.minimum(rn, N - 1).to(tl.int64) * stride_wn
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l",
                              [W + rows[:, None] + lines[None, :]], dtype=tl.int32,
                              is_pure=False, pack=1)
