"""CUDA graphs for decode steps (``CudaGraphRunner``) and for short extend steps
(``ExtendGraphRunner``): capture once per size, replay padded.

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

Each size is captured once per length class of the attention backend
(``decode_len_classes``): the static batch's host ``seq_lens_cpu`` holds the class's
bound on the longest row, which is all a decode launch may size itself by. A replay
takes the first class whose bound holds the batch's longest row (with the Triton
backend at large batch: rows up to ONE_PASS_LEN (1,024) positions get a one-pass grid,
longer ones the split grid). Where the backend attends to a prefix that all rows share
once for the batch (cascade attention, from ``cascade_min_prefix`` tokens on), each size
and class is also captured with that bound as the static batch's shared prefix; a replay
takes that graph when the batch shares at least as much, and copies the real length into
the graph's one-element buffer.

The graph ends at the final norm and the LM head runs outside it on the real rows only,
so no [B, vocab] buffer is kept per captured size. At batch 1 with the fused
matrix-vector kernels the graph ends before the norm instead: the norm runs inside the
LM head's launch.

Extend steps (a prompt or a chunk of one, decode rows riding along with it, a
jump-forward run) are launch-bound too while they are short: an eager step of the 1B
shape costs ~8 ms of host time for ~2 ms of device work. ``ExtendGraphRunner`` captures
graphs per token count T (up to ``cuda_graph_max_tokens``), each for up to R = min(T,
max_running_requests) requests, since every request brings at least one token, and one
per class of the longest extend (up to 16, 32 or 64 tokens, or T), which sets the extend
kernel's tile as in an eager step::

    static tokens:    | real tokens (t) | padding (T - t): id 0, position 0, slot 0 |
    static requests:  | real (b)        | padding (R - b): row 0, lengths 0          |
    qo_indptr:        | real (b + 1)    | t, t, ...  (padding requests own no token) |
    logits_indices:   | real (l)        | 0, 0, ...                                  |

The extend kernel's programs for padding requests return at once (no tokens), padding
tokens write only the dummy KV slot 0, and their rows are computed and dropped. Where
each new token's KV lives (``req_to_token``) is written before the replay, outside the
graph, from the real batch.
"""
from __future__ import annotations

import bisect
import contextlib
import logging

import torch

from .forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160,
                 192, 224, 256, 320, 384, 448, 512)


EXTEND_CAPTURE_TOKENS = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512,
                         640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def extend_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture extend graphs for: EXTEND_CAPTURE_TOKENS below
    ``max_tokens``, then ``max_tokens`` itself; none for 0."""
    if max_tokens <= 0:
        return []
    return [s for s in EXTEND_CAPTURE_TOKENS if s < max_tokens] + [max_tokens]


EXTEND_TILE_CLASSES = (16, 32, 64)


def extend_classes(size: int) -> list[int]:
    """The longest-extend classes a graph of ``size`` tokens is captured for: the extend
    kernel's query tile follows the longest extend in the batch (16 rows for decode rows
    and short runs, up to 128 for long prompts), so each class is its own graph, and a
    replay runs the tile an eager step of the same batch would."""
    return [c for c in EXTEND_TILE_CLASSES if c < size] + [size]


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes to capture: CAPTURE_SIZES below ``max_batch_size``, then that size
    itself, so that every decode batch up to it replays a graph (an eager decode step of
    a large batch is host-bound: several times a graph replay)."""
    top = max(1, max_batch_size)
    return [s for s in CAPTURE_SIZES if s < top] + [top]


@contextlib.contextmanager
def _side_stream():
    """A stream to capture on (not the default one), ordered after the work queued so
    far; on exit the current stream waits for it and the device drains."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def _capture(run, batch: ForwardBatch, pool, stream):
    """(graph, output) of ``run(batch)`` captured on ``stream`` into ``pool``, after two
    eager runs that compile the Triton kernels and settle the allocations."""
    for _ in range(2):
        run(batch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = run(batch)
    return graph, output


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
        self.shared_prefix = torch.zeros(1, **i64)  # the real shared prefix of a replay
        # per size, the attention's row-length classes (each a bound on the longest row)
        self.len_classes = {size: attn.decode_len_classes(size, req_to_token.shape[1])
                            for size in self.sizes}
        # per size, the shared prefix from which the attention runs cascaded (0: never)
        self.cascade = {size: attn.cascade_min_prefix(size) for size in self.sizes}
        # keyed (size, row-length class, shared prefix class: 0 or cascade[size])
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        # per key: the model's logits_input (final hidden states, or at batch 1 with the
        # fused kernels the stream before the norm)
        self.outputs: dict[tuple[int, int, int],
                           torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        # the graphs return every row's hidden state: a decode step whose logits rows
        # differ (prompt logprobs of a one-token prompt, say) runs eagerly
        return batch.is_decode and batch.all_rows and 0 < batch.batch_size <= self.max_batch_size

    def _static_batch(self, size: int, max_seq_len: int, shared: int = 0) -> ForwardBatch:
        seq_lens = self.seq_lens[:size]
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size], req_pool_indices=self.req_pool_indices[:size],
            seq_lens=seq_lens, extend_prefix_lens=self.positions[:size],  # prefix = position
            extend_seq_lens=self.ones[:size], qo_indptr=self.arange[:size + 1],
            logits_indices=self.arange[:size],
            # host lists only size the launches (a bound on the lengths: the length
            # class's); decode kernels take the lengths from the device
            seq_lens_cpu=[max_seq_len] * size, extend_prefix_lens_cpu=[0] * size,
            extend_seq_lens_cpu=[1] * size, is_decode=True, all_rows=True,
            shared_prefix_len_cpu=shared, shared_prefix_len=self.shared_prefix)

    def _run(self, batch: ForwardBatch):
        self.req_to_token[batch.req_pool_indices, batch.positions] = batch.out_cache_loc.to(torch.int32)
        self.attn.prepare(batch)
        # the final norm inside the graph, unless the LM head's launch runs it (batch 1)
        return self.model.logits_input(self.model(batch, self.attn))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with _side_stream() as stream:
            for size in reversed(self.sizes):  # largest first: later ones reuse its pool
                for bound in reversed(self.len_classes[size]):
                    for shared in {0, self.cascade[size]}:
                        key = size, bound, shared
                        self.graphs[key], self.outputs[key] = _capture(
                            self._run, self._static_batch(size, bound, shared), self.pool,
                            stream)
        logger.info("captured CUDA graphs for decode batch sizes %s (row-length classes %s; "
                    "cascaded from a shared prefix of %s)", self.sizes,
                    sorted({c for cs in self.len_classes.values() for c in cs}),
                    sorted({c for c in self.cascade.values() if c}) or "never")

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
        classes = self.len_classes[size]
        bound = classes[min(bisect.bisect_left(classes, batch.max_seq_len), len(classes) - 1)]
        shared = self.cascade[size]
        if shared and batch.shared_prefix_len_cpu >= shared and batch.shared_prefix_len is not None:
            self.shared_prefix.copy_(batch.shared_prefix_len)
        else:
            shared = 0
        key = size, bound, shared
        self.graphs[key].replay()
        out = self.outputs[key]
        return out[:b] if isinstance(out, torch.Tensor) else (out[0][:b], out[1][:b])


class ExtendGraphRunner:
    """Graphs for extend batches of at most ``max_tokens`` tokens (module docstring).

    ``use_graphs=False`` keeps the padded static buffers and replays by running the same
    padded batch eagerly: what the CPU tests check the padding with, since CUDA graphs
    need a GPU.
    """

    def __init__(self, model: torch.nn.Module, attn, max_tokens: int, max_requests: int,
                 device: torch.device, pool=None, use_graphs: bool = True) -> None:
        self.model, self.attn = model, attn
        self.sizes = extend_capture_sizes(max_tokens)
        if not self.sizes:
            raise ValueError("ExtendGraphRunner needs max_tokens >= 1")
        self.max_requests = max(1, max_requests)
        n, r = self.sizes[-1], self.rows_for(self.sizes[-1])
        i64 = dict(dtype=torch.int64, device=device)
        # rows in ForwardBatch.token_inputs / request_inputs order: one copy each
        self.tokens = torch.zeros(3, n, **i64)  # input_ids, positions, out_cache_loc
        self.requests = torch.zeros(4, r, **i64)  # row, seq_len, prefix, extend len
        self.qo_indptr = torch.zeros(r + 1, **i64)
        self.logits_indices = torch.zeros(r, **i64)
        self.use_graphs = use_graphs
        # per (size, extend class): the graph and its model(batch) output
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if use_graphs:
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            self._capture_all()

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def rows_for(self, size: int) -> int:
        """Requests (and logits rows) a graph of ``size`` tokens has room for."""
        return min(size, self.max_requests)

    def size_for(self, num_tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def can_run(self, batch: ForwardBatch) -> bool:
        t = batch.num_tokens
        if not 0 < t <= self.max_tokens or batch.batch_size == 0:
            return False
        rows = self.rows_for(self.size_for(t))
        return batch.batch_size <= rows and batch.logits_indices.shape[0] <= rows

    @staticmethod
    def class_for(max_extend_len: int, size: int) -> int:
        return next(c for c in extend_classes(size) if c >= max_extend_len)

    def _static_batch(self, size: int, longest: int) -> ForwardBatch:
        r = self.rows_for(size)
        input_ids, positions, out_cache_loc = (buf[:size] for buf in self.tokens)
        rows, seq_lens, prefix_lens, extend_lens = (buf[:r] for buf in self.requests)
        return ForwardBatch(
            input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
            req_pool_indices=rows, seq_lens=seq_lens, extend_prefix_lens=prefix_lens,
            extend_seq_lens=extend_lens, qo_indptr=self.qo_indptr[:r + 1],
            logits_indices=self.logits_indices[:r],
            # host lists only size the launches: r requests, extends of up to `longest`
            # tokens; the kernels read the real lengths from the device
            seq_lens_cpu=[size] * r, extend_prefix_lens_cpu=[0] * r,
            extend_seq_lens_cpu=[longest] + [0] * (r - 1), is_decode=False, all_rows=False)

    def _run(self, batch: ForwardBatch):
        # the graph ends at the logits rows' residual stream, before the final norm: the
        # LM head runs outside it, as in an eager step (the norm inside the head's launch
        # for one row), so a graph and an eager step give the same logits
        self.attn.prepare(batch)
        return self.model(batch, self.attn)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with _side_stream() as stream:
            for size in reversed(self.sizes):  # largest first: later ones reuse its pool
                self._pad(size, 0, 0, 0)  # all padding: writes only the dummy slot
                for longest in reversed(extend_classes(size)):
                    key = (size, longest)
                    self.graphs[key], self.outputs[key] = _capture(
                        self._run, self._static_batch(size, longest), self.pool, stream)
        logger.info("captured CUDA graphs for extend steps of up to %s tokens", self.sizes)

    def _pad(self, size: int, t: int, b: int, nl: int) -> None:
        """Padding past the real t tokens, b requests and nl logits rows."""
        r = self.rows_for(size)
        if size > t:
            self.tokens[:, t:size].zero_()
        if r > b:
            self.requests[:, b:r].zero_()
            self.qo_indptr[b + 1:r + 1].fill_(t)
        if r > nl:
            self.logits_indices[nl:r].zero_()

    def load(self, batch: ForwardBatch) -> int:
        """Copy ``batch`` into the static buffers, padded; the captured size it fits."""
        t, b = batch.num_tokens, batch.batch_size
        nl = int(batch.logits_indices.shape[0])
        size = self.size_for(t)
        tokens, requests = batch.token_inputs, batch.request_inputs
        if tokens is not None and tokens.data_ptr() == batch.input_ids.data_ptr():
            self.tokens[:, :t].copy_(tokens)
        else:  # fields replaced after build: each from where it is now
            for buf, src in zip(self.tokens, (batch.input_ids, batch.positions,
                                              batch.out_cache_loc)):
                buf[:t].copy_(src)
        if requests is not None and requests.data_ptr() == batch.req_pool_indices.data_ptr():
            self.requests[:, :b].copy_(requests)
        else:
            for buf, src in zip(self.requests, (batch.req_pool_indices, batch.seq_lens,
                                                batch.extend_prefix_lens, batch.extend_seq_lens)):
                buf[:b].copy_(src)
        self.qo_indptr[:b + 1].copy_(batch.qo_indptr)
        self.logits_indices[:nl].copy_(batch.logits_indices)
        self._pad(size, t, b, nl)
        return size

    def replay(self, batch: ForwardBatch):
        """``model(batch)`` for the batch's logits rows (what ``compute_logits`` takes).
        The caller has recorded the batch's KV slots in ``req_to_token``."""
        nl = int(batch.logits_indices.shape[0])
        size = self.load(batch)
        key = (size, self.class_for(batch.max_extend_len, size))
        if self.use_graphs:
            self.graphs[key].replay()
            x, residual = self.outputs[key]
        else:
            x, residual = self._run(self._static_batch(*key))
        return x[:nl], residual[:nl]
