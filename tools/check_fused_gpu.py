"""Check the fused RMSNorm / rotary / silu-and-mul kernels against the torch modules on a
CUDA GPU, and time them.

    python tools/check_fused_gpu.py [--dtype bf16]

Shapes are Llama-3.2-1B's (hidden 2048, 32/8 heads, head_dim 64, intermediate 8192) and
Llama-3.1-8B's (4096, 32/8, 128, 14336), plus hidden 16384 for the chunked RMSNorm path.
Correctness: every element within two ulps of torch's (|diff| <= 2**(1 - mantissa bits)
* |ref|), fewer than 1% of elements not bit-equal, and the residual sum bit-equal. Two
ulps, because RMSNorm and silu-mul round twice exactly as torch does (normalised row /
silu, then the product): when a float32 intermediate lands on the other side of a
rounding tie (float32 reduction order, approximate exp/rsqrt), that 1-ulp intermediate
difference can become 2 ulps of the product. On an H200 bf16 is bit-equal but for ~0.003%
of rotary elements; fp16 differs in ~0.02%. Also a CUDA-graph capture/replay check. Timing: torch.cuda.Event around 50 calls, eager and
replayed from one CUDA graph (the graph column is what a captured decode step pays).
Exits 1 if any check fails.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.core.kernels.fused import fused_add_rmsnorm, rmsnorm  # noqa: E402
from backend.core.kernels.fused import rotary_embedding_, silu_and_mul  # noqa: E402
from backend.core.layers.basic import RMSNorm  # noqa: E402
from backend.core.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 21}  # fp32: allow 4 ulp
MODELS = {"llama-1b": dict(hidden=2048, h=32, kvh=8, d=64, inter=8192),
          "llama-8b": dict(hidden=4096, h=32, kvh=8, d=128, inter=14336)}
FAILURES: list[str] = []


def report(name, got, ref, exact=None):
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype)
    diff = (got.float() - ref.float()).abs()
    bound = ref.float().abs() * 2.0 ** (1 - MANTISSA[ref.dtype]) + 1e-6
    differ = (got != ref).float().mean().item()
    ok = bool((diff <= bound).all()) and bool(torch.isfinite(got).all())
    if ref.dtype != torch.float32:  # fp32: reduction order alone changes most last bits
        ok = ok and differ < 0.01
    if exact is not None:
        ok = ok and torch.equal(*exact)
    if not ok:
        FAILURES.append(name)
    print(f"{name:<46} {diff.max().item():>10.2e} {differ:>9.4%} {'ok' if ok else 'FAIL'}")


def make_norm(hidden, dtype):
    norm = RMSNorm(hidden, 1e-5).cuda()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, device="cuda"))
    return norm.to(dtype)


def make_rotary(d):
    return RotaryEmbedding(SimpleNamespace(rope_theta=500000.0), d, 131072).cuda()


def qkv_views(t, h, kvh, d, dtype):
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", dtype=dtype)
    return qkv, qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)


def torch_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.no_grad()
def check(tag, m, t, dtype):
    norm = make_norm(m["hidden"], dtype)
    x = torch.randn(t, m["hidden"], device="cuda", dtype=dtype)
    res = torch.randn_like(x) * 4
    report(f"{tag} rmsnorm T={t}", rmsnorm(x, norm.weight, norm.eps), norm(x))
    normed, new_res = fused_add_rmsnorm(x, res, norm.weight, norm.eps)
    report(f"{tag} add+rmsnorm T={t}", normed, norm(x + res), exact=(new_res, x + res))

    rot = make_rotary(m["d"])
    qkv, q, k = qkv_views(t, m["h"], m["kvh"], m["d"], dtype)
    pos = torch.randint(0, 131072, (t,), device="cuda")
    ref_q, ref_k = rot(pos, q.clone(), k.clone())
    v_before = qkv[:, (m["h"] + m["kvh"]) * m["d"]:].clone()
    rotary_embedding_(q, k, pos, rot.cos, rot.sin)
    report(f"{tag} rotary q T={t}", q, ref_q, exact=(v_before, qkv[:, -v_before.shape[1]:]))
    report(f"{tag} rotary k T={t}", k, ref_k)

    gate_up = torch.randn(t, 2 * m["inter"], device="cuda", dtype=dtype) * 2
    report(f"{tag} silu_and_mul T={t}", silu_and_mul(gate_up), torch_silu_mul(gate_up))


@torch.no_grad()
def check_graph(m, t, dtype):
    """Capture all three kernels with preallocated/in-place outputs, replay on new data."""
    norm, rot = make_norm(m["hidden"], dtype), make_rotary(m["d"])
    x = torch.randn(t, m["hidden"], device="cuda", dtype=dtype)
    res, out = torch.randn_like(x), torch.empty_like(x)
    qkv, q, k = qkv_views(t, m["h"], m["kvh"], m["d"], dtype)
    pos = torch.randint(0, 4096, (t,), device="cuda")
    gate_up = torch.randn(t, 2 * m["inter"], device="cuda", dtype=dtype)
    act = torch.empty(t, m["inter"], device="cuda", dtype=dtype)

    def step():
        fused_add_rmsnorm(x, res, norm.weight, norm.eps, out=out, residual_out=res)
        rotary_embedding_(q, k, pos, rot.cos, rot.sin)
        silu_and_mul(gate_up, out=act)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(3):
        for t_ in (x, res, qkv, gate_up):
            t_.normal_()
        pos.random_(0, 4096)
        ref_res, ref_qk = x + res, rot(pos, q.clone(), k.clone())
        ref_act = torch_silu_mul(gate_up)
        graph.replay()
        report(f"cuda-graph replay {i}: add+rmsnorm", out, norm(ref_res), exact=(res, ref_res))
        report(f"cuda-graph replay {i}: rotary q", q, ref_qk[0])
        report(f"cuda-graph replay {i}: silu_and_mul", act, ref_act)


def bench(fn, iters=50):
    """(eager ms, CUDA-graph ms) per call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    eager = start.elapsed_time(end) / iters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return eager, start.elapsed_time(end) / iters


def row(name, torch_fn, fused_fn, nbytes):
    te, tg = bench(torch_fn)
    fe, fg = bench(fused_fn)
    print(f"{name:<34} {te * 1e3:>8.1f} {fe * 1e3:>8.1f} {tg * 1e3:>8.1f} {fg * 1e3:>8.1f} "
          f"{tg / fg:>7.1f}x {nbytes / fg / 1e6:>7.0f}")


@torch.no_grad()
def time_model(tag, m, t, dtype):
    es = torch.finfo(dtype).bits // 8
    norm = make_norm(m["hidden"], dtype)
    x = torch.randn(t, m["hidden"], device="cuda", dtype=dtype)
    res, out, res_out = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
    row(f"{tag} T={t} add+rmsnorm", lambda: norm(x + res),
        lambda: fused_add_rmsnorm(x, res, norm.weight, norm.eps, out=out, residual_out=res_out),
        4 * x.numel() * es)
    row(f"{tag} T={t} rmsnorm", lambda: norm(x),
        lambda: rmsnorm(x, norm.weight, norm.eps, out=out), 2 * x.numel() * es)
    rot = make_rotary(m["d"])
    _, q, k = qkv_views(t, m["h"], m["kvh"], m["d"], dtype)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    row(f"{tag} T={t} rotary q+k", lambda: rot(pos, q, k),
        lambda: rotary_embedding_(q, k, pos, rot.cos, rot.sin), 2 * (q.numel() + k.numel()) * es)
    gate_up = torch.randn(t, 2 * m["inter"], device="cuda", dtype=dtype)
    act = torch.empty(t, m["inter"], device="cuda", dtype=dtype)
    row(f"{tag} T={t} silu_and_mul", lambda: torch_silu_mul(gate_up),
        lambda: silu_and_mul(gate_up, out=act), 3 * act.numel() * es)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {dtype}")
    print(f"\n{'correctness':<46} {'max err':>10} {'not equal':>9}")
    for tag, m in MODELS.items():
        for t in (1, 7, 300):
            check(tag, m, t, dtype)
    wide = dict(MODELS["llama-8b"], hidden=16384)  # above MAX_NORM_BLOCK: two-pass path
    check("hidden-16384", wide, 33, dtype)
    check_graph(MODELS["llama-1b"], 8, dtype)

    print(f"\n{'timing (us per call)':<34} {'t-eager':>8} {'f-eager':>8} {'t-graph':>8} "
          f"{'f-graph':>8} {'speedup':>8} {'GB/s':>7}")
    for tag, m in MODELS.items():
        for t in (1, 64, 4096):
            time_model(tag, m, t, dtype)
    print("  (speedup = torch graph / fused graph; GB/s of the fused kernel under the graph)")

    print("\nALL OK" if not FAILURES else f"\nFAILED: {FAILURES}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
