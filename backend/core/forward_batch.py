"""The one thing that flows from the scheduler to the model runner.

A batch is a flat run of new tokens from several requests. Request ``i`` contributes
``extend_seq_lens[i]`` new tokens (a prefill chunk, a jump-forward run, or 1 for decode)
on top of ``extend_prefix_lens[i]`` tokens whose KV is already in the pool::

    flat tokens:  | req 0 new tokens | req 1 new tokens | ... |
                  ^qo_indptr[0]      ^qo_indptr[1]      ^qo_indptr[2]
    req i KV:     req_to_token[req_pool_indices[i], 0 : seq_lens[i]]
                  = [ prefix (already stored) | new tokens (stored this step) ]
                  seq_lens[i] = extend_prefix_lens[i] + extend_seq_lens[i]

New token j of request i sits at position ``extend_prefix_lens[i] + j`` and attends to
KV positions ``0 .. extend_prefix_lens[i] + j`` (causal). ``out_cache_loc`` gives the
pool slot each new token's K/V is written to.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .transfer import to_device

ALIGN_ELEMS = 2  # int64 elements per 16 bytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN_ELEMS) * ALIGN_ELEMS


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    extend_prefix_lens: torch.Tensor  # [B] int64
    extend_seq_lens: torch.Tensor  # [B] int64
    qo_indptr: torch.Tensor  # [B + 1] int64
    logits_indices: torch.Tensor  # [L] int64: flat token rows whose logits are needed
    # host copies, for loops and shapes that must not sync the device
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    is_decode: bool  # every request has exactly one new token
    extra: dict = field(default_factory=dict)
    # the one device buffer ``build`` copied every index array into, each part starting
    # 16-byte aligned: the graph runners copy several fields at once through views of it
    flat: torch.Tensor | None = None
    all_rows: bool = False  # logits_indices is every token row, in order

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def decode_inputs(self) -> torch.Tensor | None:
        """input_ids, positions, out_cache_loc, req_pool_indices and seq_lens as the rows
        of one strided view of ``flat``, when they have one length (decode): [5, B]."""
        if self.flat is None or not self.is_decode:
            return None
        b = self.batch_size
        return self.flat[:5 * _aligned(b)].view(5, _aligned(b))[:, :b]

    @property
    def token_inputs(self) -> torch.Tensor | None:
        """input_ids, positions and out_cache_loc as one strided view of ``flat``: [3, T]."""
        if self.flat is None:
            return None
        t = self.num_tokens
        return self.flat[:3 * _aligned(t)].view(3, _aligned(t))[:, :t]

    @property
    def request_inputs(self) -> torch.Tensor | None:
        """req_pool_indices, seq_lens, extend_prefix_lens and extend_seq_lens as one
        strided view of ``flat``: [4, B]."""
        if self.flat is None:
            return None
        start, b = 3 * _aligned(self.num_tokens), self.batch_size
        return self.flat[start:start + 4 * _aligned(b)].view(4, _aligned(b))[:, :b]

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_seq_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @classmethod
    def build(cls, *, input_ids: list[int], req_pool_indices: list[int],
              extend_prefix_lens: list[int], extend_seq_lens: list[int],
              out_cache_loc: list[int], logits_indices: list[int],
              device: str | torch.device) -> "ForwardBatch":
        """Assemble from host lists; positions and offsets are derived here."""
        positions: list[int] = []
        for prefix, n in zip(extend_prefix_lens, extend_seq_lens):
            positions.extend(range(prefix, prefix + n))
        seq_lens = [p + n for p, n in zip(extend_prefix_lens, extend_seq_lens)]
        qo_indptr = [0]
        for n in extend_seq_lens:
            qo_indptr.append(qo_indptr[-1] + n)

        # one host->device copy for all index arrays, from pinned memory: a copy from
        # pageable memory would wait for the device to drain, which defeats overlap.
        # Each array starts 16-byte aligned (an odd length gets one pad element): Triton
        # compiles a kernel variant per pointer alignment, and views at whatever offset
        # the lengths gave compiled new variants while serving (~0.5 s stalls each)
        parts = [input_ids, positions, out_cache_loc, req_pool_indices, seq_lens,
                 extend_prefix_lens, extend_seq_lens, qo_indptr, logits_indices]
        values: list[int] = []
        for part in parts:
            values.extend(part)
            values.extend([0] * (_aligned(len(part)) - len(part)))
        flat = to_device(values, device)
        views, start = [], 0
        for part in parts:
            views.append(flat[start:start + len(part)])
            start += _aligned(len(part))
        is_decode = all(n == 1 for n in extend_seq_lens)
        return cls(
            input_ids=views[0], positions=views[1], out_cache_loc=views[2],
            req_pool_indices=views[3], seq_lens=views[4], extend_prefix_lens=views[5],
            extend_seq_lens=views[6], qo_indptr=views[7], logits_indices=views[8],
            seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=list(extend_prefix_lens),
            extend_seq_lens_cpu=list(extend_seq_lens),
            is_decode=is_decode,
            flat=flat,
            all_rows=len(logits_indices) == len(input_ids)
            and logits_indices == list(range(len(input_ids))),
        )

    @classmethod
    def build_decode(cls, *, input_ids: list[int], req_pool_indices: list[int],
                     positions: list[int], out_cache_loc: list[int],
                     device: str | torch.device) -> "ForwardBatch":
        """``build`` for a batch of one new token per request (token i at ``positions[i]``,
        its logits wanted): the same fields and the same ``flat`` layout, assembled
        without per-request loops."""
        b = len(input_ids)
        seq_lens = [p + 1 for p in positions]
        ones = [1] * b
        indptr = list(range(b + 1))
        pad = [0] * (_aligned(b) - b)
        values = (input_ids + pad + positions + pad + out_cache_loc + pad + req_pool_indices
                  + pad + seq_lens + pad + positions + pad + ones + pad + indptr
                  + [0] * (_aligned(b + 1) - b - 1) + indptr[:b] + pad)
        flat = to_device(values, device)
        a = _aligned(b)
        q = 7 * a + _aligned(b + 1)
        return cls(
            input_ids=flat[:b], positions=flat[a:a + b], out_cache_loc=flat[2 * a:2 * a + b],
            req_pool_indices=flat[3 * a:3 * a + b], seq_lens=flat[4 * a:4 * a + b],
            extend_prefix_lens=flat[5 * a:5 * a + b], extend_seq_lens=flat[6 * a:6 * a + b],
            qo_indptr=flat[7 * a:7 * a + b + 1], logits_indices=flat[q:q + b],
            seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=positions, extend_seq_lens_cpu=ones,
            is_decode=True, flat=flat, all_rows=True,
        )
