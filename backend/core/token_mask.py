"""Applying a grammar's allowed-token bitmask to a batch of logits."""
from __future__ import annotations

from typing import Sequence

import torch
import xgrammar as xgr

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: Sequence[int] | None = None, vocab_size: int | None = None) -> None:
    """Set ``logits[r, t] = -inf`` wherever bit t of ``bitmask[r]`` is 0, for r in ``rows``.

    ``rows`` (None: every row) index both tensors, so unconstrained requests in the same
    batch are left untouched. The bitmask may live on CPU (where matchers fill it) while the
    logits are on the GPU; it is copied over. Columns at or past ``vocab_size`` (padding)
    are always masked in those rows: no grammar can accept them.
    """
    if rows is not None:
        rows = [int(r) for r in rows]
        if not rows:
            return
    width = logits.shape[-1]
    vocab = min(width, bitmask.shape[-1] * 32) if vocab_size is None else min(vocab_size, width)
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    kernel = logits.dim() == 2 and logits.dtype in _KERNEL_DTYPES \
        and logits.device.type in ("cpu", "cuda")
    if kernel:
        try:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
        except ImportError:  # xgrammar's CUDA kernel is written in triton
            kernel = False
    if not kernel:
        _apply_bitmask_torch(logits, bitmask, rows, vocab)
    if width > vocab:
        idx = slice(None) if rows is None else torch.tensor(rows, device=logits.device)
        logits[idx, vocab:] = float("-inf")


def _apply_bitmask_torch(logits, bitmask, rows, vocab) -> None:
    """Device- and dtype-agnostic reference: unpack the 32 bits of each int32 word."""
    idx = torch.arange(logits.shape[0], device=logits.device) if rows is None \
        else torch.tensor(rows, device=logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask[idx].unsqueeze(-1) >> shifts) & 1  # arithmetic shift is fine: we & 1
    allowed = bits.reshape(len(idx), -1)[:, :vocab].bool()
    logits[idx, :vocab] = logits[idx, :vocab].masked_fill(~allowed, float("-inf"))
