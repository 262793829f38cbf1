"""The host-memory tier's bookkeeping: host KV blocks and the copies between tiers.

Host blocks are token-granular, like device slots: block ``b`` holds one token's K and V
of every layer (``host_memory.HostKVPool``). The allocator hands out blocks in contiguous
runs where it can, because the device side moves each run with one copy.

The radix tree decides what moves; the copies are plain records (``HostSave``,
``HostLoad``) that travel in the step's plan to the device side, which runs them in plan
order on its copy stream. Plain Python: nothing here touches a tensor.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple


class HostSave(NamedTuple):
    """Copy the KV of ``device_slots`` into ``host_blocks`` (a node leaving the device).
    The slots may be handed out again in the same step: the device side reads them
    before anything later in its stream writes them."""

    device_slots: list[int]
    host_blocks: list[int]


class HostLoad(NamedTuple):
    """Copy ``host_blocks`` into ``device_slots`` (a host-tier hit going back to the
    device); the scheduler keeps requests that need it waiting until ``ticket`` is done."""

    ticket: int
    host_blocks: list[int]
    device_slots: list[int]


HostCopy = HostSave | HostLoad


class HostBlockAllocator:
    """Host blocks ``0..size - 1`` as sorted free runs (start, length), merged on free.
    ``alloc`` takes the smallest run that fits, else the largest runs until enough."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0] if size else []  # sorted run starts
        self._lengths: dict[int, int] = {0: size} if size else {}
        self._free = size

    def available_size(self) -> int:
        return self._free

    def can_alloc(self, n: int) -> bool:
        return n <= self._free

    def alloc(self, n: int) -> list[int]:
        """``n`` free blocks; the caller checked ``can_alloc(n)``."""
        if n > self._free:
            raise RuntimeError(f"{n} host blocks asked for, {self._free} free")
        out: list[int] = []
        fits = [s for s in self._starts if self._lengths[s] >= n]
        if fits:
            start = min(fits, key=lambda s: self._lengths[s])
            out.extend(self._take(start, n))
        while len(out) < n:
            start = max(self._starts, key=lambda s: self._lengths[s])
            out.extend(self._take(start, min(n - len(out), self._lengths[start])))
        self._free -= n
        return out

    def _take(self, start: int, n: int) -> range:
        length = self._lengths.pop(start)
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i]
        if n < length:
            self._starts.insert(i, start + n)
            self._lengths[start + n] = length - n
        return range(start, start + n)

    def free(self, blocks: list[int]) -> None:
        for start, length in runs(sorted(blocks)):
            self._put(start, length)
        self._free += len(blocks)

    def _put(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start + length:  # merge the next run
            length += self._lengths.pop(self._starts.pop(i))
        if i > 0 and (prev := self._starts[i - 1]) + self._lengths[prev] == start:
            self._lengths[prev] += length  # merge into the previous run
            return
        self._starts.insert(i, start)
        self._lengths[start] = length

    def free_blocks(self) -> list[int]:
        return [b for s in self._starts for b in range(s, s + self._lengths[s])]


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Consecutive stretches of ``blocks`` (in the given order) as (start, length)."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out
