"""Sliding-window attention in the Triton kernels on a CUDA GPU, at real model shapes.

    python3 tools/gpu/check_window_kernels.py --out $OUT

For each shape (Gemma 3 1B: 4 q heads, 1 KV head, head_dim 256, window 512; Phi-3-mini:
32/32 heads, head_dim 96, window 2047; Mistral-7B: 32/8, head_dim 128, window 4096) and
bf16 pools: extend batches whose prefixes and new tokens straddle the window, and decode
batches of contexts up to 8192, against TorchAttention with the same window over an fp32
copy of the pool; a decode CUDA graph captured once and replayed with other lengths; and
the decode time of a windowed layer against a full one at 8192 tokens (a window should
cap it). Writes ``window_kernels.json``; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backend.core.forward_batch import ForwardBatch  # noqa: E402
from backend.core.layers.attention import TorchAttention  # noqa: E402
from backend.core.layers.triton_attention import TritonAttention  # noqa: E402
from backend.core.memory_pool import KVPool, ReqToTokenPool  # noqa: E402

SHAPES = {"gemma3-1b": (4, 1, 256, 512), "phi3-mini": (32, 32, 96, 2047),
          "mistral-7b": (32, 8, 128, 4096)}
TOL = 3e-2  # bf16 output against an fp32 reference
MAX_CTX = 8192


class Pool:
    """One layer of random bf16 K/V with scattered slots, and its fp32 copy."""

    def __init__(self, h: int, kvh: int, d: int, rows: int = 8) -> None:
        self.h, self.kvh, self.d = h, kvh, d
        size = rows * MAX_CTX
        self.pool = KVPool(size, 1, kvh, d, torch.bfloat16, "cuda")
        self.pool.k_buffer[0].normal_()
        self.pool.v_buffer[0].normal_()
        self.r2t = ReqToTokenPool(rows, MAX_CTX, "cuda")
        perm = (torch.randperm(size) + 1).view(rows, MAX_CTX).to(torch.int32)
        self.r2t.req_to_token.copy_(perm)

    def batch(self, prefix_lens, ext_lens):
        rows = random.sample(range(self.r2t.req_to_token.shape[0]), len(prefix_lens))
        table = self.r2t.req_to_token[rows].cpu()
        loc = [int(table[i, p + j]) for i, (p, n) in enumerate(zip(prefix_lens, ext_lens))
               for j in range(n)]
        b = ForwardBatch.build(input_ids=[0] * len(loc), req_pool_indices=rows,
                               extend_prefix_lens=list(prefix_lens), extend_seq_lens=list(ext_lens),
                               out_cache_loc=loc, logits_indices=[], device="cuda")
        q = torch.randn(b.num_tokens, self.h, self.d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b.num_tokens, self.kvh, self.d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        return b, q, k, v

    def reference(self, b, q, scale, window):
        pool32 = KVPool(1, 1, self.kvh, self.d, torch.float32, "cuda")
        pool32.k_buffer = [self.pool.k_buffer[0].float()]
        pool32.v_buffer = [self.pool.v_buffer[0].float()]
        loc = b.out_cache_loc
        return TorchAttention(pool32, self.r2t.req_to_token).forward(
            q.float(), pool32.k_buffer[0][loc], pool32.v_buffer[0][loc], 0, b, scale,
            window=window)


def accuracy(p: Pool, window: int, prefix_lens, ext_lens) -> float:
    b, q, k, v = p.batch(prefix_lens, ext_lens)
    tri = TritonAttention(p.pool, p.r2t.req_to_token, num_heads=p.h)
    tri.prepare(b)
    out = tri.forward(q, k, v, 0, b, p.d ** -0.5, window=window)  # stores k, v first
    return (out.float() - p.reference(b, q, p.d ** -0.5, window)).abs().max().item()


def graph_replay(p: Pool, window: int) -> float:
    """Capture a decode step at one set of lengths, replay at others (in place)."""
    b, q, k, v = p.batch([100, 3000, 7000, 600], [1, 1, 1, 1])
    tri = TritonAttention(p.pool, p.r2t.req_to_token, num_heads=p.h, max_batch_size=4)
    tri.prepare(b)
    tri.forward(q, k, v, 0, b, 0.1, window=window)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.forward(q, k, v, 0, b, 0.1, window=window)
    worst = 0.0
    for lens in ([5, 8000, 513, 2048], [window + 1, window, window - 1, 1]):
        b.seq_lens.copy_(torch.tensor(lens, device="cuda", dtype=b.seq_lens.dtype))
        nb = ForwardBatch.build(input_ids=[0] * 4, req_pool_indices=b.req_pool_indices.tolist(),
                                extend_prefix_lens=[n - 1 for n in lens], extend_seq_lens=[1] * 4,
                                out_cache_loc=[int(p.r2t.req_to_token[r, n - 1]) for r, n in
                                               zip(b.req_pool_indices.tolist(), lens)],
                                logits_indices=[], device="cuda")
        b.out_cache_loc.copy_(nb.out_cache_loc)
        graph.replay()
        worst = max(worst, (out.float() - p.reference(nb, q, 0.1, window)).abs().max().item())
    return worst


def decode_ms(p: Pool, window: int, batch: int = 16) -> float:
    b, q, k, v = p.batch([MAX_CTX - 1] * min(batch, 8), [1] * min(batch, 8))
    tri = TritonAttention(p.pool, p.r2t.req_to_token, num_heads=p.h)
    tri.prepare(b)
    for _ in range(3):
        tri.forward(q, k, v, 0, b, 0.1, window=window)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        tri.forward(q, k, v, 0, b, 0.1, window=window)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    random.seed(0)
    torch.manual_seed(0)
    report, failed = {}, []
    for name, (h, kvh, d, window) in SHAPES.items():
        p = Pool(h, kvh, d)
        cases = {
            "extend-straddling": accuracy(p, window, [0, window - 7, min(3 * window, 7000), 37],
                                          [window + 300, 20, 250, 1]),
            "extend-long-prefill": accuracy(p, window, [0], [min(MAX_CTX - 1, 3 * window + 5)]),
            "decode": accuracy(p, window, [0, window - 1, window, MAX_CTX - 2], [1, 1, 1, 1]),
            "decode-graph-replay": graph_replay(p, window),
        }
        timing = {"decode_ms_window": decode_ms(p, window), "decode_ms_full": decode_ms(p, 0)}
        report[name] = {"window": window, "max_abs_error": cases, **timing}
        failed += [f"{name} {c}: {e:.3g}" for c, e in cases.items() if not e < TOL]
        print(name, json.dumps(report[name]), flush=True)
    Path(args.out, "window_kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    print("FAILED: " + "; ".join(failed) if failed else "all window checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
