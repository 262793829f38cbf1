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

from .transfer import HostToDevice

ALIGN_ELEMS = 2  # int64 elements per 16 bytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN_ELEMS) * ALIGN_ELEMS


def _pack(parts: list[list[int]], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One host->device copy for all index arrays (from pinned memory: a copy from
    pageable memory would wait for the device to drain, which defeats overlap), and a
    view of the copy per array. Each array starts 16-byte aligned (an odd length gets one
    pad element): Triton compiles a kernel variant per pointer alignment, and views at
    whatever offset the lengths gave compiled new variants while serving (~0.5 s stalls
    each)::

        flat: | part 0 | pad | part 1 | pad | ... |     (each part + pad: even length)
    """
    values: list[int] = []
    for part in parts:
        values += part
        if len(part) % ALIGN_ELEMS:
            values.append(0)
    copy = device if isinstance(device, HostToDevice) else HostToDevice(device)
    flat = copy(values)
    views, start = [], 0
    for part in parts:
        views.append(flat[start:start + len(part)])
        start += _aligned(len(part))
    return flat, views


@dataclass(frozen=True)
class BatchSpec:
    """The host lists a ``ForwardBatch`` is built from: what the scheduler side decides,
    and what rank 0 of a tensor-parallel engine sends the other ranks (so each builds
    the same batch). ``decode``: one new token per request at ``positions``; otherwise
    ``extend_prefix_lens``/``extend_seq_lens`` and ``logits_indices`` describe it."""

    decode: bool
    input_ids: list[int]
    req_pool_indices: list[int]
    out_cache_loc: list[int]
    positions: list[int] = field(default_factory=list)  # decode only
    extend_prefix_lens: list[int] = field(default_factory=list)  # extend only
    extend_seq_lens: list[int] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    num_placeholders: int = 0
    # decode only: leading positions whose KV slots are the same in every row (a prefix
    # the rows share in the radix cache), each row's new token excluded; 0 for none
    shared_prefix_len: int = 0

    def build(self, device: "HostToDevice | str | torch.device") -> "ForwardBatch":
        if self.decode:
            return ForwardBatch.build_decode(
                input_ids=self.input_ids, req_pool_indices=self.req_pool_indices,
                positions=self.positions, out_cache_loc=self.out_cache_loc, device=device,
                num_placeholders=self.num_placeholders, shared_prefix_len=self.shared_prefix_len)
        return ForwardBatch.build(
            input_ids=self.input_ids, req_pool_indices=self.req_pool_indices,
            extend_prefix_lens=self.extend_prefix_lens, extend_seq_lens=self.extend_seq_lens,
            out_cache_loc=self.out_cache_loc, logits_indices=self.logits_indices,
            device=device, num_placeholders=self.num_placeholders)


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
    # the one device buffer ``build`` copied every index array into, each part starting
    # 16-byte aligned: the graph runners copy several fields at once through views of it
    flat: torch.Tensor | None = None
    all_rows: bool = False  # logits_indices is every token row, in order
    # input ids that are placeholders for tokens the previous step sampled on the device
    # (overlap scheduling; forward_step.py resolves them before the forward)
    num_placeholders: int = 0
    # Positions 0..L-1 hold the same pool slots in every real row (decode batches whose
    # requests share a cached prefix). On the host it may be a bound (a CUDA graph's
    # static batch holds its class's) and only decides how to launch; the device value
    # (int64 [1]) is the real L, which kernels read.
    shared_prefix_len_cpu: int = 0
    shared_prefix_len: torch.Tensor | None = None

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
              device: HostToDevice | str | torch.device,
              num_placeholders: int = 0) -> "ForwardBatch":
        """Assemble from host lists; positions and offsets are derived here."""
        positions: list[int] = []
        for prefix, n in zip(extend_prefix_lens, extend_seq_lens):
            positions.extend(range(prefix, prefix + n))
        seq_lens = [p + n for p, n in zip(extend_prefix_lens, extend_seq_lens)]
        qo_indptr = [0]
        for n in extend_seq_lens:
            qo_indptr.append(qo_indptr[-1] + n)
        all_rows = (len(logits_indices) == len(input_ids)
                    and logits_indices == list(range(len(input_ids))))
        return cls._assemble(input_ids, positions, out_cache_loc, req_pool_indices, seq_lens,
                             list(extend_prefix_lens), list(extend_seq_lens), qo_indptr,
                             logits_indices, device, all(n == 1 for n in extend_seq_lens),
                             all_rows, num_placeholders)

    @classmethod
    def build_decode(cls, *, input_ids: list[int], req_pool_indices: list[int],
                     positions: list[int], out_cache_loc: list[int],
                     device: HostToDevice | str | torch.device,
                     num_placeholders: int = 0, shared_prefix_len: int = 0) -> "ForwardBatch":
        """``build`` for a batch of one new token per request (token i at ``positions[i]``,
        its logits wanted), without per-request loops. ``shared_prefix_len``: see
        ``BatchSpec``."""
        b = len(input_ids)
        indptr = list(range(b + 1))
        return cls._assemble(input_ids, positions, out_cache_loc, req_pool_indices,
                             [p + 1 for p in positions], positions, [1] * b, indptr,
                             indptr[:b], device, True, True, num_placeholders,
                             shared_prefix_len)

    @classmethod
    def _assemble(cls, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens,
                  extend_prefix_lens, extend_seq_lens, qo_indptr, logits_indices, device,
                  is_decode, all_rows, num_placeholders,
                  shared_prefix_len: int = 0) -> "ForwardBatch":
        """The one flat layout (``_pack``): the views ``decode_inputs``, ``token_inputs``
        and ``request_inputs`` rely on this order of the parts."""
        flat, v = _pack([input_ids, positions, out_cache_loc, req_pool_indices, seq_lens,
                         extend_prefix_lens, extend_seq_lens, qo_indptr, logits_indices,
                         [shared_prefix_len]], device)
        return cls(
            input_ids=v[0], positions=v[1], out_cache_loc=v[2], req_pool_indices=v[3],
            seq_lens=v[4], extend_prefix_lens=v[5], extend_seq_lens=v[6], qo_indptr=v[7],
            logits_indices=v[8], seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=extend_prefix_lens,
            extend_seq_lens_cpu=extend_seq_lens, is_decode=is_decode, flat=flat,
            all_rows=all_rows, num_placeholders=num_placeholders,
            shared_prefix_len_cpu=shared_prefix_len, shared_prefix_len=v[9])
