"""Matrix-vector products for small decode batches, with the op before them fused in.

A batch-1 decode step of a 1B model reads ~2.5 GB of weights in about a millisecond, and
every kernel launch in between costs a microsecond or two of idle memory bus. Each
decoder layer runs, besides its four projections, an RMSNorm (+ residual add) before the
QKV and gate/up projections and a SiLU-and-mul before the down projection. Here those
elementwise ops become the prologue of the projection that consumes them: every program
recomputes the (tiny, L2-resident) input vector it needs while streaming its slice of
the weight matrix, so the normalised/activated vector is never written to memory and
never waits for a launch of its own.

``linear_rows(x, W, b)``                 ``x @ W.T + b``
``rmsnorm_linear_rows(x, r, w, eps, W)``  ``(RMSNorm(x + r) @ W.T, x + r)``
``silu_mul_linear_rows(gate_up, W)``       ``(silu(gate) * up) @ W.T``

for one row (batch-1 decode); each rounds to the model dtype exactly where the separate
torch ops do (the norm's cast before its weight multiply, silu's result before the
multiply), accumulating the dot products in float32 like cuBLAS. Weights are the
``nn.Linear`` layout [N, K], unit stride on K.

One program computes BLOCK_N outputs: it requests its [BLOCK_N, K] weight slice first
(one tile up to K = 4096, else BLOCK_K chunks) and computes the input row while those
loads are in flight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import await_previous_kernel, prefetch_to_l2

MAX_ROWS = 1  # batch-1 decode; wider batches take cuBLAS (see tools/check_gemv_gpu.py)

_NONE, _NORM, _ADD_NORM, _SILU_MUL = 0, 1, 2, 3


@triton.jit
def _input_chunk(X, Res, kk, kmask, K, PROLOGUE: tl.constexpr):
    """Columns kk of the input row before any normalisation, as float32 holding
    model-dtype values: x, x + residual (rounded), or silu(gate) * up (each rounded where
    torch rounds)."""
    dtype = X.dtype.element_ty
    if PROLOGUE == 3:  # gate is [:K], up is [K:2K]
        g = tl.load(X + kk, mask=kmask, other=0.0).to(tl.float32)
        u = tl.load(X + K + kk, mask=kmask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (s * u).to(dtype).to(tl.float32)
    x = tl.load(X + kk, mask=kmask, other=0.0)
    if PROLOGUE == 2:
        r = tl.load(Res + kk, mask=kmask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
    return x.to(tl.float32)


@triton.jit
def _normalise(x, NormW, kk, kmask, rstd, dtype):
    y = (x * rstd).to(dtype)  # RMSNorm's cast before the weight multiply
    nw = tl.load(NormW + kk, mask=kmask, other=0.0).to(tl.float32)
    return (nw * y.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _gemv_kernel(
    X, Res, NormW, W, Bias, Out, ResOut,
    N, K, stride_wn, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    dtype = X.dtype.element_ty
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    is_norm = PROLOGUE == 1 or PROLOGUE == 2
    if BLOCK_K >= K:
        # the whole row at once: the weight tile is requested first, so its loads are in
        # flight while the input row is read and normalised
        kmask = rk < K
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if PDL:  # launched early (pdl.py): only the weights are read before this
            await_previous_kernel()
        x = _input_chunk(X, Res, rk, kmask, K, PROLOGUE)
        if PROLOGUE == 2:
            tl.store(ResOut + rk, x.to(dtype), mask=kmask & ((rk * 0 + pid) == 0))
        if is_norm:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            x = _normalise(x, NormW, rk, kmask, rstd, dtype)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    else:
        if PDL:  # launched early (pdl.py): the first chunk goes to L2 meanwhile
            if BLOCK_K >= 128:
                prefetch_to_l2(W, rn, N, 0, K, stride_wn, BLOCK_N, BLOCK_K)
            await_previous_kernel()
        rstd = 0.0
        if is_norm:  # pass 1: the sum of squares (program 0 also writes the new residual)
            ss = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                kmask = kk < K
                x = _input_chunk(X, Res, kk, kmask, K, PROLOGUE)
                if PROLOGUE == 2:
                    tl.store(ResOut + kk, x.to(dtype), mask=kmask & ((kk * 0 + pid) == 0))
                ss += x * x
            rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            kmask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = _input_chunk(X, Res, kk, kmask, K, PROLOGUE)
            if is_norm:
                x = _normalise(x, NormW, kk, kmask, rstd, dtype)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=nmask, other=0.0).to(tl.float32)
    # rounded to the model dtype even for a float32 Out (what F.linear(...).float() gives)
    tl.store(Out + rn, acc.to(dtype).to(Out.dtype.element_ty), mask=nmask)


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep on an H200 (tools/check_gemv_gpu.py
    --sweep) over the projections of Llama-3.2-1B and Llama-3.1-8B: the whole row in one
    tile up to K = 4096, else about 512 programs with 16 KB weight tiles; 8 warps for the
    widest tiles and for the narrow (N <= 2048) matrices, whose few programs each need
    more loads in flight."""
    if k <= 4096:
        block_k = triton.next_power_of_2(k)
        return 4, block_k, 8 if block_k >= 4096 or n <= 2048 else 4
    block_n = min(8, max(2, triton.next_power_of_2(triton.cdiv(n, 512))))
    return block_n, 8192 // block_n, 8


def _launch(prologue, x, weight, bias, res=None, norm_weight=None, eps=0.0, res_out=None,
            config=None, out_dtype=None):
    n, k = weight.shape
    assert x.shape[0] == MAX_ROWS, f"{x.shape[0]} rows: the fused products take {MAX_ROWS}"
    assert weight.stride(1) == 1 and x.stride(-1) == 1, "K must be contiguous"
    assert weight.dtype == x.dtype, "activations and weights must share a dtype"
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k, warps = config or _config(n, k)
    early = pdl.dependent_launch(x.device, pdl.MATRIX_VECTOR)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, res if res is not None else x, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, out, res_out if res_out is not None else x,
        n, k, weight.stride(0), float(eps),
        PROLOGUE=prologue, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=early, num_warps=warps, launch_pdl=early,
    )
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config=None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [1, K]; ``out_dtype=torch.float32`` gives
    ``F.linear(...).float()`` (the logits) without a second kernel."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1]
    return _launch(_NONE, x, weight, bias, config=config, out_dtype=out_dtype)


def rmsnorm_linear_rows(x: torch.Tensor, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                        bias: torch.Tensor | None = None, config=None,
                        out_dtype: torch.dtype | None = None):
    """``RMSNorm`` (layers/basic.py) then ``F.linear`` (then cast to ``out_dtype``), in
    one launch.

    Without ``residual``: returns ``(linear(norm(x)), x)``. With it: ``s = x + residual``
    and returns ``(linear(norm(s)), s)``, ``s`` in a new tensor. x, residual: [1, K]
    with unit stride on K; norm_weight [K] in x's dtype.
    """
    assert x.dim() == 2 and x.shape[1] == weight.shape[1] == norm_weight.shape[0]
    assert norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
    if residual is None:
        return _launch(_NORM, x, weight, bias, norm_weight=norm_weight, eps=eps,
                       config=config, out_dtype=out_dtype), x
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    res_out = torch.empty_like(x)
    out = _launch(_ADD_NORM, x, weight, bias, res=residual, norm_weight=norm_weight, eps=eps,
                  res_out=res_out, config=config, out_dtype=out_dtype)
    return out, res_out


def silu_mul_linear_rows(gate_up: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, weight, bias)`` for gate_up [1, 2K] = [gate | up]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] == 2 * weight.shape[1]
    return _launch(_SILU_MUL, gate_up, weight, bias, config=config)
