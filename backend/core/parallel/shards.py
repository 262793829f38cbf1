"""Which part of each weight a tensor-parallel rank holds, and cutting it from the whole
checkpoint tensor.

Attention heads split in contiguous blocks; a rank keeps the KV heads its query heads
read. Where ranks outnumber KV heads, each KV head is replicated on ``size / kv_heads``
neighbouring ranks::

    8 query heads, 2 KV heads, 4 ranks      rank:    0     1     2     3
                                         q heads:  0-1   2-3   4-5   6-7
                                        KV head:    0     0     1     1

Column-parallel weights (fused QKV, fused gate/up) keep rows; row-parallel ones (o_proj,
down_proj) keep columns and their outputs are summed over ranks. The vocabulary splits
in blocks of ``ceil(vocab / size)`` rows; the last block is padded with zero rows, whose
logits are cut off after the gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .group import TensorParallel


@dataclass(frozen=True)
class HeadSplit:
    """This rank's attention heads: counts and the first of each in the whole model."""

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int


def split_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
    n, r = tp.size, tp.rank
    if num_heads % n:
        raise ValueError(f"{num_heads} attention heads do not split over "
                         f"tensor_parallel_size {n}")
    if num_kv_heads >= n:
        if num_kv_heads % n:
            raise ValueError(f"{num_kv_heads} KV heads do not split over "
                             f"tensor_parallel_size {n}")
        kv, first_kv = num_kv_heads // n, r * (num_kv_heads // n)
    else:
        if n % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over "
                             f"tensor_parallel_size {n}")
        kv, first_kv = 1, r * num_kv_heads // n
    heads = num_heads // n
    return HeadSplit(heads, kv, r * heads, first_kv)


def split_evenly(total: int, tp: TensorParallel, what: str) -> int:
    """This rank's share of a dimension that must split exactly (the MLP's width)."""
    if total % tp.size:
        raise ValueError(f"{what} {total} does not split over tensor_parallel_size {tp.size}")
    return total // tp.size


def vocab_block(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows per rank) of this rank's block of the vocabulary."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


def rows(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``start .. start + length`` of ``tensor``, zero rows past its end."""
    part = tensor[start:start + length]
    if part.shape[0] == length:
        return part
    pad = torch.zeros((length - part.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    return torch.cat([part, pad])


@dataclass(frozen=True)
class Sharder:
    """Cuts this rank's part out of whole checkpoint tensors, by our parameter names."""

    heads: HeadSplit
    head_dim: int
    total_heads: int
    total_kv_heads: int
    intermediate: int  # this rank's MLP width
    vocab: tuple[int, int]  # vocab_block
    tp: TensorParallel

    def piece(self, fused: str, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of piece ``index`` of a fused projection (q, k, v of
        ``qkv_proj``; gate, up of ``gate_up_proj``), given that piece whole."""
        if self.tp.size == 1:
            return tensor
        d, h = self.head_dim, self.heads
        if fused == "qkv_proj":
            if index == 0:
                return tensor[h.first_head * d:(h.first_head + h.num_heads) * d]
            return tensor[h.first_kv_head * d:(h.first_kv_head + h.num_kv_heads) * d]
        width = self.intermediate
        return tensor[self.tp.rank * width:(self.tp.rank + 1) * width]

    def whole(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``name`` given whole (a fused projection stored
        fused, a row-parallel weight, the vocabulary, or a replicated weight)."""
        if self.tp.size == 1:
            return tensor
        if ".qkv_proj." in name:
            q, kv = self.total_heads * self.head_dim, self.total_kv_heads * self.head_dim
            parts = tensor.split([q, kv, kv])
            return torch.cat([self.piece("qkv_proj", i, p) for i, p in enumerate(parts)])
        if ".gate_up_proj." in name:
            parts = tensor.chunk(2)
            return torch.cat([self.piece("gate_up_proj", i, p) for i, p in enumerate(parts)])
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            width = tensor.shape[1] // self.tp.size
            return tensor[:, self.tp.rank * width:(self.tp.rank + 1) * width]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return rows(tensor, *self.vocab)
        return tensor  # norms, o_proj's bias: whole on every rank
