"""Hugging Face architecture name -> our model class."""
from __future__ import annotations

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(config) -> type:
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {getattr(config, 'architectures', None)}; "
        f"supported: {sorted(MODEL_REGISTRY)}")


def context_limit(config) -> int:
    """Longest sequence the model serves: its position limit. Sliding-window layers
    attend within their window at any length (the attention backends mask older
    positions), so the window does not cap the context."""
    return int(config.max_position_embeddings)
