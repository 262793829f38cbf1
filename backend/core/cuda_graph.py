"""CUDA graphs for decode steps: capture once per batch size, replay padded.

Small decode batches are bound by kernel-launch overhead, not by the GPU: one graph
replay replaces a few hundred launches. Each captured graph reads its inputs from static
buffers; a real batch of size b is copied into the first b rows of the smallest captured
size B >= b, and rows b..B-1 are padding that writes only the dummy KV slot 0 and the
dummy table row 0 (seq_len 0, so attention reads nothing for them)::

    static rows:  | real batch (b rows) | padding (B - b rows) |
    input_ids       copied                0
    positions       copied                0
    out_cache_loc   copied                0   (dummy slot)
    req_pool_idx    copied                0   (dummy row)
    seq_lens        copied                0

The graph ends at the final norm and the LM head runs outside it on the real rows only,
so no [B, vocab] buffer is kept per captured size. At batch 1 with the fused
matrix-vector kernels the graph ends before the norm instead: the norm runs inside the
LM head's launch.
"""
from __future__ import annotations

import bisect
import logging

import torch

from .forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160,
                 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes to capture: CAPTURE_SIZES below ``max_batch_size``, then that size
    itself, so that every decode batch up to it replays a graph (an eager decode step of
    a large batch is host-bound: several times a graph replay)."""
    top = max(1, max_batch_size)
    return [s for s in CAPTURE_SIZES if s < top] + [top]


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, attn, req_to_token: torch.Tensor,
                 max_batch_size: int, device: torch.device) -> None:
        self.model, self.attn, self.req_to_token = model, attn, req_to_token
        self.sizes = capture_sizes(max_batch_size)
        n = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        # the five per-request inputs as rows of one buffer, in ForwardBatch.decode_inputs
        # order: a replay fills them with one copy (and pads them with one fill)
        self.inputs = torch.zeros(5, n, **i64)
        (self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices,
         self.seq_lens) = self.inputs.unbind(0)
        self.ones = torch.ones(n, **i64)
        self.arange = torch.arange(n + 1, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # per size: the model's logits_input (final hidden states, or at batch 1 with the
        # fused kernels the stream before the norm)
        self.outputs: dict[int, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        # the graphs return every row's hidden state: a decode step whose logits rows
        # differ (prompt logprobs of a one-token prompt, say) runs eagerly
        return batch.is_decode and batch.all_rows and 0 < batch.batch_size <= self.max_batch_size

    def _static_batch(self, size: int) -> ForwardBatch:
        seq_lens = self.seq_lens[:size]
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size], req_pool_indices=self.req_pool_indices[:size],
            seq_lens=seq_lens, extend_prefix_lens=self.positions[:size],  # prefix = position
            extend_seq_lens=self.ones[:size], qo_indptr=self.arange[:size + 1],
            logits_indices=self.arange[:size],
            # host lists only size the launches; decode kernels take lengths from the device
            seq_lens_cpu=[1] * size, extend_prefix_lens_cpu=[0] * size,
            extend_seq_lens_cpu=[1] * size, is_decode=True, all_rows=True)

    def _run(self, batch: ForwardBatch):
        self.req_to_token[batch.req_pool_indices, batch.positions] = batch.out_cache_loc.to(torch.int32)
        self.attn.prepare(batch)
        # the final norm inside the graph, unless the LM head's launch runs it (batch 1)
        return self.model.logits_input(self.model(batch, self.attn))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # largest first: later ones reuse its pool
                batch = self._static_batch(size)
                for _ in range(2):  # compile Triton kernels, settle allocations
                    self._run(batch)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[size] = self._run(batch)
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def replay(self, batch: ForwardBatch):
        """What ``compute_logits`` takes, for the batch's rows."""
        b = batch.batch_size
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        packed = batch.decode_inputs
        if packed is not None and batch.input_ids.data_ptr() == packed.data_ptr():
            self.inputs[:, :b].copy_(packed)
        else:  # fields replaced after build: each from where it is now
            for buf, src in zip(self.inputs, (batch.input_ids, batch.positions,
                                              batch.out_cache_loc, batch.req_pool_indices,
                                              batch.seq_lens)):
                buf[:b].copy_(src)
        if size > b:
            self.inputs[:, b:size].zero_()
        self.graphs[size].replay()
        out = self.outputs[size]
        return out[:b] if isinstance(out, torch.Tensor) else (out[0][:b], out[1][:b])
