"""Llama-family decoder (LlamaForCausalLM) over a flat batch of tokens and the paged KV pool.

Qwen2, Qwen3, Mistral and Phi-3 reuse these classes (``qwen2.py``, ``qwen3.py``,
``mistral.py``, ``phi3.py``): they differ in QKV bias, per-head q/k norms, rotary scaling
and config defaults. Checkpoint names are mapped to our fused projections in
``load_weights``, so ``forward`` stays free of renames. Sliding-window layers (Mistral,
Qwen2/Qwen3 with ``use_sliding_window``, Phi-3's ``sliding_window``) pass their window
to the attention backend, which attends within it (see ``layers/attention.py``).

Under tensor parallelism (``tp``, see ``parallel/``) each rank builds the same classes
with its share of the heads, the MLP width and the vocabulary; the output and down
projections' partial sums meet in one all-reduce each.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..layers.attention import AttentionBackend
from ..layers.basic import GatedMLP, RMSNorm, linear, project, rows_fusable
from ..layers.rotary import RotaryEmbedding
from ..parallel.group import TensorParallel
from ..parallel.layers import VocabParallelEmbedding, gather_logits
from ..parallel.shards import Sharder, split_evenly, split_heads, vocab_block

SINGLE = TensorParallel()  # immutable: one rank, every collective the identity


def sliding_window(config, layer_id: int) -> int:
    """The attention window of layer ``layer_id`` (0: full attention). ``layer_types``
    says which layers slide when the config has it (Qwen2, Qwen3, Gemma 3); otherwise a
    set ``sliding_window`` applies to every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_id] == "sliding_attention" else 0
    return int(window) if getattr(config, "use_sliding_window", True) else 0


def head_split(config, tp: TensorParallel):
    heads = config.num_attention_heads
    return split_heads(heads, getattr(config, "num_key_value_heads", None) or heads, tp)


class Attention(nn.Module):
    def __init__(self, config, qkv_bias: bool, layer_id: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        split = head_split(config, tp)
        self.tp = tp
        self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = sliding_window(config, layer_id)
        self.softcap = 0.0  # attention scores are not capped (Gemma's may be)
        bias = qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size,
                                bias=getattr(config, "attention_bias", False))
        self.fuse_rows = False

    def forward(self, qkv: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                rotary: RotaryEmbedding, layer_id: int) -> torch.Tensor:
        """From this layer's QKV projection (computed by the caller, which fuses it with
        the norm before it) to the output projection."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = attn.forward_rotary(q, k, v, layer_id, batch, self.scale, rotary,
                                  window=self.window, softcap=self.softcap)
        o_proj, out = self.o_proj, out.reshape(-1, self.q_size)
        if self.tp.size == 1:
            return project(o_proj, out, self.fuse_rows)
        out = self.tp.all_reduce(linear(out, o_proj.weight, None, self.fuse_rows))
        return out if o_proj.bias is None else out + o_proj.bias  # the bias once, not N times

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        """Per-head q/k normalisation before the rotation; none in Llama."""
        return q, k


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, layer_id: int,
                 attention_cls: type = Attention, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.self_attn = attention_cls(config, qkv_bias, layer_id, tp)
        self.mlp = GatedMLP(config.hidden_size,
                            split_evenly(config.intermediate_size, tp, "intermediate_size"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, batch, attn, rotary, layer_id):
        """Pre-norm block on a residual stream: returns (this block's output, the stream
        before adding it); the next norm adds the two in the same fused step. Each norm
        runs together with the projection after it (``RMSNorm.linear``)."""
        qkv, residual = self.input_layernorm.linear(self.self_attn.qkv_proj, x, residual)
        x = self.self_attn(qkv, batch, attn, rotary, layer_id)
        gate_up, residual = self.post_attention_layernorm.linear(self.mlp.gate_up_proj, x,
                                                                 residual)
        return self.tp.all_reduce(self.mlp.down(gate_up)), residual


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    attention_cls = Attention

    def __init__(self, config, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.qkv_bias, i, self.attention_cls, tp)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.lm_head = self._lm_head(default_tied=False)
        self.fuse_rows = False  # batch-1 logits by the matrix-vector kernel (CUDA)

    def _lm_head(self, default_tied: bool) -> nn.Linear | None:
        """The untied LM head (this rank's block of the vocabulary), or None when the
        embedding is the head."""
        self.tie_word_embeddings = bool(getattr(self.config, "tie_word_embeddings",
                                                default_tied))
        if self.tie_word_embeddings:
            return None
        return nn.Linear(self.config.hidden_size,
                         vocab_block(self.config.vocab_size, self.tp)[1], bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, batch: ForwardBatch, attn: AttentionBackend):
        """The residual stream of the rows in ``batch.logits_indices`` before the final
        norm, as (last block's output, stream before it): ``compute_logits`` runs the
        norm with the LM head, so a batch-1 step fuses them into one launch."""
        x, residual = self.embed_tokens(batch.input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch, attn, self.rotary, i)
        if not batch.all_rows:
            rows = batch.logits_indices
            x, residual = x[rows], residual[rows]
        return x, residual

    def final_hidden(self, stream: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """The final norm of ``forward``'s output."""
        x, residual = stream
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def logits_input(self, stream: tuple[torch.Tensor, torch.Tensor | None]):
        """``forward``'s output taken as far as it goes without the LM head: the final
        norm, unless ``compute_logits`` runs that norm inside the head's own launch (a
        fusable batch-1 row). What a CUDA graph of the model ends with."""
        x, _ = stream
        if self.norm.fuse_rows and rows_fusable(x, self.norm.weight, self.lm_head_weight):
            return stream
        return self.final_hidden(stream)

    def compute_logits(self, hidden) -> torch.Tensor:
        """float32 logits from ``forward``'s, ``final_hidden``'s or ``logits_input``'s
        output."""
        if isinstance(hidden, torch.Tensor):
            local = linear(hidden, self.lm_head_weight, None, self.fuse_rows, torch.float32)
        else:
            local = self.norm.linear_weight(self.lm_head_weight, None, *hidden,
                                            torch.float32)[0]
        return gather_logits(local, self.config.vocab_size, self.tp)

    # ------------------------------------------------------------------ weights
    # checkpoint name piece -> (our fused parameter, shard index); the FP8 install reads
    # it too, to find a fused layer's checkpoint pieces
    stacked_params = (
        ("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
        ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
    )

    def sharder(self) -> Sharder:
        attn, config = self.layers[0].self_attn, self.config
        return Sharder(head_split(config, self.tp), attn.head_dim,
                       config.num_attention_heads,
                       getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                       self.layers[0].mlp.intermediate,
                       vocab_block(config.vocab_size, self.tp), self.tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a checkpoint's whole tensors in, each cut to this rank's part."""
        params = dict(self.named_parameters())
        sharder = self.sharder()
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            for piece, fused, shard in self.stacked_params:
                if f".{piece}." in name:
                    target = name.replace(piece, fused)
                    tensor = sharder.piece(fused, shard, tensor)
                    _copy_shard(params[target], tensor, shard, self._shard_sizes(fused, target))
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                tensor = sharder.whole(name, tensor)
                _check_shape(name, params[name].shape, tensor.shape)
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
        missing = [n for n in params if n not in loaded and not any(
            f"{n}#{s}" in loaded for s in range(3))]
        if missing:
            raise ValueError(f"checkpoint lacks weights: {missing[:5]}")

    def _shard_sizes(self, fused: str, target: str) -> list[int]:
        attn = self.layers[0].self_attn
        if fused == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.layers[0].mlp.intermediate
        return [inter, inter]


def _check_shape(name: str, want: torch.Size, got: torch.Size) -> None:
    if want != got:
        raise ValueError(f"weight {name!r} has shape {tuple(got)}; the config implies "
                         f"{tuple(want)}")


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int, sizes: list[int]) -> None:
    _check_shape(f"shard {shard}", (sizes[shard], *param.shape[1:]), tensor.shape)
    start = sum(sizes[:shard])
    with torch.no_grad():
        param.narrow(0, start, sizes[shard]).copy_(tensor)
