"""Gemma3ForCausalLM (Gemma 3 text): the Llama decoder's attention and weight names, with

  * embeddings scaled by sqrt(hidden) (the factor rounded to the model's dtype, as the
    reference does);
  * RMSNorm scaled by ``1 + w`` (``GemmaRMSNorm``), before *and after* the attention and
    the MLP, and over each head of q and k;
  * interleaved sliding-window and global layers (``layer_types``), each kind with its
    own rotary table (local base 10000, global base and scaling from the config);
  * queries scaled by ``query_pre_attn_scalar ** -0.5``; a GELU-tanh gated MLP;
  * optional soft-capping of the final logits (``final_logit_softcapping``). Gemma 3
    checkpoints set no ``attn_logit_softcapping`` and the reference implementation
    does not apply one, so neither do we (the attention backends can: Gemma 2 did).

    x --norm--> attn --post_norm--> (+) --pre_ff_norm--> mlp --post_ff_norm--> (+) -->
    |________________________________^|__________________________________________^
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from ..layers.basic import GatedMLP, GemmaRMSNorm, linear
from ..layers.rotary import RotaryEmbedding
from .llama import Attention, LlamaForCausalLM


class Gemma3Attention(Attention):
    def __init__(self, config, qkv_bias: bool, layer_id: int) -> None:
        super().__init__(config, qkv_bias, layer_id)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        return (self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape[0], -1),
                self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape[0], -1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_types[layer_id] == "sliding_attention"
        self.self_attn = Gemma3Attention(config, False, layer_id)
        self.mlp = GatedMLP(hidden, config.intermediate_size, act="gelu_tanh")
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, residual, batch, attn, rotary, layer_id):
        """(this block's output, the stream before adding it), as in ``llama.py``."""
        h, residual = (self.input_layernorm(x), x) if residual is None else \
            self.input_layernorm(x, residual)
        proj = self.self_attn.qkv_proj
        qkv = linear(h, proj.weight, proj.bias, self.self_attn.fuse_rows)
        a = self.post_attention_layernorm(self.self_attn(qkv, batch, attn, rotary, layer_id))
        h, residual = self.pre_feedforward_layernorm(a, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        nn.Module.__init__(self)
        act = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 with activation {act!r} is not supported")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(config, head_dim, max_positions, "full_attention")
        self.rotary_local = RotaryEmbedding(config, head_dim, max_positions, "sliding_attention")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = config.hidden_size ** 0.5
        self.final_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        self.fuse_rows = False

    def forward(self, batch, attn):
        x = self.embed_tokens(batch.input_ids)
        x = x * _in_dtype(self.embed_scale, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            rotary = self.rotary_local if layer.is_sliding else self.rotary
            x, residual = layer(x, residual, batch, attn, rotary, i)
        if not batch.all_rows:
            rows = batch.logits_indices
            x, residual = x[rows], residual[rows]
        return x, residual

    def logits_input(self, stream):
        return self.final_hidden(stream)  # Gemma's norm is never fused into the head

    def compute_logits(self, hidden) -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor):
            hidden = self.final_hidden(hidden)
        logits = linear(hidden, self.lm_head_weight, None, self.fuse_rows, torch.float32)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


@lru_cache(maxsize=None)
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``: the reference scales embeddings by a tensor of the
    weights' dtype (sqrt(640) is 25.25 in bfloat16)."""
    return float(torch.tensor(value, dtype=dtype))
