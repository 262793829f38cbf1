"""Scales of an FP8 KV pool, measured on a calibration pass at start-up.

A float8 e4m3 value keeps its ~6% relative precision between 2^-6 and 448 times its
scale; below that it loses bits, above it is clamped. With a scale of 1.0 for every head
(vLLM's default) small-valued heads fall into the imprecise range, and a model whose keys
reach past 448 (large K biases) is clamped. So each layer and KV head gets
``scale = HEADROOM * absmax / 448`` from the K (after the rotary embedding) and V values
the model produces on CALIBRATION_TOKENS seeded random tokens, run through the torch
attention backend over a small pool in the model's dtype. HEADROOM leaves room for
inputs that reach further than the calibration pass did; doubling the range costs one
of the ~15 binades e4m3 spans, at its imprecise bottom.
"""
from __future__ import annotations

import torch

from .fp8 import FP8_MAX, MIN_SCALE
from .forward_batch import ForwardBatch
from .layers.attention import TorchAttention
from .memory_pool import KVPool, ReqToTokenPool
from .transfer import HostToDevice

CALIBRATION_TOKENS = 256
HEADROOM = 2.0


class _RangeProbe(TorchAttention):
    """The torch backend, also keeping each layer's per-head absmax of K and V."""

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(kv_pool, req_to_token)
        self.k_amax = torch.zeros_like(kv_pool.k_scale)
        self.v_amax = torch.zeros_like(kv_pool.v_scale)

    def forward(self, q, k, v, layer_id, batch, scale, *, window=0, softcap=0.0):
        self.k_amax[layer_id] = torch.maximum(self.k_amax[layer_id], k.abs().amax(dim=(0, 2)).float())
        self.v_amax[layer_id] = torch.maximum(self.v_amax[layer_id], v.abs().amax(dim=(0, 2)).float())
        return super().forward(q, k, v, layer_id, batch, scale, window=window, softcap=softcap)


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, pool: KVPool, vocab_size: int,
                        context_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale), [layers, kv_heads] float32 on the pool's device, for ``pool``
    (an FP8 pool; the pass itself runs over a temporary pool in the model's dtype)."""
    num_layers, num_kv_heads = pool.k_scale.shape
    head_dim = pool.k_buffer[0].shape[2]
    device = pool.k_scale.device
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    n = min(CALIBRATION_TOKENS, context_len)
    scratch = KVPool(n, num_layers, num_kv_heads, head_dim, dtype, str(device))
    table = ReqToTokenPool(2, n + 1, str(device))
    to_device = HostToDevice(device)
    slots = list(range(1, n + 1))
    table.write(1, 0, slots, to_device)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
    batch = ForwardBatch.build(input_ids=ids, req_pool_indices=[1], extend_prefix_lens=[0],
                               extend_seq_lens=[n], out_cache_loc=slots,
                               logits_indices=[n - 1], device=to_device)
    probe = _RangeProbe(scratch, table.req_to_token)
    model(batch, probe)
    k_scale = (HEADROOM * probe.k_amax / FP8_MAX).clamp(min=MIN_SCALE)
    v_scale = (HEADROOM * probe.v_amax / FP8_MAX).clamp(min=MIN_SCALE)
    return k_scale, v_scale
