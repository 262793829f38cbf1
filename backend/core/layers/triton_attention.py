"""Attention backend on the Triton kernels in ``backend/core/kernels``.

Same contract and results as ``TorchAttention``: store the batch's new K/V at
``batch.out_cache_loc``, then attend every new query to its request's KV. Decode batches
(one new token per request) take the split-KV decode kernel, everything else (prefill,
chunked prefill, mixed prefill + decode, jump-forward runs) the extend kernel.

``forward`` never syncs the device: launch shapes come from the batch's host lists
(``batch_size``, ``max_extend_len``), never from device tensors. For CUDA graphs, pass
``num_heads`` and ``max_batch_size`` so the decode workspace is allocated once here and
keeps its address across captures. The decode split layout (``SplitLayout``) is a
function of the batch size and of a bound on the batch's longest row, ``max_seq_len``
from the host lists; a CUDA graph's static batch carries the bound of its length class
(``decode_len_classes``), so every replay of a graph uses the grid it was captured with.

Cascade attention: a decode batch of at least CASCADE_MIN_BATCH rows whose rows share
at least CASCADE_MIN_PREFIX leading pool slots (``batch.shared_prefix_len_cpu``, a
cached few-shot prompt, say) reads that prefix once per tile of query rows
(``kernels/decode_prefix.py``) instead of once per row. Below those sizes the prefix
kernel's extra launch and merge cost more than the reads they save. The grid
(``prefix_splits``) depends only on the batch size, and the workspace is sized once for
the worst case, so a CUDA graph captured with ``cascade_min_prefix`` as its shared
prefix serves every batch that shares at least that much.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from ..forward_batch import ForwardBatch
from ..kernels import (DecodeRope, SharedPrefix, decode_attention, decode_workspace_numel,
                       extend_attention, extend_warmup_lens, store_kv)
from ..kernels.decode_attention import DecodeTiles, prefix_rows
from ..kernels.fused import rotary_store_kv
from ..memory_pool import KVPool
from .attention import AttentionBackend

MIN_KV_SPLITS = 4
MAX_KV_SPLITS = 32
CPU_KV_SPLITS = 8  # no SM count to size for; also what the interpreter tests use
# A decode batch of at least FILL_PROGRAMS_PER_SM * SMs (request, kv head) pairs keeps the
# GPU busy without splitting rows: there rows up to ONE_PASS_LEN positions run in one
# pass (no workspace round trip, no merge), and only longer ones split, for balance.
# Measured on an H100 (8B attention, tools/gpu/bench_decode_attention.py --sweep): at 32 rows (256
# programs, 132 SMs) one pass takes 12.9 us a layer against 18.5 for four splits at 160
# positions, 51.5 against 57.9 at 1,024; at 128 rows of 1,024, 181.5 against 200.6. Under
# one program an SM (16 rows), rows of 512 already run faster split.
FILL_PROGRAMS_PER_SM = 1
ONE_PASS_LEN = 1024
# cascade attention from this shared prefix and this batch size on. Measured on an H100
# (tools/gpu/bench_cascade.py, 8B attention, 1,024 shared positions): at 4 rows the
# prefix kernel's launch and merge cost more than the reads they save (0.70x of plain);
# at 16 rows bf16 breaks even (0.97x) and a float8 pool gains 1.47x; at 64 rows 1.46x
# and 1.96x
CASCADE_MIN_PREFIX = 256
CASCADE_MIN_BATCH = 16
MAX_PREFIX_SPLITS = 16
CPU_PREFIX_SPLITS = 4  # as CPU_KV_SPLITS: several, so the tests merge several


class SplitLayout(NamedTuple):
    """How the decode kernel splits rows (``decode_attention``'s two arguments)."""

    num_kv_splits: int
    min_split_len: int


class TritonAttention(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, *,
                 num_heads: int | None = None, num_kv_splits: int | None = None,
                 min_split_len: int | None = None, max_batch_size: int = 0,
                 decode_tiles: DecodeTiles | None = None, cascade: bool = True) -> None:
        """num_kv_splits, min_split_len: fixed decode split choices instead of
        ``split_layout``'s (for tests and tuning); decode_tiles: the decode kernel's
        tiles instead of its default; cascade: whether decode batches sharing a long
        prefix read it once (module docstring)."""
        super().__init__(kv_pool, req_to_token)
        self.cascade = cascade
        self.num_heads = num_heads
        self.fixed_kv_splits = num_kv_splits
        self.fixed_min_split_len = min_split_len
        self.decode_tiles = decode_tiles
        k0 = kv_pool.k_buffer[0]
        self.device = k0.device
        self.num_kv_heads = int(k0.shape[1])
        self.head_dim = int(k0.shape[2])
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 0)
        self._workspace: torch.Tensor | None = None
        if num_heads and max_batch_size > 0:
            worst = self.workspace_bound(max_batch_size, num_heads)
            self._workspace = torch.empty(worst, dtype=torch.float32, device=self.device)

    def cascade_min_prefix(self, batch_size: int) -> int:
        if self.cascade and batch_size >= CASCADE_MIN_BATCH:
            return CASCADE_MIN_PREFIX
        return 0

    def extend_warmup_lens(self, num_heads: int, dtype: torch.dtype) -> list[int]:
        # the dots run in the pool's dtype, or in the queries' over a float8 pool
        dot = dtype if self.kv_pool.quantized else self.kv_pool.dtype
        return extend_warmup_lens(dot, self.head_dim, num_heads // self.num_kv_heads)

    def prefix_splits(self, batch_size: int, num_heads: int) -> int:
        """Prefix splits of a cascaded decode batch: enough prefix programs (row tiles x
        kv heads x splits) for ~2 waves over the SMs. The 8B shape (32 heads, 8 kv heads)
        at batch 64 on 132 SMs: 4 tiles of 16 requests x 8 kv heads = 32 programs a
        split, 8 splits. A pure function of the batch size (and fixed hardware)."""
        if not self.num_sms:
            return CPU_PREFIX_SPLITS
        group = num_heads // self.num_kv_heads
        programs = triton.cdiv(batch_size, prefix_rows(group) // group) * self.num_kv_heads
        return max(1, min(MAX_PREFIX_SPLITS, 2 * self.num_sms // programs))

    def _worst_numel(self, batch_size: int, num_heads: int) -> int:
        """The decode workspace of a batch of this size, cascaded if it may be."""
        prefix = (self.prefix_splits(batch_size, num_heads)
                  if self.cascade_min_prefix(batch_size) else 0)
        return decode_workspace_numel(batch_size, num_heads, self.head_dim,
                                      self.num_kv_splits(batch_size), prefix)

    def workspace_bound(self, max_batch_size: int, num_heads: int) -> int:
        """float32 elements of the largest decode workspace of any batch up to
        ``max_batch_size``, cascaded or not: allocated once, so that CUDA graphs captured
        over it (in any order) never see it move."""
        return max(self._worst_numel(b, num_heads) for b in range(1, max_batch_size + 1))

    def num_kv_splits(self, batch_size: int) -> int:
        """Splits for a decode batch whose rows may be long: enough stage-1 programs for
        ~2 waves over the SMs (and at least MIN_KV_SPLITS, to balance long rows). A pure
        function of the batch size (and fixed hardware); it sizes the workspace."""
        if self.fixed_kv_splits:
            return self.fixed_kv_splits
        if not self.num_sms:
            return CPU_KV_SPLITS
        want = triton.cdiv(2 * self.num_sms, max(1, batch_size * self.num_kv_heads))
        return min(MAX_KV_SPLITS, max(MIN_KV_SPLITS, triton.next_power_of_2(want)))

    def split_layout(self, batch_size: int, max_seq_len: int) -> SplitLayout:
        """The decode split layout for a batch whose rows have at most ``max_seq_len``
        positions (a bound known on the host; the kernel reads the real lengths)."""
        splits = self.num_kv_splits(batch_size)
        if self.fixed_min_split_len is not None:
            return SplitLayout(splits, self.fixed_min_split_len)
        if not self.num_sms or self.fixed_kv_splits:
            return SplitLayout(splits, 0)  # one tile: as many splits as the rows fill
        if batch_size * self.num_kv_heads < FILL_PROGRAMS_PER_SM * self.num_sms:
            return SplitLayout(splits, 0)
        if max_seq_len <= ONE_PASS_LEN:
            return SplitLayout(1, 0)  # every row one pass: stage 2 is not even launched
        return SplitLayout(splits, ONE_PASS_LEN)

    def decode_len_classes(self, batch_size: int, max_seq_len: int) -> list[int]:
        # two classes where short rows get a grid of their own (one split, one launch)
        short = min(ONE_PASS_LEN, max_seq_len)
        if self.split_layout(batch_size, short) != self.split_layout(batch_size, max_seq_len):
            return [short, max_seq_len]
        return [max_seq_len]

    def _decode_workspace(self, need: int) -> torch.Tensor:
        """The shared float32 workspace, grown (never shrunk) to ``need`` elements.

        All layers of a step reuse it: stage 2 of one layer finishes (same stream) before
        stage 1 (or the prefix kernel) of the next overwrites it.
        """
        if self._workspace is None or self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.float32, device=self.device)
        return self._workspace

    def prepare(self, batch: ForwardBatch) -> None:
        # size the workspace before the layers run (and before any graph capture), so
        # forward itself allocates nothing once the head count is known
        if batch.is_decode and self.num_heads and batch.batch_size:
            self._decode_workspace(self._worst_numel(batch.batch_size, self.num_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float, *, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        pool = self.kv_pool
        store_kv(pool.k_buffer[layer_id], pool.v_buffer[layer_id], batch.out_cache_loc, k, v,
                 *self._scales(layer_id))
        return self._attend(q, layer_id, batch, _Scoring(scale, window, softcap))

    def forward_rotary(self, q, k, v, layer_id, batch, scale, rotary, *, window=0, softcap=0.0):
        if not q.is_cuda:  # CPU (the interpreter tests): the rotation's torch reference
            return super().forward_rotary(q, k, v, layer_id, batch, scale, rotary,
                                          window=window, softcap=softcap)
        scoring = _Scoring(scale, window, softcap)
        if batch.is_decode and batch.batch_size:
            # the decode kernel rotates q and k and stores k and v itself
            rope = DecodeRope(k, v, batch.positions, rotary.cos, rotary.sin, batch.out_cache_loc)
            return self._attend(q, layer_id, batch, scoring, rope)
        # one launch rotates q and k and writes k and v to their pool slots
        rotary_store_kv(q, k, v, batch.positions, rotary.cos, rotary.sin,
                        self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id],
                        batch.out_cache_loc, *self._scales(layer_id))
        return self._attend(q, layer_id, batch, scoring)

    def _attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch,
                scoring: "_Scoring", rope: DecodeRope | None = None) -> torch.Tensor:
        """Attention of the new queries over the pool: their own K/V already stored, or
        (decode with ``rope``) rotated and stored by the decode kernel itself."""
        k_buf = self.kv_pool.k_buffer[layer_id]
        v_buf = self.kv_pool.v_buffer[layer_id]
        k_scale, v_scale = self._scales(layer_id)
        out = torch.empty_like(q)
        if batch.batch_size == 0 or q.shape[0] == 0:
            return out
        if batch.is_decode:
            num_heads = q.shape[1]
            self.num_heads = self.num_heads or num_heads  # lets later prepare() calls size it
            b = batch.batch_size
            layout = self.split_layout(b, batch.max_seq_len)
            shared = None
            if (scoring.window == 0 and batch.shared_prefix_len is not None
                    and 0 < self.cascade_min_prefix(b) <= batch.shared_prefix_len_cpu):
                shared = SharedPrefix(batch.shared_prefix_len, self.prefix_splits(b, num_heads))
            workspace = self._decode_workspace(decode_workspace_numel(
                b, num_heads, self.head_dim, layout.num_kv_splits,
                shared.num_splits if shared else 0))
            decode_attention(q, out, k_buf, v_buf, self.req_to_token, batch.req_pool_indices,
                             batch.seq_lens, scoring.scale, layout.num_kv_splits,
                             workspace=workspace, rope=rope, window=scoring.window,
                             softcap=scoring.softcap, k_scale=k_scale, v_scale=v_scale,
                             min_split_len=layout.min_split_len, tiles=self.decode_tiles,
                             shared_prefix=shared)
        else:
            extend_attention(q, out, k_buf, v_buf, self.req_to_token, batch.req_pool_indices,
                             batch.seq_lens, batch.extend_prefix_lens, batch.qo_indptr,
                             batch.max_extend_len, scoring.scale, window=scoring.window,
                             softcap=scoring.softcap, k_scale=k_scale, v_scale=v_scale)
        return out


    def _scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This layer's per-head K and V scales for a float8 pool; (None, None) otherwise."""
        pool = self.kv_pool
        if not pool.quantized:
            return None, None
        return pool.k_scale[layer_id], pool.v_scale[layer_id]


class _Scoring(NamedTuple):
    """How one layer scores keys: scale, sliding window (0: none), soft cap (0: none)."""

    scale: float
    window: int
    softcap: float
