"""The host-memory tier on the device side: a pinned KV pool and the copies to and from it.

Layout: host block ``b`` holds one token's K and V for every layer, so a run of
consecutive blocks is one contiguous stretch of memory and moves with one copy::

    HostKVPool.buffer[block, layer, 0 (K) | 1 (V), kv_head, head_dim]

``KVMover.run`` executes a plan's ``HostSave``/``HostLoad`` records: all saves as one
batch, then all loads as one (the host cost of a copy is per batch, not per record:
slot numbers through a pinned ring, one gather or scatter of every layer, one copy per
run of consecutive host blocks). On CUDA:

* the saves gather the slots' KV into a staging tensor on the compute stream (in stream
  order after the forward passes that wrote it, and before any later one that reuses the
  slots), then copy it to pinned host memory on the copy stream;
* the loads wait (on the device) for the compute stream's work so far, copy host -> a
  staging tensor -> the slots on the copy stream, and record an event; the host polls
  the event (``finished_loads``) and never waits on a copy while there is work to step.

One copy stream runs every save and load in order, so a load of blocks a save has just
written, or a save into blocks a load is still reading, is ordered by the stream.
On CPU the same records are plain tensor copies, done at once.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from collections import deque
from typing import NamedTuple

import numpy as np
import torch

from .config import EngineConfig
from .fp8 import FP8_DTYPE
from .host_tier import HostCopy, HostLoad, HostSave
from .memory_pool import KVPool
from .transfer import HostToDevice

logger = logging.getLogger(__name__)

# the host tier takes at most this share of the host memory that is free at start-up
HOST_MEMORY_SHARE = 0.25


class HostKVPool:
    """KV of ``size`` tokens in host memory (pinned when the KV pool is on a GPU)."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin: bool) -> None:
        self.size = size
        shape = (size, num_layers, 2, num_kv_heads, head_dim)
        dtype = _raw_dtype(dtype)
        self.buffer = torch.empty(shape, dtype=dtype)
        if pin and _pin(self.buffer):
            # Unregister before the buffer's memory goes back to the allocator: a later
            # allocation at the same address (the next engine in this process) could not
            # be registered again ("resource already mapped").
            weakref.finalize(self, _unpin, self.buffer.data_ptr())
        elif pin:
            self.buffer = torch.empty(shape, dtype=dtype, pin_memory=True)

    @staticmethod
    def tokens_for(config: EngineConfig, device_tokens: int, bytes_per_token: int) -> int:
        """The host tier's size: ``host_cache_tokens``, else ``host_cache_ratio`` times the
        device pool; never more than HOST_MEMORY_SHARE of the free host memory."""
        if not config.enable_radix_cache:
            return 0
        want = config.host_cache_tokens
        if want is None:
            want = int(config.host_cache_ratio * device_tokens)
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cap = int(HOST_MEMORY_SHARE * free // bytes_per_token)
        if want > cap:
            logger.warning("host KV tier: %d tokens wanted, %d fit in %.1f GiB of free host "
                           "memory", want, cap, free / 2**30)
        return max(min(want, cap), 0)


class _Load(NamedTuple):
    tickets: list[int]  # the loads of one plan, copied together
    started: torch.cuda.Event
    done: torch.cuda.Event


class KVMover:
    """Runs host-tier copies; reports finished loads; counts bytes and load time."""

    def __init__(self, kv_pool: KVPool, host_pool: HostKVPool | None, device: torch.device) -> None:
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # slot numbers go to the device through a pinned ring (no fresh pinned buffer
        # per copy, no wait on the device queue)
        self._to_device = HostToDevice(device)
        k = kv_pool.k_buffer[0]
        self.token_bytes = 2 * len(kv_pool.k_buffer) * k[0].numel() * k.element_size()
        self._in_flight: deque[_Load] = deque()
        self._done: list[int] = []  # loads finished at once (CPU), not reported yet
        # totals since start (Engine.stats)
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.load_seconds = 0.0
        self.loads = 0
        self.copy_batches = 0  # gathers + scatters issued (a plan's saves are one, its loads one)

    @property
    def loads_pending(self) -> bool:
        return bool(self._in_flight or self._done)

    def run(self, copies: list[HostCopy]) -> None:
        """A plan's copies: all its saves as one batch, then all its loads as one. Same
        result as plan order: a load writes slots a save of the plan may have read
        (saves first), and reads blocks a save may have written; a save never touches
        what a load of the plan uses (loading nodes are locked: neither their slots
        nor their blocks are given out)."""
        saves = [c for c in copies if isinstance(c, HostSave)]
        loads = [c for c in copies if isinstance(c, HostLoad)]
        if saves:
            self._save(saves)
        if loads:
            self._load(loads)

    def finished_loads(self) -> list[int]:
        """Tickets of the loads done since the last call (never waits)."""
        out, self._done = self._done, []
        while self._in_flight and self._in_flight[0].done.query():  # one stream: in order
            load = self._in_flight.popleft()
            self.load_seconds += load.started.elapsed_time(load.done) / 1000
            out.extend(load.tickets)
        return out

    def wait_for_load(self) -> None:
        """Block until the oldest load is done (only when nothing else can step)."""
        if self._in_flight:
            self._in_flight[0].done.synchronize()

    # ------------------------------------------------------------------ copies
    def _save(self, saves: list[HostSave]) -> None:
        # A block the host tier gave up and handed out again within the plan may be the
        # target of two saves: the later one holds what the tree says it holds.
        target = {}
        for save in saves:
            target.update(zip(save.host_blocks, save.device_slots))
        blocks = sorted(target)  # consecutive blocks: one copy each run
        staged = self._gather(self._index([target[b] for b in blocks]))
        self.copy_batches += 1
        host = self.host_pool.buffer
        if self.copy_stream is None:
            for start, offset, length in _runs(blocks):
                host[start:start + length].copy_(staged[offset:offset + length])
        else:
            gathered = torch.cuda.Event()
            gathered.record()
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(gathered)
                for start, offset, length in _runs(blocks):
                    host[start:start + length].copy_(staged[offset:offset + length],
                                                     non_blocking=True)
            staged.record_stream(self.copy_stream)  # kept until the copy has read it
        self.bytes_to_host += len(blocks) * self.token_bytes

    def _load(self, loads: list[HostLoad]) -> None:
        blocks = [b for load in loads for b in load.host_blocks]
        slots = [s for load in loads for s in load.device_slots]
        tickets = [load.ticket for load in loads]
        self.loads += len(loads)
        self.copy_batches += 1
        self.bytes_to_device += len(blocks) * self.token_bytes
        if self.copy_stream is None:
            started = time.perf_counter()
            self._scatter(self._index(slots), self._stage(blocks, False))
            self.load_seconds += time.perf_counter() - started
            self._done.extend(tickets)
            return
        compute_so_far = torch.cuda.Event()
        compute_so_far.record()  # the slots' previous users have run
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(compute_so_far)
            started = torch.cuda.Event(enable_timing=True)
            started.record()
            self._scatter(self._index(slots), self._stage(blocks, True))
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        self._in_flight.append(_Load(tickets, started, done))

    def _index(self, slots: list[int]) -> torch.Tensor:
        """Slot numbers as a tensor on the device, on the current stream."""
        return self._to_device(slots, torch.int64)

    def _gather(self, index: torch.Tensor) -> torch.Tensor:
        """[n, layers, 2, kv_heads, head_dim]: the KV of ``index``'s slots, every layer."""
        pool = self.kv_pool
        parts = [_raw(t) for k, v in zip(pool.k_buffer, pool.v_buffer)
                 for t in (k[index], v[index])]
        n, heads, dim = parts[0].shape
        return torch.stack(parts, dim=1).view(n, len(pool.k_buffer), 2, heads, dim)

    def _stage(self, blocks: list[int], non_blocking: bool) -> torch.Tensor:
        host = self.host_pool.buffer
        staged = torch.empty((len(blocks), *host.shape[1:]), dtype=host.dtype, device=self.device)
        for start, offset, length in _runs(blocks):
            staged[offset:offset + length].copy_(host[start:start + length],
                                                 non_blocking=non_blocking)
        return staged

    def _scatter(self, index: torch.Tensor, staged: torch.Tensor) -> None:
        pool = self.kv_pool
        for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
            _raw(k).index_copy_(0, index, staged[:, layer, 0])
            _raw(v).index_copy_(0, index, staged[:, layer, 1])


def _raw_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float8 KV moves as its bytes (``_raw``); other dtypes as they are."""
    return torch.uint8 if dtype == FP8_DTYPE else dtype


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as ``_raw_dtype``: some copy kernels (index_copy_ on CPU) have no
    float8 version, and a copy of bytes is exact whatever they mean."""
    return t.view(_raw_dtype(t.dtype))


def _pin(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` where it lies; False when that is not available. (Allocating
    with ``pin_memory=True`` goes through torch's caching host allocator, which may round
    the size up to a power of two: tens of GiB more for a large tier.)"""
    started = time.perf_counter()
    nbytes = buffer.numel() * buffer.element_size()
    try:
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    except (AttributeError, RuntimeError) as exc:
        logger.warning("host KV tier: cudaHostRegister unavailable (%s); allocating pinned", exc)
        return False
    if int(err) != 0:
        raise RuntimeError(f"could not pin {nbytes / 2**30:.1f} GiB for the host KV tier "
                           f"(cudaHostRegister: {err}); lower host_cache_ratio")
    logger.info("host KV tier: pinned %.1f GiB in %.1f s", nbytes / 2**30,
                time.perf_counter() - started)
    return True


def _unpin(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive stretches of ``blocks`` as (first block, offset in the list, length)."""
    if not blocks:
        return []
    a = np.asarray(blocks, dtype=np.int64)
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(a)]))
    return [(int(a[s]), int(s), int(e - s)) for s, e in zip(starts, ends)]
