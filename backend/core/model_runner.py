"""The device side: weights, KV pools, attention backend, forward passes. No policy here.

Tensor parallelism: every rank builds a ``ModelRunner`` over its shard (``tp``); rank 0
also holds ``peers`` and sends each step to the other ranks (``run_step``) before
running it itself. The KV pool of each rank holds its own heads, with the same number of
slots everywhere (the scheduler's slot numbers mean the same on every rank).
"""
from __future__ import annotations

import logging
from typing import Iterator, Protocol

import torch

from .config import EngineConfig
from .forward_batch import ForwardBatch
from .layers.attention import AttentionBackend, TorchAttention
from .layers.rotary import RotaryEmbedding
from .host_memory import HostKVPool
from .memory_pool import KV_CACHE_DTYPES, KVPool, ReqToTokenPool
from .models.registry import context_limit, model_class
from .parallel.group import TensorParallel, rank_device
from .parallel.protocol import RankStep
from .transfer import HostToDevice

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_TOKENS = 32768


class Weights(Protocol):
    """A checkpoint's tensors (``loaders.Checkpoint.weights``): ``float8=True`` gives a
    float8 checkpoint's as stored (float8 weights and their scales), else dequantized."""

    def __call__(self, float8: bool = False) -> Iterator[tuple[str, torch.Tensor]]: ...


class StepPeers(Protocol):
    """The other ranks of a tensor-parallel engine, as rank 0 reaches them."""

    def send(self, step: RankStep) -> None: ...


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, weights: Weights | None = None,
                 tp: TensorParallel | None = None, peers: StepPeers | None = None) -> None:
        """``weights``: the checkpoint's tensors (``loaders.Checkpoint.weights``); by
        default those of ``config.model_path``. ``tp``: this rank's place in a
        tensor-parallel group (default: alone); ``peers``: rank 0's line to the others."""
        self.config = config
        self.hf_config = hf_config
        self.weights = weights
        self.tp = tp or TensorParallel()
        self.peers = peers
        self.device = rank_device(config.device, self.tp.rank)
        self.to_device = HostToDevice(self.device)  # every host list this side copies
        self.dtype = _DTYPES[config.dtype]
        self.kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or self.dtype
        self.context_len = min(config.context_length or context_limit(hf_config), context_limit(hf_config))
        self.vocab_size = hf_config.vocab_size
        self.model = self._load_model()
        attn0 = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn0.num_kv_heads, attn0.head_dim
        # what one token's K and V take over all layers, in the pool's dtype: what sizes
        # the device pool and the host tier (float8: half of a 16-bit pool)
        self.kv_bytes_per_token = KVPool.bytes_per_token(
            hf_config.num_hidden_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)
        self.kv_pool = KVPool(self._kv_pool_size(), hf_config.num_hidden_layers,
                              self.num_kv_heads, self.head_dim, self.kv_dtype, str(self.device))
        if self.kv_pool.quantized and config.kv_cache_scales == "calibrate":
            from .kv_calibration import calibrate_kv_scales

            self.kv_pool.set_scales(*calibrate_kv_scales(
                self.model, self.kv_pool, self.vocab_size, self.context_len, config.seed))
        self.host_pool = self._make_host_pool()
        self.req_pool = ReqToTokenPool(config.max_running_requests + 1, self.context_len + 1,
                                       str(self.device))
        self.attn = self._make_attention()
        self.graphs = None
        self.extend_graphs = None
        if self.device.type == "cuda":
            self.warm_up()
        if self.device.type == "cuda" and config.enable_cuda_graph and self.attn.supports_cuda_graph:
            from .cuda_graph import CudaGraphRunner, ExtendGraphRunner

            self.graphs = CudaGraphRunner(self.model, self.attn, self.req_pool.req_to_token,
                                          config.cuda_graph_batch,
                                          self.device)
            if config.cuda_graph_max_tokens > 0:
                self.extend_graphs = ExtendGraphRunner(
                    self.model, self.attn, config.cuda_graph_max_tokens,
                    config.max_running_requests, self.device, pool=self.graphs.pool)

    # ------------------------------------------------------------------ set-up
    def _load_model(self) -> torch.nn.Module:
        cls = model_class(self.hf_config)
        with torch.device("meta"):
            model = cls(self.hf_config, self.context_len + 1, self.tp)
        model = model.to_empty(device=self.device).to(self.dtype)
        for module in model.modules():  # to_empty wiped the rotary tables: float32 again
            if isinstance(module, RotaryEmbedding):
                module.fill_tables(self.device)
        float8_scales = None  # a float8 checkpoint's scales, by layer
        if self.config.load_format == "dummy" and self.tp.size == 1:
            _init_dummy(model, self.config.seed)
        elif self.config.load_format == "dummy":  # the one-rank values, cut to shards
            model.load_weights(_dummy_weights(cls, self.hf_config, self.context_len + 1,
                                              self.config.seed, self.device))
        else:
            if self.weights is None:
                from .loaders import open_checkpoint

                self.weights = open_checkpoint(self.config.model_path).weights
            float8_scales = self._load_weights(model)
        if self.config.quantization != "none":
            from .layers.fp8_install import install_fp8

            install_fp8(model, self.config.quantization, float8_scales)
        model.eval()
        if self.device.type == "cuda" and self.config.enable_fused_gemv:
            for module in model.modules():
                if hasattr(module, "fuse_rows"):
                    module.fuse_rows = True
        return model

    def _load_weights(self, model: torch.nn.Module) -> dict | None:
        """Copy the checkpoint into ``model``. A float8 checkpoint with float8 layers
        asked for: its float8 weights go in unscaled and their scales come back, by
        layer (``loaders/fp8_checkpoint.Float8Weights``); None otherwise."""
        from .loaders.fp8_checkpoint import Float8Weights, fp8_scheme

        scheme = fp8_scheme(self.hf_config)
        if scheme is None or self.config.quantization == "none":
            if scheme is not None:
                logger.warning("an FP8 checkpoint served in %s (quantization=none); set "
                               "quantization=fp8 to keep its weights in float8",
                               self.config.dtype)
            model.load_weights(self.weights())
            return None
        float8 = Float8Weights(scheme)
        model.load_weights(float8.stream(self.weights(float8=True)))
        return float8.scales

    def _kv_pool_size(self) -> int:
        """Slots in the KV pool: the same on every rank (the smallest that fits)."""
        return self.tp.min_int(self._kv_pool_size_here(), self.device)

    def _kv_pool_size_here(self) -> int:
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        per_token = self.kv_bytes_per_token
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_TOKENS
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = total * self.config.mem_fraction_static - used
        size = int(budget // per_token)
        if size < self.context_len:
            raise ValueError(f"only {size} KV tokens fit in memory; need >= {self.context_len}")
        logger.info("KV pool: %d tokens (%.1f GiB)", size, size * per_token / 2**30)
        return size

    def _make_host_pool(self) -> HostKVPool | None:
        """The host-memory tier's KV (None without one): pinned when the pool is on a GPU,
        so copies to and from it run asynchronously."""
        per_token = self.kv_bytes_per_token
        size = HostKVPool.tokens_for(self.config, self.kv_pool.size, per_token)
        if size == 0 or self.tp.size > 1:  # the host tier is single-rank for now
            return None
        logger.info("host KV tier: %d tokens (%.1f GiB)", size, size * per_token / 2**30)
        return HostKVPool(size, self.hf_config.num_hidden_layers, self.num_kv_heads,
                          self.head_dim, self.kv_dtype, pin=self.device.type == "cuda")

    def _make_attention(self) -> AttentionBackend:
        choice = self.config.attention_backend
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" else "torch"
        if choice == "triton":
            from .layers.triton_attention import TritonAttention

            # the decode workspace is allocated once, for the largest possible decode batch,
            # so CUDA graphs captured over it never see it move
            return TritonAttention(self.kv_pool, self.req_pool.req_to_token,
                                   num_heads=self.model.layers[0].self_attn.num_heads,
                                   max_batch_size=self.config.max_running_requests,
                                   cascade=self.config.enable_cascade_attention)
        return TorchAttention(self.kv_pool, self.req_pool.req_to_token)

    WARMUP_EXTEND_LENS = (1, 16, 32, 64, 128, 256)

    def warm_up(self) -> None:
        """Run one dummy extend per kernel tile size (the round lengths for the GEMMs, the
        attention backend's own for its prefill tiles), so Triton compiles its kernels at
        start-up instead of inside the first requests of each size (a compile takes far
        longer than a step). Dummy tokens use table row 0 and KV slot 0, never handed out."""
        attention = self.attn.extend_warmup_lens(self.model.layers[0].self_attn.num_heads,
                                                 self.dtype)
        for n in sorted({min(n, self.context_len)
                         for n in (*self.WARMUP_EXTEND_LENS, *attention)}):
            batch = ForwardBatch.build(input_ids=[0] * n, req_pool_indices=[0], extend_prefix_lens=[0],
                                       extend_seq_lens=[n], out_cache_loc=[0] * n,
                                       logits_indices=[n - 1], device=self.to_device)
            self.forward(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ running
    def write_table(self, writes) -> None:
        """Apply the scheduler's ``TableWrite``s (row, start, slots), in order."""
        for row, start, slots in writes:
            self.req_pool.write(row, start, slots, self.to_device)

    @torch.inference_mode()
    def run_step(self, step: RankStep, last_tokens: torch.Tensor | None) -> torch.Tensor:
        """One step's device work on this rank (rank 0 first sends it to the others):
        table writes, the batch, placeholders swapped for ``last_tokens`` (the previous
        step's sampled tokens, on the device), the forward. Logits of the whole
        vocabulary, on every rank."""
        if self.peers is not None:
            self.peers.send(step)
        self.write_table(step.table_writes)
        batch = step.batch.build(self.to_device)
        if last_tokens is not None and batch.num_placeholders:
            ids = batch.input_ids
            resolved = last_tokens[(-ids - 1).clamp(min=0)]
            # in place: the ids stay a view of the batch's index buffer, which the CUDA
            # graph runner copies as one block (ForwardBatch.decode_inputs)
            torch.where(ids < 0, resolved, ids, out=ids)
        return self.forward(batch)

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled tokens on every rank, when the next step may read them
        through placeholders (overlap scheduling); other ranks pass a buffer of the
        right size. A no-op on one rank."""
        if self.tp.size > 1 and self.config.overlap:
            self.tp.broadcast(tokens)
        return tokens

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (float32) of the rows ``batch.logits_indices``."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.model.compute_logits(self.graphs.replay(batch))
        record_slots(self.req_pool.req_to_token, batch)
        if self.extend_graphs is not None and self.extend_graphs.can_run(batch):
            return self.model.compute_logits(self.extend_graphs.replay(batch))
        self.attn.prepare(batch)
        return self.model.compute_logits(self.model(batch, self.attn))


def record_slots(req_to_token: torch.Tensor, batch: ForwardBatch) -> None:
    """Write where ``batch``'s new tokens live into ``req_to_token``, so attention finds
    them by position (a decode graph does this inside the graph)."""
    rows = torch.repeat_interleave(batch.req_pool_indices, batch.extend_seq_lens,
                                   output_size=batch.num_tokens)  # no host sync
    req_to_token[rows, batch.positions] = batch.out_cache_loc.to(torch.int32)


def _dummy_weights(cls: type, hf_config, max_positions: int, seed: int,
                   device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's ``_init_dummy`` values, one tensor at a time, in the same order
    and from the same generator (so every tensor-parallel size gets the same model)."""
    with torch.device("meta"):
        whole = cls(hf_config, max_positions)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in whole.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            yield name, torch.ones(p.shape, device=device)
        else:
            yield name, torch.randn(p.shape, generator=gen, device=device) * 0.02


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights on the model's device: norms 1, the rest N(0, 0.02)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * 0.02)
