"""Decode attention at the Llama-3.1-8B shape: the kernel before one-pass rows against now.

    python3 tools/gpu/bench_decode_attention.py --out $OUT [--sweep]

Shape: 32 q heads, 8 KV heads, head_dim 128, bf16 pool, slots scattered through
``req_to_token``. Cases: batches 1, 32 and 128 at contexts of 64, 160, 250, 1024 and 4096
positions, and 128 rows of 33..250 positions (the 8B batch-128 serving row: prompt 32,
up to 128 generated, a spread of lengths). Each case times two kernels as the model
calls them, with the rotary embedding and the new token's K/V store fused in:

  * ``old``: ``decode_attention_baseline`` (the kernel of commit 9a6eeb4) with the split
    count TritonAttention chose then;
  * ``new``: ``decode_attention`` with ``TritonAttention.split_layout`` for the batch and
    its longest row (what a CUDA graph of that row-length class launches).

Timing: one CUDA graph of 32 calls cycling over enough layers (separate KV) that small
cases do not sit in L2, replayed until ~20 ms have run; microseconds per call (= per
layer). Correctness: both outputs against an fp32 reference over the same pool (the new
kernel must be as accurate as the old one). ``--sweep`` also times SWEEP_CASES over
stage-1 tiles and split layouts, to tune ``decode_tiles`` and the split policy.
Writes ``decode_attention_gpu.json`` under --out (default docs/benchmarks); exits 1 if a
check fails.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_attention_baseline as baseline  # noqa: E402
from backend.core.kernels.decode_attention import (DecodeRope, DecodeTiles,  # noqa: E402
                                                   decode_attention, decode_workspace_numel)
from backend.core.layers.triton_attention import SplitLayout, TritonAttention  # noqa: E402
from backend.core.memory_pool import KVPool  # noqa: E402

H, KVH, D = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 32, 128)
CONTEXTS = (64, 160, 250, 1024, 4096)
CALLS_PER_GRAPH = 32
L2_SPAN = 512 * 2**20  # KV bytes a graph cycles over, at least (H200 L2: 50 MiB)
SCALE = D ** -0.5
# --sweep: split layouts for these cases, and stage-1 tiles (one split) for the first two
SWEEP_CASES = ("B=128 ctx=250", "B=128 ctx=33..250", "B=128 ctx=1024", "B=32 ctx=160",
               "B=32 ctx=250", "B=1 ctx=160", "B=1 ctx=250")
SWEEP_LAYOUTS = ((1, 0), (2, 0), (4, 0), (8, 0), (4, 256), (4, 512))


class Case:
    """One decode batch: a pool of ``layers`` layers, the request table, q/k/v as views
    of one fused projection output, rotary tables and the outputs of both kernels."""

    def __init__(self, name: str, lens: list[int], seed: int = 0, device: str = "cuda",
                 dtype: torch.dtype = DTYPE) -> None:
        torch.manual_seed(seed)
        self.name, self.lens, self.batch, self.dtype = name, lens, len(lens), dtype
        self.kv_bytes = sum(lens) * KVH * D * 2 * 2  # K and V, bf16
        self.layers = max(1, min(CALLS_PER_GRAPH, math.ceil(L2_SPAN / self.kv_bytes)))
        total = sum(lens)
        self.pool = KVPool(total, self.layers, KVH, D, dtype, device)
        for buf in self.pool.k_buffer + self.pool.v_buffer:
            buf.normal_()
        self.r2t = torch.zeros(self.batch, max(lens), dtype=torch.int32, device=device)
        slots = (torch.randperm(total, device=device) + 1).to(torch.int32)  # never slot 0
        at = 0
        for b, n in enumerate(lens):
            self.r2t[b, :n] = slots[at:at + n]
            at += n
        dev = dict(dtype=torch.int64, device=device)
        self.seq_lens = torch.tensor(lens, **dev)
        self.rows = torch.arange(self.batch, **dev)
        self.positions = self.seq_lens - 1
        self.loc = self.r2t[self.rows, self.positions].long()
        qkv = torch.randn(self.batch, (H + 2 * KVH) * D, device=device, dtype=dtype)
        self.q = qkv[:, :H * D].view(self.batch, H, D)
        self.k = qkv[:, H * D:(H + KVH) * D].view(self.batch, KVH, D)
        self.v = qkv[:, (H + KVH) * D:].view(self.batch, KVH, D)
        inv_freq = 500000.0 ** (-torch.arange(0, D, 2, device=device).float() / D)
        freqs = torch.outer(torch.arange(max(lens), device=device).float(), inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self.backend = TritonAttention(self.pool, self.r2t, num_heads=H)
        self.old_splits = baseline.baseline_splits(self.batch, KVH, self.backend.num_sms)
        self.layout = self.backend.split_layout(self.batch, max(lens))

    def old_call(self, out: torch.Tensor):
        ws = torch.empty(baseline.decode_workspace_numel(self.batch, H, D, self.old_splits),
                         device=self.q.device)
        rope = baseline.DecodeRope(self.k, self.v, self.positions, self.cos, self.sin, self.loc)

        def call(layer: int) -> None:
            baseline.decode_attention(
                self.q, out, self.pool.k_buffer[layer], self.pool.v_buffer[layer], self.r2t,
                self.rows, self.seq_lens, SCALE, self.old_splits, workspace=ws, rope=rope)
        return call

    def new_call(self, out: torch.Tensor, layout: SplitLayout | None = None,
                 tiles: DecodeTiles | None = None):
        layout = layout or self.layout
        ws = torch.empty(max(1, decode_workspace_numel(self.batch, H, D, layout.num_kv_splits)),
                         device=self.q.device)
        rope = DecodeRope(self.k, self.v, self.positions, self.cos, self.sin, self.loc)

        def call(layer: int) -> None:
            decode_attention(self.q, out, self.pool.k_buffer[layer], self.pool.v_buffer[layer],
                             self.r2t, self.rows, self.seq_lens, SCALE, layout.num_kv_splits,
                             workspace=ws, rope=rope, min_split_len=layout.min_split_len,
                             tiles=tiles)
        return call

    def reference(self) -> torch.Tensor:
        """fp32 attention of the rotated q (rounded to the pool dtype, as the kernels do)
        over layer 0 as the kernels left it (the new tokens' K/V stored)."""
        cos, sin = self.cos[self.positions][:, None], self.sin[self.positions][:, None]
        q1, q2 = self.q.float().chunk(2, dim=-1)
        q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1).to(self.dtype).float()
        out = torch.empty(self.batch, H, D, device=self.q.device)
        kb, vb = self.pool.k_buffer[0], self.pool.v_buffer[0]
        for b, n in enumerate(self.lens):
            slots = self.r2t[b, :n].long()
            k = kb[slots].float().repeat_interleave(H // KVH, 1)  # [n, H, D]
            v = vb[slots].float().repeat_interleave(H // KVH, 1)
            p = (torch.einsum("hd,nhd->hn", q[b], k) * SCALE).softmax(-1)
            out[b] = torch.einsum("hn,nhd->hd", p, v)
        return out


def time_us(case: Case, call) -> float:
    """Microseconds per call: a graph of CALLS_PER_GRAPH calls over the case's layers."""
    for layer in range(case.layers):  # compiles outside the capture
        call(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(i % case.layers)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(3, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * CALLS_PER_GRAPH)


def run_case(case: Case) -> dict:
    out_old, out_new = torch.empty_like(case.q), torch.empty_like(case.q)
    old_us = time_us(case, case.old_call(out_old))
    new_us = time_us(case, case.new_call(out_new))
    case.old_call(out_old)(0)
    case.new_call(out_new)(0)
    ref = case.reference()
    err_old = (out_old.float() - ref).abs().max().item()
    err_new = (out_new.float() - ref).abs().max().item()
    ok = (bool(torch.isfinite(out_new).all()) and err_new < 3e-2
          and err_new <= 2 * err_old + 8e-3)
    row = dict(case=case.name, batch=case.batch, max_len=max(case.lens),
               mean_len=sum(case.lens) / case.batch, old_us=round(old_us, 2),
               new_us=round(new_us, 2), speedup=round(old_us / new_us, 3),
               old_splits=case.old_splits, new_splits=case.layout.num_kv_splits,
               new_min_split_len=case.layout.min_split_len,
               new_gbps=round(case.kv_bytes / new_us / 1e3, 1),
               hbm_bound_us=round(case.kv_bytes / 4.8e6, 2),  # H200: 4.8 TB/s
               err_old=err_old, err_new=err_new, ok=ok)
    layout = f"{case.layout.num_kv_splits}/{case.layout.min_split_len}"
    print(f"{case.name:<26} {old_us:>8.1f} {case.old_splits:>4} {new_us:>8.1f} {layout:>8} "
          f"{old_us / new_us:>7.2f}x {row['new_gbps']:>7.0f} {row['hbm_bound_us']:>7.1f} "
          f"{err_old:>9.2e} {err_new:>9.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return row


def sweep(case: Case) -> list[dict]:
    """One case over split layouts and (the first two SWEEP_CASES) one-split tiles."""
    rows = []
    out = torch.empty_like(case.q)
    options = [(SplitLayout(s, m), None) for s, m in SWEEP_LAYOUTS]
    if case.name in SWEEP_CASES[:2]:
        options += [(SplitLayout(1, 0), DecodeTiles(n, w, s))
                    for n, w, s in itertools.product((32, 64, 128), (4, 8), (1, 2, 3))]
    for layout, tiles in options:
        try:
            us = time_us(case, case.new_call(out, layout, tiles))
        except (triton.runtime.errors.OutOfResources, RuntimeError) as e:  # too much smem
            print(f"  {case.name} {layout} {tiles}: {type(e).__name__}")
            continue
        rows.append(dict(case=case.name, splits=layout.num_kv_splits,
                         min_split_len=layout.min_split_len,
                         tiles=list(tiles) if tiles else "default", us=round(us, 2)))
        tile_tag = "/".join(map(str, tiles)) if tiles else "default"
        print(f"  {case.name:<24} splits {layout.num_kv_splits} min {layout.min_split_len:>4} "
              f"tiles {tile_tag:<10} {us:>8.1f} us", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "docs/benchmarks"))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    rng = random.Random(0)
    specs = [(f"B={b} ctx={c}", [c] * b) for b in BATCHES for c in CONTEXTS]
    specs.append(("B=128 ctx=33..250", [rng.randint(33, 250) for _ in range(128)]))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    print(f"{'us per layer':<26} {'old':>8} {'spl':>4} {'new':>8} {'spl/min':>8} {'speedup':>8} "
          f"{'GB/s':>7} {'bound':>7} {'err_old':>9} {'err_new':>9}")
    rows, sweeps = [], []
    for i, (name, lens) in enumerate(specs):
        case = Case(name, lens, seed=i)
        rows.append(run_case(case))
        if args.sweep and name in SWEEP_CASES:
            sweeps += sweep(case)
        del case
        torch.cuda.empty_cache()
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, shape=dict(heads=H, kv_heads=KVH, head_dim=D,
                                                        dtype="bf16"),
                  rows=rows, sweep=sweeps)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "decode_attention_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    failed = [r["case"] for r in rows if not r["ok"]]
    print("\nALL OK" if not failed else f"\nFAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
