"""Hugging Face architecture name -> our model class."""
from __future__ import annotations

from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


def model_class(config) -> type:
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {getattr(config, 'architectures', None)}; "
        f"supported: {sorted(MODEL_REGISTRY)}")


def context_limit(config) -> int:
    """Longest sequence the model serves exactly: the position limit, or the sliding
    window when one is set (full attention equals windowed attention up to it)."""
    limit = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limit = min(limit, int(window))
    return limit
