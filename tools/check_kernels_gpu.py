"""Check the Triton attention kernels against TorchAttention on a CUDA GPU, and time them.

    python tools/check_kernels_gpu.py [--batch 64] [--max-ctx 4096]

Default layout is Llama-3.1-8B's (32 q heads, 8 kv heads, head_dim 128) in bf16, one
layer, KV slots scattered over a shuffled pool. Prints a correctness table (max abs error
vs TorchAttention in the same dtype, and vs an fp32 TorchAttention), a CUDA-graph replay
check for decode, and a timing table (torch.cuda.Event, mean over iterations). Exits 1 if
any correctness check fails.
"""
from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.core.forward_batch import ForwardBatch  # noqa: E402
from backend.core.kernels import decode_attention, decode_workspace_numel, store_kv  # noqa: E402
from backend.core.kernels import ExtendTiles, extend_attention, extend_tiles  # noqa: E402
from backend.core.layers.attention import TorchAttention  # noqa: E402
from backend.core.layers.triton_attention import TritonAttention  # noqa: E402
from backend.core.memory_pool import KVPool, ReqToTokenPool  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4}
FAILURES: list[str] = []


class Setup:
    """One-layer pool of random K/V with shuffled slots; batches built over it."""

    def __init__(self, h, kvh, d, dtype, max_reqs, max_ctx, seed=0):
        self.h, self.kvh, self.d, self.dtype = h, kvh, d, dtype
        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        size = max_reqs * max_ctx
        self.pool = KVPool(size, 1, kvh, d, dtype, "cuda")
        self.pool.k_buffer[0].normal_()
        self.pool.v_buffer[0].normal_()
        self.r2t = ReqToTokenPool(max_reqs, max_ctx, "cuda")
        perm = (torch.randperm(size) + 1).view(max_reqs, max_ctx)  # scattered, never slot 0
        self.r2t.req_to_token.copy_(perm.to(torch.int32))
        self.rows = list(range(max_reqs))

    def batch(self, prefix_lens, ext_lens):
        rows = self.rng.sample(self.rows, len(prefix_lens))
        r2t_cpu = self.r2t.req_to_token[rows].cpu()
        out_loc = [int(r2t_cpu[i, p + j]) for i, (p, n) in enumerate(zip(prefix_lens, ext_lens))
                   for j in range(n)]
        b = ForwardBatch.build(input_ids=[0] * len(out_loc), req_pool_indices=rows,
                               extend_prefix_lens=prefix_lens, extend_seq_lens=ext_lens,
                               out_cache_loc=out_loc, logits_indices=[], device="cuda")
        t = b.num_tokens
        q = torch.randn(t, self.h, self.d, device="cuda", dtype=self.dtype)
        k = torch.randn(t, self.kvh, self.d, device="cuda", dtype=self.dtype)
        v = torch.randn(t, self.kvh, self.d, device="cuda", dtype=self.dtype)
        return b, q, k, v

    def fp32_reference(self, b, q, scale):
        """TorchAttention in fp32 over the same (already stored) K/V."""
        pool32 = KVPool(1, 1, self.kvh, self.d, torch.float32, "cuda")
        pool32.k_buffer = [self.pool.k_buffer[0].float()]
        pool32.v_buffer = [self.pool.v_buffer[0].float()]
        loc = b.out_cache_loc
        k_new, v_new = pool32.k_buffer[0][loc], pool32.v_buffer[0][loc]
        return TorchAttention(pool32, self.r2t.req_to_token).forward(
            q.float(), k_new, v_new, 0, b, scale)


def check(name, s: Setup, prefix_lens, ext_lens):
    b, q, k, v = s.batch(prefix_lens, ext_lens)
    scale = s.d ** -0.5
    tri = TritonAttention(s.pool, s.r2t.req_to_token, num_heads=s.h)
    tri.prepare(b)
    out = tri.forward(q, k, v, 0, b, scale)
    stored = (torch.equal(s.pool.k_buffer[0][b.out_cache_loc], k)
              and torch.equal(s.pool.v_buffer[0][b.out_cache_loc], v))
    ref = TorchAttention(s.pool, s.r2t.req_to_token).forward(q, k, v, 0, b, scale)
    ref32 = s.fp32_reference(b, q, scale)
    err = (out.float() - ref.float()).abs().max().item()
    err32 = (out.float() - ref32).abs().max().item()
    err_ref32 = (ref.float() - ref32).abs().max().item()
    ok = stored and err < TOL[s.dtype] and err32 <= 2 * err_ref32 + TOL[s.dtype] / 4
    ok = ok and bool(torch.isfinite(out).all())
    if not ok:
        FAILURES.append(name)
    print(f"{name:<44} {str(s.dtype)[6:]:>8} {err:>10.2e} {err32:>10.2e} {err_ref32:>10.2e} "
          f"{'ok' if ok else 'FAIL'}")


def check_rope(name, s: Setup, seq_lens, splits):
    """decode_attention with ``rope`` (rotary + K/V store in stage 1) == rotary_store_kv
    then the plain decode kernel: the same output and the same pool, for q/k/v as views
    of one fused projection output (the model's layout)."""
    from types import SimpleNamespace

    from backend.core.kernels import DecodeRope
    from backend.core.kernels.fused import rotary_store_kv
    from backend.core.layers.rotary import RotaryEmbedding
    b, *_ = s.batch([n - 1 for n in seq_lens], [1] * len(seq_lens))
    n, h, kvh, d = len(seq_lens), s.h, s.kvh, s.d
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=500000.0), d, max(seq_lens) + 1).to("cuda")
    qkv = torch.randn(n, (h + 2 * kvh) * d, device="cuda", dtype=s.dtype)
    q = qkv[:, :h * d].view(n, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(n, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(n, kvh, d)
    kb, vb = s.pool.k_buffer[0], s.pool.v_buffer[0]
    kb_ref, vb_ref = kb.clone(), vb.clone()
    q_ref = q.clone()
    rotary_store_kv(q_ref, k.clone(), v, b.positions, rot.cos, rot.sin, kb_ref, vb_ref,
                    b.out_cache_loc)
    ws = torch.empty(decode_workspace_numel(n, h, d, splits), device="cuda", dtype=torch.float32)
    out_ref = torch.empty_like(q)
    decode_attention(q_ref, out_ref, kb_ref, vb_ref, s.r2t.req_to_token, b.req_pool_indices,
                     b.seq_lens, d ** -0.5, splits, workspace=ws)
    q_before = q.clone()
    out = torch.empty_like(q)
    decode_attention(q, out, kb, vb, s.r2t.req_to_token, b.req_pool_indices, b.seq_lens,
                     d ** -0.5, splits, workspace=ws,
                     rope=DecodeRope(k, v, b.positions, rot.cos, rot.sin, b.out_cache_loc))
    torch.cuda.synchronize()
    err = (out.float() - out_ref.float()).abs().max().item()
    err_k = (kb.float() - kb_ref.float()).abs().max().item()
    ok = (err <= TOL[s.dtype] / 4 and err_k <= 1e-2 * kb_ref.abs().max().item()
          and torch.equal(vb, vb_ref) and torch.equal(q, q_before)
          and bool(torch.isfinite(out).all()))
    if not ok:
        FAILURES.append(name)
    print(f"{name:<44} {str(s.dtype)[6:]:>8} {err:>10.2e} {err_k:>10.2e} {'':>10} "
          f"{'ok' if ok else 'FAIL'}")


def check_cuda_graph(s: Setup, batch_size, max_ctx):
    """Capture TritonAttention decode once, replay after changing lengths/rows in place."""
    lens = [s.rng.randint(1, max_ctx - 1) for _ in range(batch_size)]
    b, q, k, v = s.batch([n - 1 for n in lens], [1] * batch_size)
    tri = TritonAttention(s.pool, s.r2t.req_to_token, num_heads=s.h, max_batch_size=batch_size)
    tri.prepare(b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tri.forward(q, k, v, 0, b, 0.1)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.forward(q, k, v, 0, b, 0.1)
    ok = True
    for _ in range(3):
        new_lens = [s.rng.choice([1, 2, 5, s.rng.randint(1, max_ctx - 1)]) for _ in range(batch_size)]
        nb, nq, nk, nv = s.batch([n - 1 for n in new_lens], [1] * batch_size)
        for name in ("seq_lens", "extend_prefix_lens", "req_pool_indices", "out_cache_loc",
                     "qo_indptr"):
            getattr(b, name).copy_(getattr(nb, name))
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        graph.replay()
        ref = TorchAttention(s.pool, s.r2t.req_to_token).forward(nq, nk, nv, 0, nb, 0.1)
        err = (out.float() - ref.float()).abs().max().item()
        ok = ok and err < TOL[s.dtype]
    if not ok:
        FAILURES.append("cuda-graph decode")
    print(f"{'cuda-graph decode replay (3 new batches)':<44} {str(s.dtype)[6:]:>8} "
          f"{err:>10.2e} {'':>10} {'':>10} {'ok' if ok else 'FAIL'}")


def check_pinned_ring() -> None:
    """HostToDevice's pinned ring under a busy device: many more copies than ring buffers are
    queued behind long kernels, each with different values and sizes (buffers grow); every
    device tensor must hold exactly its own list."""
    from backend.core.transfer import HostToDevice

    to_device = HostToDevice("cuda")

    rng = random.Random(7)
    big = torch.randn(4096, 4096, device="cuda")
    sent, got = [], []
    for i in range(64):
        if i % 8 == 0:
            big = big @ big  # keeps the queue busy: copies wait behind it
            big /= big.abs().max()
        n = rng.choice([1, 3, 640, 5000, 20000])
        dtype = rng.choice([torch.int64, torch.int32, torch.float32, torch.bool])
        if dtype is torch.bool:
            values = [rng.random() < 0.5 for _ in range(n)]
        elif dtype is torch.float32:
            values = [float(rng.randint(-1000, 1000)) / 8 for _ in range(n)]
        else:
            values = [rng.randint(-2**30, 2**30) for _ in range(n)]
        sent.append(values)
        got.append(to_device(values, dtype))
    torch.cuda.synchronize()
    ok = all(t.tolist() == v for t, v in zip(got, sent))
    if not ok:
        FAILURES.append("pinned ring")
    print(f"{'to_device pinned ring (64 copies, busy device)':<44} {'':>8} {'':>10} {'':>10} "
          f"{'':>10} {'ok' if ok else 'FAIL'}")


def bench(fn, iters=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_decode(s: Setup, batch_size, ctx, splits_list):
    b, q, k, v = s.batch([ctx - 1] * batch_size, [1] * batch_size)
    store_kv(s.pool.k_buffer[0], s.pool.v_buffer[0], b.out_cache_loc, k, v)
    torch_ms = bench(lambda: TorchAttention(s.pool, s.r2t.req_to_token).forward(q, k, v, 0, b, 0.1),
                     iters=5, warmup=1)
    kv_bytes = batch_size * ctx * s.kvh * s.d * 2 * s.pool.k_buffer[0].element_size()
    # the fixed split counts with one-tile chunks, then (*) TritonAttention's own layout
    auto = TritonAttention(s.pool, s.r2t.req_to_token, num_heads=s.h).split_layout(batch_size, ctx)
    for splits, min_len in [(n, 0) for n in sorted(splits_list)] + [tuple(auto)]:
        out = torch.empty_like(q)
        ws = torch.empty(max(1, decode_workspace_numel(batch_size, s.h, s.d, splits)), device="cuda")
        ms = bench(lambda: decode_attention(q, out, s.pool.k_buffer[0], s.pool.v_buffer[0],
                                            s.r2t.req_to_token, b.req_pool_indices, b.seq_lens,
                                            0.1, splits, workspace=ws, min_split_len=min_len))
        star = "*" if (splits, min_len) == tuple(auto) else ""
        tag = f"decode B={batch_size} ctx={ctx} splits={splits}/{min_len}{star}"
        print(f"{tag:<44} {torch_ms:>10.3f} {ms:>10.3f} {torch_ms / ms:>8.1f}x "
              f"{kv_bytes / ms / 1e9:>9.0f} GB/s")


def time_extend(s: Setup, prefix_lens, ext_lens, alternatives=()):
    """The default tiles' time, then each of ``alternatives`` (``ExtendTiles``) on the
    same batch, marked with its tiles."""
    b, q, k, v = s.batch(prefix_lens, ext_lens)
    store_kv(s.pool.k_buffer[0], s.pool.v_buffer[0], b.out_cache_loc, k, v)
    out = torch.empty_like(q)
    torch_ms = bench(lambda: TorchAttention(s.pool, s.r2t.req_to_token).forward(q, k, v, 0, b, 0.1),
                     iters=5, warmup=1)
    # causal: query j of a request sees prefix + j + 1 keys; QK^T and PV are 2 flops/MAC each
    visible = sum(n * p + n * (n + 1) // 2 for p, n in zip(prefix_lens, ext_lens))
    default = extend_tiles(s.dtype, s.d, s.h // s.kvh, b.max_extend_len)
    for tiles in (default, *[t for t in alternatives if t != default]):
        ms = bench(lambda: extend_attention(
            q, out, s.pool.k_buffer[0], s.pool.v_buffer[0], s.r2t.req_to_token,
            b.req_pool_indices, b.seq_lens, b.extend_prefix_lens, b.qo_indptr,
            b.max_extend_len, 0.1, tiles=tiles))
        tflops = 4 * s.h * s.d * visible / ms / 1e9
        tag = (f"extend B={len(ext_lens)} prefix={max(prefix_lens)} ext={max(ext_lens)} "
               f"{tiles.block_m}x{tiles.block_n}h{tiles.heads}w{tiles.num_warps}"
               f"{'*' if tiles == default else ''}")
        print(f"{tag:<44} {torch_ms:>10.3f} {ms:>10.3f} {torch_ms / ms:>8.1f}x "
              f"{tflops:>9.1f} TFLOP/s")


def parse_tiles(spec: str) -> ExtendTiles:
    """``BMxBNhHEADSwWARPS`` (e.g. 128x32h4w8) as ``ExtendTiles`` with 2 stages."""
    m = re.fullmatch(r"(\d+)x(\d+)h(\d+)w(\d+)", spec)
    if not m:
        raise argparse.ArgumentTypeError(f"tiles {spec!r}: expected BMxBNhHEADSwWARPS")
    block_m, block_n, heads, warps = map(int, m.groups())
    return ExtendTiles(block_m, block_n, heads, warps, 2)


def time_store(s: Setup, num_reqs, tokens_per_req):
    b, q, k, v = s.batch([0] * num_reqs, [tokens_per_req] * num_reqs)
    loc, kb, vb = b.out_cache_loc, s.pool.k_buffer[0], s.pool.v_buffer[0]

    def torch_store():
        kb[loc] = k
        vb[loc] = v
    torch_ms = bench(torch_store)
    ms = bench(lambda: store_kv(kb, vb, loc, k, v))
    nbytes = 4 * k.numel() * k.element_size()  # read + write of K and V
    print(f"{f'store_kv T={b.num_tokens}':<44} {torch_ms:>10.3f} {ms:>10.3f} "
          f"{torch_ms / ms:>8.1f}x {nbytes / ms / 1e9:>9.0f} GB/s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--extend-tiles", type=parse_tiles, nargs="*", default=[],
                    help="extend tiles to time beside the default, e.g. 128x32h4w8 64x64h4w4")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dtype, bsz, ctx = DTYPES[args.dtype], args.batch, args.max_ctx
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rnd = random.Random(1)

    print(f"\n{'correctness':<44} {'dtype':>8} {'err':>10} {'err_fp32':>10} {'ref_fp32':>10}")
    main_setup = Setup(32, 8, 128, dtype, bsz, ctx + 1)
    check(f"decode B={bsz} ctx 1..{ctx}", main_setup,
          [0, 1, 2, 6] + [rnd.randint(0, ctx - 1) for _ in range(bsz - 4)], [1] * bsz)
    check("extend prefill 8 x 1..2048, no prefix", main_setup,
          [0] * 8, [rnd.randint(1, 2048) for _ in range(8)])
    check("extend chunked: prefix 0..2048 + ext 1..1024", main_setup,
          [rnd.randint(0, 2048) for _ in range(8)], [rnd.randint(1, 1024) for _ in range(8)])
    check(f"few-shot: {bsz} x (prefix 1024 + ext 32)", main_setup, [1024] * bsz, [32] * bsz)
    check(f"short: {bsz} x ext 5..8", main_setup, [0] * bsz, [rnd.randint(5, 8) for _ in range(bsz)])
    check(f"mixed: 4 chunks + {bsz - 4} decode rows", main_setup,
          [rnd.randint(0, ctx // 2) for _ in range(bsz)],
          [rnd.randint(ctx // 8, ctx // 2) for _ in range(4)] + [1] * (bsz - 4))
    check_cuda_graph(main_setup, min(bsz, 32), ctx)
    check_pinned_ring()
    # rotary + store inside decode: the split holding the new token is the last, a middle
    # one (short rows), or a split boundary (seq_len a multiple of the chunk)
    for splits in (4, 16, 32):
        check_rope(f"decode+rope {splits} splits B={bsz}", main_setup,
                   [1, 2, 64, 512, 513, ctx] + [rnd.randint(1, ctx) for _ in range(bsz - 6)],
                   splits)
    check_rope("decode+rope B=1 32 splits ctx 600", main_setup, [600], 32)
    for h, kvh, d in ((32, 8, 64), (28, 4, 128)):  # Llama-3.2-1B's and Qwen2-7B's heads
        small = Setup(h, kvh, d, dtype, 16, 1025, seed=h * d)
        check_rope(f"decode+rope h={h} kvh={kvh} d={d}", small,
                   [rnd.randint(1, 1024) for _ in range(16)], 16)
        del small
    for h, kvh, d, dt in [(32, 32, 128, dtype), (28, 4, 128, dtype), (16, 2, 256, dtype),
                          (32, 8, 80, dtype), (16, 4, 96, torch.float16), (8, 2, 64, torch.float32)]:
        small = Setup(h, kvh, d, dt, 16, 1025, seed=h + d)
        tag = f"h={h} kvh={kvh} d={d}"
        check(f"decode {tag}", small, [rnd.randint(0, 1000) for _ in range(16)], [1] * 16)
        check(f"extend {tag}", small, [rnd.randint(0, 500) for _ in range(8)],
              [rnd.randint(1, 500) for _ in range(8)])
        del small

    print(f"\n{'timing (ms)':<44} {'torch':>10} {'triton':>10} {'speedup':>9} {'throughput':>14}")
    for c in (512, 1024, 2048, ctx):
        time_decode(main_setup, bsz, c, [4, 8, 16])
    time_decode(main_setup, 1, ctx, [8, 16, 32])
    alt = args.extend_tiles
    time_extend(main_setup, [0] * 8, [2048] * 8, alt)
    time_extend(main_setup, [0], [ctx], alt)
    time_extend(main_setup, [2048] * 4, [1024] * 4, alt)
    time_extend(main_setup, [rnd.randint(0, 2048) for _ in range(bsz)], [512] * 4 + [1] * (bsz - 4),
                alt)
    time_extend(main_setup, [1024] * bsz, [32] * bsz, alt)  # few-shot: questions after a cached prefix
    time_extend(main_setup, [0] * bsz, [256] * bsz, alt)  # a burst of 256-token prompts
    time_extend(main_setup, [0] * bsz, [7] * bsz, alt)  # short prompts (32-row tiles at GROUP 4)
    time_store(main_setup, bsz, 1)  # a decode step
    time_store(main_setup, 8, 1024)  # an 8k-token prefill step

    print("\nALL OK" if not FAILURES else f"\nFAILED: {FAILURES}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
