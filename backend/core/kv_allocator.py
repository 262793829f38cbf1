"""Who owns which KV slot and which request-table row: free lists in plain Python.

The device tensors these index (``memory_pool.KVPool``, ``memory_pool.ReqToTokenPool``)
live on the model runner's side; the scheduler and the radix cache hand out and take
back integers only. Slot 0 and table row 0 are never handed out: padded batch entries
(CUDA-graph padding) write there harmlessly.

Each allocator splits check from commit: ``can_alloc`` only looks, ``alloc`` takes (and
is only called after a check said yes), so no check ever changes state.
"""
from __future__ import annotations


class KVSlotAllocator:
    """Token-granular KV slots ``1..size``."""

    def __init__(self, size: int) -> None:
        self.size = size  # usable slots (slot 0 is extra, never handed out)
        self._free: list[int] = list(range(size, 0, -1))  # pop() hands out low slots first

    def available_size(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots; the caller checked ``can_alloc(n)``."""
        if n > len(self._free):
            raise RuntimeError(f"{n} KV slots asked for, {len(self._free)} free")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def free_slots(self) -> list[int]:
        return list(self._free)


class TableRowAllocator:
    """Rows ``1..num_rows - 1`` of the request-to-token table, one per running request."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free: list[int] = list(range(num_rows - 1, 0, -1))

    def available_size(self) -> int:
        return len(self._free)

    def can_alloc(self) -> bool:
        return bool(self._free)

    def alloc(self) -> int:
        """A free row; the caller checked ``can_alloc()``."""
        if not self._free:
            raise RuntimeError("no request-table row free")
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)
