"""A shuffled KV pool and a batch of extends over it: the set-up the attention kernel
cases share (test_triton_kernels, test_fp8_kernels, test_extend_tiles).

Slots and request-table rows are shuffled so that a kernel which assumed contiguous or
ordered slots would read the wrong K/V and fail its comparison with TorchAttention."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported at call time below: the interpreter child sets Triton up first
    from backend.core.forward_batch import ForwardBatch
    from backend.core.memory_pool import KVPool


@dataclass
class KVBatch:
    """``pools``: identical pools (one for the reference, one for the kernel under test)
    holding every request's prefix K/V; ``q, k, v``: the new tokens' projections, whose
    K/V go to ``batch.out_cache_loc`` (not yet stored)."""
    pools: list[KVPool]
    req_to_token: torch.Tensor
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def shuffled_kv_batch(prefix_lens, ext_lens, num_heads, num_kv_heads, head_dim, seed,
                      dtype=torch.float32, pool_size=600, rows=6, max_ctx=320,
                      num_pools=2) -> KVBatch:
    from backend.core.forward_batch import ForwardBatch
    from backend.core.memory_pool import KVPool, ReqToTokenPool
    from backend.core.transfer import HostToDevice
    gen = torch.Generator().manual_seed(seed)
    pools = [KVPool(pool_size, 1, num_kv_heads, head_dim, dtype, "cpu")
             for _ in range(num_pools)]
    r2t = ReqToTokenPool(rows, max_ctx, "cpu")
    slot_perm = (torch.randperm(pool_size, generator=gen) + 1).tolist()  # never slot 0
    row_perm = torch.randperm(rows, generator=gen).tolist()
    row_ids, out_loc, used = [], [], 0
    for i, (prefix, n) in enumerate(zip(prefix_lens, ext_lens)):
        slots = slot_perm[used:used + prefix + n]
        used += prefix + n
        r2t.write(row_perm[i], 0, slots, HostToDevice("cpu"))
        pk = torch.randn(prefix, num_kv_heads, head_dim, generator=gen).to(dtype)
        pv = torch.randn(prefix, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in pools:
            p.k_buffer[0][slots[:prefix]] = pk
            p.v_buffer[0][slots[:prefix]] = pv
        row_ids.append(row_perm[i])
        out_loc.extend(slots[prefix:])
    total = sum(ext_lens)
    batch = ForwardBatch.build(
        input_ids=[0] * total, req_pool_indices=row_ids, extend_prefix_lens=list(prefix_lens),
        extend_seq_lens=list(ext_lens), out_cache_loc=out_loc, logits_indices=[], device="cpu")
    q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    return KVBatch(pools, r2t.req_to_token, batch, q, k, v)
