"""The vocabulary-parallel embedding and LM head.

Each rank holds one block of the vocabulary's rows (``shards.vocab_block``). The
embedding looks up the ids in its block, writes zeros for the others and sums over the
ranks: every token's row comes from exactly one rank, so the sum is exact. The LM head
gives the logits of the rank's block; ``gather_logits`` lays the blocks side by side
and cuts the padding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .group import TensorParallel
from .shards import vocab_block


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.first, rows = vocab_block(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """The whole vocabulary's logits from each rank's block of them."""
    if tp.size == 1:
        return local
    return tp.all_gather(local)[..., :vocab_size].contiguous()
