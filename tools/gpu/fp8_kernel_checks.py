"""The float8 kernels on the GPU against their torch references (``check_fp8.py``'s
``kernels`` part): the KV stores byte for byte, the per-token quantizer, ``_scaled_mm``
against the dequantized product, attention over a float8 pool against the torch backend.
Under TRITON_INTERPRET=1 on CPU it runs as a dry run, where the interpreter's own float8
cast faults (tests/test_fp8_kernels.py names them) make the byte checks fail."""
from __future__ import annotations


def check_kernels(device: str) -> dict:
    import torch

    from backend.core.fp8 import FP8_DTYPE
    from backend.core.kernels import store_kv
    from backend.core.kernels.fp8_quant import per_token_quant
    from backend.core.layers.fp8_linear import Fp8Linear, emulated_mm, scaled_mm
    from backend.core.memory_pool import KVPool

    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    kvh, d, n = 8, 128, 300
    ref, got = (KVPool(1000, 1, kvh, d, FP8_DTYPE, device) for _ in range(2))
    scales = torch.rand(1, kvh, generator=gen, device=device) * 0.05 + 0.005
    for pool in (ref, got):
        pool.set_scales(scales, scales * 0.5)
    k = torch.randn(n, kvh, d, generator=gen, device=device, dtype=torch.bfloat16) * 3
    v = torch.randn(n, kvh, d, generator=gen, device=device, dtype=torch.bfloat16)
    k[0, 0, 0] = 1e4  # clamped, not NaN
    loc = torch.randperm(999, device=device)[:n] + 1
    ref.store(0, loc, k, v)
    store_kv(got.k_buffer[0], got.v_buffer[0], loc, k, v, got.k_scale[0], got.v_scale[0])
    out["store_kv_bytes_equal"] = bool(
        torch.equal(ref.k_buffer[0].view(torch.uint8), got.k_buffer[0].view(torch.uint8))
        and torch.equal(ref.v_buffer[0].view(torch.uint8), got.v_buffer[0].view(torch.uint8)))
    x = torch.randn(77, 4096, generator=gen, device=device, dtype=torch.bfloat16)
    q, s = per_token_quant(x)
    want_s = (x.abs().amax(-1, keepdim=True).float() / 448).clamp(min=1e-12)
    want_q = (x.float() / want_s).clamp(-448, 448).to(FP8_DTYPE)
    out["per_token_quant_equal"] = bool(torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
                                        and torch.allclose(s, want_s, rtol=1e-6))
    lin = Fp8Linear.from_linear(torch.nn.Linear(4096, 1024, bias=False, device=device))
    a = scaled_mm(q, s, lin.weight, lin.weight_scale, torch.bfloat16).float()
    b = emulated_mm(q, s, lin.weight, lin.weight_scale, torch.float32)
    out["scaled_mm_rel_err"] = float((a - b).norm() / b.norm())
    out["rotary_store_share_equal"] = check_rotary_store(device)
    out.update(check_attention(device))
    out["ok"] = (out["store_kv_bytes_equal"] and out["per_token_quant_equal"]
                 and out["rotary_store_share_equal"] > 0.999
                 and out["scaled_mm_rel_err"] < 1e-2 and out["attention_rel_err"] < 2e-2)
    return out


def check_rotary_store(device: str) -> float:
    """The share of bytes the fused rotary + float8 store writes as the torch rotation
    followed by ``KVPool.store`` (1.0 unless the two rotations round differently)."""
    from types import SimpleNamespace

    import torch

    from backend.core.fp8 import FP8_DTYPE
    from backend.core.kernels.fused import rotary_store_kv
    from backend.core.layers.rotary import RotaryEmbedding
    from backend.core.memory_pool import KVPool

    gen = torch.Generator(device=device).manual_seed(2)
    n, h, kvh, d = 200, 32, 8, 128
    half = torch.bfloat16 if device == "cuda" else torch.float16
    q, k, v = (torch.randn(n, x, d, generator=gen, device=device, dtype=half)
               for x in (h, kvh, kvh))
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=500000.0), d, max_positions=4096)
    rot.fill_tables(torch.device(device))
    positions = torch.randint(0, 4000, (n,), generator=gen, device=device)
    loc = torch.arange(1, n + 1, device=device)
    ref, got = (KVPool(n, 1, kvh, d, FP8_DTYPE, device) for _ in range(2))
    for pool in (ref, got):
        pool.set_scales(torch.full((1, kvh), 0.01, device=device),
                        torch.full((1, kvh), 0.005, device=device))
    _, k_rot = rot(positions, q.clone(), k.clone())
    ref.store(0, loc, k_rot, v)
    rotary_store_kv(q.clone(), k, v, positions, rot.cos, rot.sin, got.k_buffer[0],
                    got.v_buffer[0], loc, got.k_scale[0], got.v_scale[0])
    same = (ref.k_buffer[0].view(torch.uint8) == got.k_buffer[0].view(torch.uint8)).float().mean()
    return float(same)


def check_attention(device: str) -> dict:
    """Triton extend + decode over a float8 pool vs the torch backend over the same pool."""
    import torch

    from backend.core.forward_batch import ForwardBatch
    from backend.core.fp8 import FP8_DTYPE
    from backend.core.layers.attention import TorchAttention
    from backend.core.layers.triton_attention import TritonAttention, _Scoring
    from backend.core.memory_pool import KVPool, ReqToTokenPool
    from backend.core.transfer import HostToDevice

    gen = torch.Generator(device=device).manual_seed(1)
    h, kvh, d = 32, 8, 128
    lens = [700, 33, 1]
    copy = HostToDevice(device)
    table = ReqToTokenPool(4, 1024, device)
    slots, used = [], 1
    for row, n in enumerate(lens, start=1):
        table.write(row, 0, list(range(used, used + n)), copy)
        slots += list(range(used, used + n))
        used += n
    errs = {}
    for name, prefix in (("extend", [0, 0, 0]), ("decode", [n - 1 for n in lens])):
        ext = [n - p for n, p in zip(lens, prefix)]
        loc = [s for row, (p, n) in enumerate(zip(prefix, lens)) for s in
               range(1 + sum(lens[:row]) + p, 1 + sum(lens[:row]) + n)]
        batch = ForwardBatch.build(input_ids=[0] * sum(ext), req_pool_indices=[1, 2, 3],
                                   extend_prefix_lens=prefix, extend_seq_lens=ext,
                                   out_cache_loc=loc, logits_indices=[], device=copy)
        pool = KVPool(used, 1, kvh, d, FP8_DTYPE, device)
        pool.set_scales(torch.full((1, kvh), 0.02, device=device), torch.full((1, kvh), 0.01, device=device))
        pool.store(0, torch.tensor(slots, device=device),
                   torch.randn(len(slots), kvh, d, generator=gen, device=device),
                   torch.randn(len(slots), kvh, d, generator=gen, device=device))
        # (float16 for a CPU dry run: the interpreter's tl.dot misreads bfloat16)
        half = torch.bfloat16 if device == "cuda" else torch.float16
        q, k, v = (torch.randn(sum(ext), x, d, generator=gen, device=device, dtype=half)
                   for x in (h, kvh, kvh))
        tri = TritonAttention(pool, table.req_to_token, num_heads=h)
        tri.prepare(batch)
        tri.forward(q, k, v, 0, batch, d ** -0.5)  # (its stores: store_kv_bytes_equal)
        ref = TorchAttention(pool, table.req_to_token).forward(q, k, v, 0, batch, d ** -0.5)
        got = tri._attend(q, 0, batch, _Scoring(d ** -0.5, 0, 0.0))  # the same pool read
        errs[name] = float((got.float() - ref.float()).norm() / ref.float().norm())
    return {"attention_rel_err": max(errs.values()), "attention_errs": errs}
