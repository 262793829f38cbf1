"""Fused elementwise kernels for the decoder layer: RMSNorm (+ residual add), rotary
embedding and SwiGLU's silu-and-mul.

At small batch a decode step is launch-bound: the torch versions of these ops are ~7-10
tiny kernels each (casts, pow, mean, rsqrt, muls, gather, chunk, cat). Each function here
is one launch, allocates nothing when its outputs are given, and reads no value back to
the host, so it can sit inside a CUDA graph.

Numerics mirror the torch modules in ``layers/basic.py`` / ``layers/rotary.py`` op for
op, including where they round to the model dtype (RMSNorm casts the normalised row to
the input dtype *before* the weight multiply; ``F.silu(gate) * up`` rounds silu's result
before the multiply). Every intermediate is float32, which is also what torch's CUDA
kernels use for half types, so bf16/fp16 outputs differ from torch only where a float32
reduction order or an approximate exp/rsqrt tips a rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import await_previous_kernel
from .scales import check_kv_scales, saturate

# Widest row one RMSNorm program holds in registers; wider rows loop over chunks of this
# size (two passes: sum of squares, then normalise). 8192 covers Llama up to 70B (8192).
MAX_NORM_BLOCK = 8192


@triton.jit
def _rmsnorm_kernel(
    X, Res, W, Out, ResOut,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched early (pdl.py): x and the residual are the previous kernel's
        await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)  # 64-bit: rows * stride can pass 2**31
    cols = tl.arange(0, BLOCK)
    x_ptr, r_ptr = X + row * stride_x, Res + row * stride_r
    o_ptr, ro_ptr = Out + row * stride_o, ResOut + row * stride_ro
    if NUM_CHUNKS == 1:
        # Whole row in registers: one read of x/residual, one write of each output.
        mask = cols < N
        x = tl.load(x_ptr + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + cols, mask=mask, other=0.0)
            # torch's `x + residual` for half types adds in float32 and rounds once
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(ro_ptr + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(o_ptr + cols, _scaled(xf * rstd, w, X.dtype.element_ty, UNIT_OFFSET)
                 .to(Out.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < N
            x = tl.load(x_ptr + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + offs, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                tl.store(ro_ptr + offs, x, mask=mask)
            xf = x.to(tl.float32)
            acc += xf * xf
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        if HAS_RESIDUAL:
            # Pass 2 re-reads the sum from ResOut (the input residual may be the same
            # buffer and already overwritten); the barrier makes pass 1's stores visible
            # to every thread of the program.
            tl.debug_barrier()
            src = ro_ptr
        else:
            src = x_ptr
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < N
            x = tl.load(src + offs, mask=mask, other=0.0)
            w = tl.load(W + offs, mask=mask, other=0.0)
            tl.store(o_ptr + offs, _scaled(x.to(tl.float32) * rstd, w, X.dtype.element_ty,
                                           UNIT_OFFSET).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _scaled(normed, w, x_dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """The normalised float32 row times the scale, as the torch modules do it: Llama's
    RMSNorm rounds the row to the input dtype first (``weight * x.to(dtype)``); Gemma's
    multiplies by ``1 + weight`` in float32 and rounds once, afterwards."""
    if UNIT_OFFSET:
        return normed * (1.0 + w.to(tl.float32))
    return w.to(tl.float32) * normed.to(x_dtype).to(tl.float32)


def _as_rows(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    assert t.shape[-1] == n, f"{name}: last dim {t.shape[-1]} != {n}"
    assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
    return t if t.dim() == 2 else t.view(-1, n)  # view (never a copy): outputs must alias


def _launch_rmsnorm(x, residual, weight, eps, out, residual_out, unit_offset=False):
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), "weight must be contiguous [hidden]"
    # torch's `weight * x.to(dtype)`; Gemma's norm returns the input's dtype
    out_dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype, f"out must be {out_dtype}"
    x2, o2 = _as_rows(x, n, "x"), _as_rows(out, n, "out")
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        if residual_out is None:
            residual_out = torch.empty_like(x)
        assert residual_out.shape == x.shape and residual_out.dtype == x.dtype
        assert x.numel() == 0 or out.data_ptr() != residual_out.data_ptr(), \
            "out and residual_out must differ"
        r2, ro2 = _as_rows(residual, n, "residual"), _as_rows(residual_out, n, "residual_out")
    else:
        r2, ro2 = x2, x2  # unused: HAS_RESIDUAL=False compiles their accesses away
    rows = x2.shape[0]
    if rows:
        block = min(triton.next_power_of_2(n), MAX_NORM_BLOCK)
        # ~8 elements (16 bytes of bf16) per thread: full-width vector loads. (On an H200
        # 2..16 warps timed the same at hidden 2048/4096; the kernel runs at HBM speed.)
        warps = max(1, min(16, block // 256))
        early = pdl.dependent_launch(x.device, pdl.NORM_ACTIVATION)
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight, o2, ro2,
            x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
            n, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, NUM_CHUNKS=triton.cdiv(n, block),
            UNIT_OFFSET=unit_offset, PDL=early, num_warps=warps, launch_pdl=early,
        )
    return out, residual_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None = None, unit_offset: bool = False) -> torch.Tensor:
    """``RMSNorm(x)`` as in layers/basic.py: x [..., hidden] (last dim contiguous, rows
    may be strided), weight [hidden]. ``out`` (default: new, dtype promote(x, weight))
    may be x itself. ``unit_offset``: ``GemmaRMSNorm`` instead (scale ``1 + weight``,
    output in x's dtype)."""
    return _launch_rmsnorm(x, None, weight, eps, out, None, unit_offset)[0]


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None, unit_offset: bool = False):
    """``s = x + residual; return RMSNorm(s), s`` in one launch.

    x, residual: [..., hidden], same dtype. ``residual_out`` may be ``residual`` or ``x``
    (in-place update of the residual stream); ``out`` may be ``x`` but not residual_out.
    Returns ``(normed, new_residual)``. ``unit_offset`` as in ``rmsnorm``.
    """
    return _launch_rmsnorm(x, residual, weight, eps, out, residual_out, unit_offset)


@triton.jit
def _rotary_kernel(
    Q, K, Pos, Cos, Sin, V, KBuf, VBuf, Loc, KScale, VScale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    stride_vt, stride_vh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr,
    STORE: tl.constexpr, KV_FP8: tl.constexpr,
):
    # One program per token rotates all its q and k heads: the cos/sin row is gathered
    # once and shared, and q and k need no second launch.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cos = tl.load(Cos + pos * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + pos * stride_sin + d, mask=dmask, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, BLOCK_QH)
    qmask = (hq[:, None] < NUM_Q_HEADS) & dmask[None, :]
    q1_ptr = Q + t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q1_ptr, mask=qmask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptr + HALF, mask=qmask, other=0.0).to(tl.float32)
    tl.store(q1_ptr, (q1 * cos - q2 * sin).to(Q.dtype.element_ty), mask=qmask)
    tl.store(q1_ptr + HALF, (q2 * cos + q1 * sin).to(Q.dtype.element_ty), mask=qmask)

    hk = tl.arange(0, BLOCK_KH)
    kmask = (hk[:, None] < NUM_K_HEADS) & dmask[None, :]
    k1_ptr = K + t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    k1 = tl.load(k1_ptr, mask=kmask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptr + HALF, mask=kmask, other=0.0).to(tl.float32)
    # rounded to k's dtype (as the unfused rotation stores it), then to the pool's
    k_lo = (k1 * cos - k2 * sin).to(K.dtype.element_ty)
    k_hi = (k2 * cos + k1 * sin).to(K.dtype.element_ty)
    if STORE:
        # straight into the token's KV pool slot, with its v: no second launch, and k
        # itself is left as it was (attention reads the pool)
        slot = tl.load(Loc + t)
        v_ptr = V + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
        v_lo = tl.load(v_ptr, mask=kmask)
        v_hi = tl.load(v_ptr + HALF, mask=kmask)
        if KV_FP8:  # a float8 pool holds value / scale of the head, clamped to its range
            ks = tl.load(KScale + hk, mask=hk < NUM_K_HEADS, other=1.0)[:, None]
            vs = tl.load(VScale + hk, mask=hk < NUM_K_HEADS, other=1.0)[:, None]
            k_lo = saturate(tl.math.div_rn(k_lo.to(tl.float32), ks))
            k_hi = saturate(tl.math.div_rn(k_hi.to(tl.float32), ks))
            v_lo = saturate(tl.math.div_rn(v_lo.to(tl.float32), vs))
            v_hi = saturate(tl.math.div_rn(v_hi.to(tl.float32), vs))
        kb_ptr = KBuf + slot * stride_kbs + hk[:, None] * stride_kbh + d[None, :]
        tl.store(kb_ptr, k_lo.to(KBuf.dtype.element_ty), mask=kmask)
        tl.store(kb_ptr + HALF, k_hi.to(KBuf.dtype.element_ty), mask=kmask)
        vb_ptr = VBuf + slot * stride_vbs + hk[:, None] * stride_vbh + d[None, :]
        tl.store(vb_ptr, v_lo.to(VBuf.dtype.element_ty), mask=kmask)
        tl.store(vb_ptr + HALF, v_hi.to(VBuf.dtype.element_ty), mask=kmask)
    else:
        tl.store(k1_ptr, k_lo, mask=kmask)
        tl.store(k1_ptr + HALF, k_hi, mask=kmask)


def rotary_embedding_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place (rotate-half convention, float32
    math, stored back in each tensor's dtype), like ``RotaryEmbedding.forward``.

    q/k may be strided views (e.g. of a fused qkv output) but need a unit stride on D.
    positions: int64 [T], each < cos.shape[0] (not checked on device). cos/sin:
    [max_pos, D/2] with unit last-dim stride (the RotaryEmbedding buffers).
    """
    check_rotary(q, k, positions, cos, sin)
    if q.shape[0]:
        _launch_rotary(q, k, positions, cos, sin, None, None, None, None, None, None)


def check_rotary(q, k, positions, cos, sin) -> None:
    num_tokens, _, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim
    assert head_dim % 2 == 0 and cos.shape[-1] * 2 == head_dim and sin.shape == cos.shape
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"


def _launch_rotary(q, k, positions, cos, sin, v, k_buffer, v_buffer, loc, k_scale,
                   v_scale) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    half, num_k_heads = head_dim // 2, k.shape[1]
    bqh, bkh = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_k_heads)
    bd = triton.next_power_of_2(half)
    store = k_buffer is not None
    v, kb, vb, loc = (v, k_buffer, v_buffer, loc) if store else (k, k, k, positions)
    fp8 = store and check_kv_scales(k_buffer, k_scale, v_scale)
    ks, vs = (k_scale, v_scale) if fp8 else (k, k)
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin, v, kb, vb, loc, ks, vs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        v.stride(0), v.stride(1), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half,
        BLOCK_QH=bqh, BLOCK_KH=bkh, BLOCK_D=bd, STORE=store, KV_FP8=fp8,
        num_warps=4 if bqh * bd <= 2048 else 8,
    )


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """``rotary_embedding_(q, k, ...)`` and then ``kv_store.store_kv(k_buffer, v_buffer,
    loc, k, v, k_scale, v_scale)`` in one launch; q is rotated in place, k is left unrotated (only its
    pool copy is). Same arguments and constraints as those two functions."""
    check_rotary(q, k, positions, cos, sin)
    assert v.shape == k.shape and v.stride(-1) == 1
    assert loc.shape == (q.shape[0],) and loc.dtype == torch.int64
    assert k_buffer.shape[1:] == k.shape[1:] and v_buffer.shape == k_buffer.shape
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    if q.shape[0]:
        _launch_rotary(q, k, positions, cos, sin, v, k_buffer, v_buffer, loc, k_scale, v_scale)


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, stride_g, stride_o, I, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:  # launched early (pdl.py): gate_up is the previous kernel's
        await_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(GateUp + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + t * stride_g + I + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu's formula in float32, rounded to the dtype before the multiply, as the
    # two-op torch expression `F.silu(gate) * up` does
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty)
    tl.store(Out + t * stride_o + cols, (s.to(tl.float32) * u).to(Out.dtype.element_ty),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.silu(gate) * up`` for gate_up [T, 2I] = [gate | up] (GatedMLP.gate_up_proj's
    output). Rows may be strided; the last dim must be contiguous. out: [T, I], same
    dtype as gate_up (allocated when None)."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (num_tokens, inter) and out.dtype == gate_up.dtype and out.stride(1) == 1
    if num_tokens:
        # Narrow blocks so a batch-1 decode still spreads over several SMs
        # (Llama-1B: I = 8192 -> 16 programs).
        block = min(512, triton.next_power_of_2(inter))
        early = pdl.dependent_launch(gate_up.device, pdl.NORM_ACTIVATION)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, PDL=early,
            num_warps=4, launch_pdl=early)
    return out
