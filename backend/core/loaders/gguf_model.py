"""A GGUF file as a Hugging Face model: its config, its weights under Hugging Face names
(dequantized), its tokenizer.

What llama.cpp's converter changed on the way in is undone here, so that the tensors are
the ones the Hugging Face checkpoint had:
  * ``llama``: Q and K rows are permuted for llama.cpp's interleaved rotary embedding
    (pairs (2i, 2i + 1)); Hugging Face rotates halves (i, i + D/2). ``_unpermute``
    restores the original row order, per head.
  * ``gemma3``: every RMSNorm scale is stored as ``1 + w`` (ggml multiplies by the scale
    directly); Hugging Face's Gemma norm adds the 1 itself, so 1 is subtracted.
  * ``phi3``: the LongRoPE factors are tensors (``rope_factors_long/short``); they go back
    into the config's ``rope_parameters``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .gguf_reader import GGUFHeader, read_tensor

# general.architecture -> (transformers model_type, architecture class)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
# Tensor types we dequantize (with gguf-py) and test; others are refused at load.
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {  # GGUF block tensor -> Hugging Face module under model.layers.N
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {  # where an architecture's names differ from the common ones
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # llama.cpp keeps Phi-3's fused gate/up as one
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def check_supported(header: GGUFHeader) -> None:
    """Refuse, before anything is loaded, a file whose architecture or tensor types this
    loader does not handle."""
    from gguf import GGMLQuantizationType

    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{header.path}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    types = {GGMLQuantizationType(t.ggml_type).name for t in header.tensors.values()}
    unsupported = sorted(types - set(QUANT_TYPES))
    if unsupported:
        raise ValueError(f"{header.path}: tensor types {', '.join(unsupported)} are not "
                         f"supported; supported: {', '.join(QUANT_TYPES)}")
    if "rope_freqs.weight" in header.tensors:
        raise ValueError(f"{header.path}: per-frequency rope factors (rope_freqs, Llama 3.1 "
                         "style scaling) are not supported in GGUF files; use the model's "
                         "safetensors checkpoint")


def hf_config(header: GGUFHeader):
    """The transformers config the file describes."""
    from transformers import AutoConfig

    arch = header.architecture
    model_type, cls = ARCHITECTURES[arch]
    v = header.arch_value
    heads = int(v("attention.head_count"))
    hidden = int(v("embedding_length"))
    kwargs = dict(
        hidden_size=hidden, num_hidden_layers=int(v("block_count")),
        intermediate_size=int(v("feed_forward_length")), num_attention_heads=heads,
        num_key_value_heads=int(v("attention.head_count_kv", heads)),
        max_position_embeddings=int(v("context_length")),
        rms_norm_eps=_decimal(v("attention.layer_norm_rms_epsilon", 1e-6)),
        vocab_size=int(header.tensors["token_embd.weight"].shape[0]),
        tie_word_embeddings="output.weight" not in header.tensors,
        head_dim=int(v("attention.key_length", v("rope.dimension_count", hidden // heads))),
        bos_token_id=header.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=header.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=header.metadata.get("tokenizer.ggml.padding_token_id"),
    )
    rope = {"rope_type": "default", "rope_theta": _decimal(v("rope.freq_base", 10000.0))}
    rope.update(_rope_scaling(header))
    if arch == "gemma3":
        kwargs.update(_gemma3_settings(header, kwargs["head_dim"], rope))
    else:
        kwargs["rope_parameters"] = rope
    if arch == "qwen2":
        kwargs["use_sliding_window"] = False
    if arch == "phi3":  # one window for every layer; 0 when there is none
        kwargs["sliding_window"] = int(v("attention.sliding_window", 0)) or None
        if "original_max_position_embeddings" in rope:
            kwargs["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    config = AutoConfig.for_model(model_type, **kwargs)
    config.architectures = [cls]
    return config


def _decimal(value: float) -> float:
    """A float32 from the file as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): what the original config said."""
    return float(str(np.float32(value)))


def _rope_scaling(header: GGUFHeader) -> dict:
    v = header.arch_value
    if "rope_factors_long.weight" in header.tensors:  # Phi-3 LongRoPE
        out = {"rope_type": "longrope",
               "long_factor": read_tensor(header, "rope_factors_long.weight").tolist(),
               "short_factor": read_tensor(header, "rope_factors_short.weight").tolist(),
               "original_max_position_embeddings": int(v("rope.scaling.original_context_length"))}
        if v("rope.scaling.attn_factor") is not None:
            out["attention_factor"] = _decimal(v("rope.scaling.attn_factor"))
        return out
    kind = v("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(v("rope.scaling.factor"))}
    raise ValueError(f"{header.path}: rope scaling {kind!r} is not supported in GGUF files")


def _gemma3_settings(header: GGUFHeader, head_dim: int, rope: dict) -> dict:
    """Gemma 3 settings the file may leave implicit, as llama.cpp assumes them: every
    sixth layer attends globally (unless ``attention.sliding_window_pattern`` lists the
    local ones), local layers rotate with base 10000 (``rope.freq_base_swa``) and no
    scaling, and queries are scaled by head_dim ** -0.5 (hidden / heads for the 62-layer
    27B): the file has no ``query_pre_attn_scalar``."""
    v = header.arch_value
    layers = int(v("block_count"))
    scalar = head_dim if layers != 62 else int(v("embedding_length")) // int(v("attention.head_count"))
    window = v("attention.sliding_window")  # absent: no local layers at all
    local = v("attention.sliding_window_pattern") or [
        window is not None and (i + 1) % 6 != 0 for i in range(layers)]
    settings = dict(
        sliding_window=int(window) if window is not None else None,
        layer_types=["sliding_attention" if is_local else "full_attention" for is_local in local],
        rope_parameters={"full_attention": rope,
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": _decimal(v("rope.freq_base_swa", 1e4))}},
        query_pre_attn_scalar=scalar,
    )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if v(key) is not None:
            settings[key] = float(v(key))
    return settings


def hf_weights(header: GGUFHeader, config) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file as (Hugging Face name, float32 tensor), conversions undone."""
    arch = header.architecture
    names = dict(_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {}))
    for gguf_name in header.tensors:
        if gguf_name in _CONFIG_TENSORS:
            continue  # already in the config
        name = _hf_name(gguf_name, names)
        values = read_tensor(header, gguf_name)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = _unpermute(values, heads)
        if arch == "gemma3" and "norm" in name:
            values = values - np.float32(1.0)
        yield name, torch.from_numpy(np.ascontiguousarray(values))


def _hf_name(gguf_name: str, names: dict[str, str]) -> str:
    match = _BLOCK.fullmatch(gguf_name)
    if match:
        layer, piece, kind = match.groups()
        if piece in names:
            return f"model.layers.{layer}.{names[piece]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: within each head, rows were reordered from
    [first half; second half] to interleaved pairs: row 2i + j of a head (j in 0, 1) is
    row i + j * D/2 of the original."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_tokenizer(path: Path):
    """The tokenizer (and chat template) the file carries, built by transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# Chat models end a turn with one of these; llama.cpp stops on them too ("end of
# generation" tokens), while tokenizer.ggml.eos_token_id often names another (Gemma: <eos>).
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


def eos_token_ids(header: GGUFHeader) -> frozenset[int]:
    meta = header.metadata
    ids = {meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    control = 3  # llama.cpp's token type of special tokens
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == control and token in END_OF_TURN_TOKENS:
            ids.add(i)
    return frozenset(int(i) for i in ids if i is not None)
