"""Engine configuration: one frozen dataclass, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .limits import RequestLimits

SCHEDULE_POLICIES = ("lpm", "fcfs")
RADIX_EVICTION_POLICIES = ("adaptive", "lru")  # see eviction.py
DTYPES = ("float32", "float16", "bfloat16")
# of the linear layers' weights (layers/fp8_linear.py, layers/fp8_block_linear.py)
QUANTIZATIONS = ("none", "fp8", "fp8_block")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # "auto": the model's dtype (memory_pool.py)
KV_CACHE_SCALES = ("calibrate", "unit")
# the largest decode batch captured by default (start-up time grows with each size)
DEFAULT_GRAPH_BATCH_LIMIT = 512


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance.

    Memory: the KV pool holds ``max_total_tokens`` token slots when it is set; otherwise
    (GPU only) it is sized so that weights + KV use ``mem_fraction_static`` of the device.
    """

    model_path: str
    tokenizer_path: str | None = None  # defaults to model_path
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    # "auto": safetensors from model_path; "dummy": seeded random weights from config.json
    # alone (speed work on real model shapes without multi-GB weight files)
    load_format: str = "auto"
    # "fp8": the decoder's linear layers hold float8 e4m3 weights with one scale per
    # output channel, quantized at load; activations are quantized per token as they
    # arrive. "fp8_block": one scale per 128 x 128 block of weights instead, and per
    # token and 128 columns of activations. An FP8 checkpoint is read as it is stored
    # under either (its float8 values and its own per-tensor, per-channel or block
    # scales; layers/fp8_install.py). The embeddings, the LM head and the norms keep
    # ``dtype``. "none": every weight in ``dtype`` (an FP8 checkpoint dequantized).
    quantization: str = "none"

    # tensor parallelism: the model's heads, MLP and vocabulary split over this many
    # devices (one process each; GPUs device, device + 1, ...), with the same results
    tensor_parallel_size: int = 1

    # memory
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    max_running_requests: int = 256
    context_length: int | None = None  # defaults to the model's max_position_embeddings
    # "fp8_e4m3": K and V are stored as float8 e4m3 (one byte a value: twice the tokens
    # of a 16-bit pool in the same memory), divided by a scale per layer and KV head;
    # "auto": stored in ``dtype``
    kv_cache_dtype: str = "auto"
    # the FP8 KV scales: "calibrate" (from K/V ranges seen on a calibration pass at
    # start-up, with headroom) or "unit" (1.0 everywhere, as vLLM does by default)
    kv_cache_scales: str = "calibrate"

    # scheduling
    enable_radix_cache: bool = True
    schedule_policy: str = "lpm"
    max_prefill_tokens: int = 8192  # new prompt tokens per step (the chunked-prefill budget)
    starvation_bound: int = 8  # how many steps a waiting request may be passed over
    new_token_ratio: float = 0.4  # share of max_new_tokens reserved for running decodes
    enable_mixed_batch: bool = True  # decode tokens ride along with prefill chunks

    # radix cache
    # which cached prefixes go first when room is needed (eviction.py): "adaptive"
    # (frequency, recency, recompute cost; resists cycles and scans) or "lru"
    radix_eviction_policy: str = "adaptive"
    # host-memory tier for KV evicted from the device, loaded back on a hit instead of
    # recomputed: host_cache_tokens when set, else host_cache_ratio x the device KV pool
    # (0: no host tier); at most a quarter of the host memory free at start-up
    host_cache_ratio: float = 2.0
    host_cache_tokens: int | None = None
    # a host-tier match shorter than this is recomputed, not loaded: a load has a fixed
    # cost (a copy and its event, a step's wait) that a short recompute beats; leaves
    # that could never make a load this long are not saved to the host
    host_load_min_tokens: int = 256

    # GPU speed features (no-ops on CPU)
    attention_backend: str = "auto"  # "torch", "triton" or "auto"
    enable_cuda_graph: bool = True
    # decode batches up to this size replay a CUDA graph; None: max_running_requests (up
    # to DEFAULT_GRAPH_BATCH_LIMIT), so that no decode batch falls back to eager launches
    cuda_graph_max_batch: int | None = None
    # extend steps (prefill chunks, mixed prefill + decode batches, jump-forward runs) of
    # up to this many tokens replay a CUDA graph too; 0: always eager
    cuda_graph_max_tokens: int = 2048
    # overlap CPU scheduling with device work; None: on for CUDA devices (where the
    # device runs asynchronously), off on CPU (nothing to overlap with)
    enable_overlap: bool | None = None
    # batch-1 decode on CUDA half types: each RMSNorm runs inside the projection after it,
    # SiLU-and-mul inside the down projection (kernels/gemv.py)
    enable_fused_gemv: bool = True
    # decode batches whose rows share a cached prefix of at least 256 tokens (16 rows or
    # more) read it once for all rows instead of once per row, with the Triton attention
    # backend (layers/triton_attention.py); the same results, fewer KV bytes read
    enable_cascade_attention: bool = True

    # structured decoding
    # Text a grammar forces is appended as tokens either way (re-tokenized across the
    # boundary); jump-forward computes them in one extend step, without it each forced
    # token costs one decode step. Outputs are the same; only the step count differs.
    enable_jump_forward: bool = True
    grammar_compile_threads: int = 2

    # request limits: a request beyond one is refused, naming it (see limits.py)
    max_tokens_limit: int = 16384  # the largest max_tokens
    max_prompt_tokens: int | None = None  # None: up to the context length
    max_n: int = 64  # n and best_of
    max_choices: int = 256  # choices of one scoring request
    max_stop_strings: int = 64  # entries of stop, stop_regex, bad_words (each)
    max_stop_string_chars: int = 1024
    max_prompt_logprobs_tokens: int = 2048  # prompt positions with logprobs per request
    # admission bound: new requests are refused while this many wait to be admitted
    max_waiting_requests: int = 4096

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError("max_total_tokens must be at least 2")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be at least 1")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 1:
            raise ValueError("cuda_graph_max_batch must be at least 1 (or None)")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError("cuda_graph_max_tokens must be >= 0 (0: no extend graphs)")
        if self.radix_eviction_policy not in RADIX_EVICTION_POLICIES:
            raise ValueError(f"radix_eviction_policy must be one of {RADIX_EVICTION_POLICIES}, "
                             f"got {self.radix_eviction_policy!r}")
        if self.host_cache_ratio < 0:
            raise ValueError("host_cache_ratio must be >= 0 (0: no host tier)")
        if self.host_load_min_tokens < 0:
            raise ValueError("host_load_min_tokens must be >= 0")
        if self.host_cache_tokens is not None and self.host_cache_tokens < 0:
            raise ValueError("host_cache_tokens must be >= 0 (0: no host tier)")
        if self.starvation_bound < 0:
            raise ValueError("starvation_bound must be >= 0")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scales must be one of {KV_CACHE_SCALES}, "
                             f"got {self.kv_cache_scales!r}")
        if self.tensor_parallel_size > 1 and (self.quantization != "none"
                                              or self.kv_cache_dtype != "auto"):
            # the sharded layers and the ranks' KV pools have no float8 form yet
            raise ValueError("quantization and kv_cache_dtype are not supported with "
                             "tensor_parallel_size > 1 yet")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be 'auto' or 'dummy'")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be 'auto', 'torch' or 'triton'")
        for name in ("max_tokens_limit", "max_n", "max_choices", "max_stop_strings",
                     "max_stop_string_chars", "max_prompt_logprobs_tokens",
                     "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    @property
    def limits(self) -> RequestLimits:
        # imported here: this module stays loadable on its own (the chart's tests load
        # it by path to check its fields), and limits.py imports the sampling types
        from .limits import RequestLimits

        return RequestLimits(max_tokens=self.max_tokens_limit, max_n=self.max_n,
                             max_choices=self.max_choices,
                             max_stop_strings=self.max_stop_strings,
                             max_stop_string_chars=self.max_stop_string_chars,
                             max_prompt_logprobs_tokens=self.max_prompt_logprobs_tokens,
                             max_prompt_tokens=self.max_prompt_tokens)

    @property
    def cuda_graph_batch(self) -> int:
        """The largest decode batch a CUDA graph is captured for."""
        limit = (DEFAULT_GRAPH_BATCH_LIMIT if self.cuda_graph_max_batch is None
                 else self.cuda_graph_max_batch)
        return min(limit, self.max_running_requests)

    @property
    def overlap(self) -> bool:
        if self.enable_overlap is None:
            return self.device.startswith("cuda")
        return self.enable_overlap

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer_path or self.model_path
