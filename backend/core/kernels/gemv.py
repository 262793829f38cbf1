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

for ``M <= MAX_ROWS`` rows; each rounds to the model dtype exactly where the separate
torch ops do (the norm's cast before its weight multiply, silu's result before the
multiply), accumulating the dot products in float32 like cuBLAS. Weights are the
``nn.Linear`` layout [N, K], unit stride on K.

One program computes BLOCK_N outputs of every row: it walks K in BLOCK_K chunks, loading
a [BLOCK_N, BLOCK_K] weight tile once and applying it to all M input rows, so the weights
are read once per step whatever M is (up to MAX_ROWS).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # more rows: a tensor-core GEMM reads the weights just as once and wins

_NONE, _NORM, _ADD_NORM, _SILU_MUL = 0, 1, 2, 3


@triton.jit
def _prologue_chunk(X, Res, NormW, rm, kk, mask2, rstd, stride_xm, stride_rm, K,
                    PROLOGUE: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] input chunk at columns kk, after the prologue, as float32
    holding model-dtype values."""
    dtype = X.dtype.element_ty
    x_ptr = X + rm[:, None] * stride_xm + kk[None, :]
    if PROLOGUE == 3:  # silu(gate) * up; gate is [:, :K], up is [:, K:2K]
        g = tl.load(x_ptr, mask=mask2, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K, mask=mask2, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (s * u).to(dtype).to(tl.float32)
    x = tl.load(x_ptr, mask=mask2, other=0.0)
    if PROLOGUE == 0:
        return x.to(tl.float32)
    if PROLOGUE == 2:
        r = tl.load(Res + rm[:, None] * stride_rm + kk[None, :], mask=mask2, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
    y = (x.to(tl.float32) * rstd[:, None]).to(dtype)  # RMSNorm's cast before the weight
    nw = tl.load(NormW + kk, mask=kk < K, other=0.0).to(tl.float32)
    return (nw[None, :] * y.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _gemv_kernel(
    X, Res, NormW, W, Bias, Out, ResOut,
    M, N, K, stride_xm, stride_rm, stride_wn, stride_om, stride_rom, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        # pass 1: the row's sum of squares (after the residual add, which program 0
        # also writes out as the new residual stream)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mask2 = mmask[:, None] & (kk < K)[None, :]
            x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=mask2, other=0.0)
            if PROLOGUE == 2:
                r = tl.load(Res + rm[:, None] * stride_rm + kk[None, :], mask=mask2, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                first = (rm * 0 + pid) == 0  # program 0 writes the new residual
                tl.store(ResOut + rm[:, None] * stride_rom + kk[None, :], x,
                         mask=mask2 & first[:, None])
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        x = _prologue_chunk(X, Res, NormW, rm, kk, mmask[:, None] & kmask[None, :], rstd,
                            stride_xm, stride_rm, K, PROLOGUE)
        w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rm[:, None] * stride_om + rn[None, :], acc.to(Out.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an M x K by K x N product.

    Enough programs to cover the SMs a few times over even for N = 2048 (o_proj of a 1B
    model), tiles of 8 KB to 16 KB of weights, and the [BLOCK_M, BLOCK_N, BLOCK_K]
    float32 product kept near 64 registers per thread.
    """
    block_m = triton.next_power_of_2(m)
    block_k = min(512, triton.next_power_of_2(k))
    block_n = 16 if n >= 8192 else 8
    block_n = max(2, block_n // block_m)
    warps = 4
    return block_n, block_k, warps


def _launch(prologue, x, weight, bias, res=None, norm_weight=None, eps=0.0, res_out=None,
            config=None):
    m = x.shape[0]
    n, k = weight.shape
    assert 0 < m <= MAX_ROWS, f"{m} rows: the fused products take 1..{MAX_ROWS}"
    assert weight.stride(1) == 1 and x.stride(-1) == 1, "K must be contiguous"
    assert weight.dtype == x.dtype, "activations and weights must share a dtype"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or _config(m, n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, res if res is not None else x, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, out, res_out if res_out is not None else x,
        m, n, k, x.stride(0), res.stride(0) if res is not None else 0, weight.stride(0),
        out.stride(0), res_out.stride(0) if res_out is not None else 0, float(eps),
        PROLOGUE=prologue, HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K], M <= MAX_ROWS."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1]
    return _launch(_NONE, x, weight, bias, config=config)


def rmsnorm_linear_rows(x: torch.Tensor, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                        bias: torch.Tensor | None = None, config=None):
    """``RMSNorm`` (layers/basic.py) then ``F.linear``, in one launch.

    Without ``residual``: returns ``(linear(norm(x)), x)``. With it: ``s = x + residual``
    and returns ``(linear(norm(s)), s)``, ``s`` in a new tensor. x, residual: [M, K]
    with unit stride on K; norm_weight [K] in x's dtype.
    """
    assert x.dim() == 2 and x.shape[1] == weight.shape[1] == norm_weight.shape[0]
    assert norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
    if residual is None:
        return _launch(_NORM, x, weight, bias, norm_weight=norm_weight, eps=eps,
                       config=config), x
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    res_out = torch.empty_like(x)
    out = _launch(_ADD_NORM, x, weight, bias, res=residual, norm_weight=norm_weight, eps=eps,
                  res_out=res_out, config=config)
    return out, res_out


def silu_mul_linear_rows(gate_up: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, weight, bias)`` for gate_up [M, 2K] = [gate | up]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] == 2 * weight.shape[1]
    return _launch(_SILU_MUL, gate_up, weight, bias, config=config)
