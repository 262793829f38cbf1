"""How much of their KV the rows of a decode batch share: the input of cascade attention.

Requests that matched the same cached prefix in the radix tree hold the same pool slots
for it, so the batch's shared prefix is the longest common prefix of the rows' slot
lists (``Req.kv_indices``), cut below every row's new token. Attention can then read
that prefix once for the whole batch instead of once per row.

The scan costs a slice comparison per row; a decode batch keeps the same requests for
many steps, and for the same requests the answer only changes where the shortest row
limits it, so the last batch's answer is kept and reused while the requests are the same.
"""
from __future__ import annotations

from .request import Req


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a[:limit]`` and ``b[:limit]``: slice
    comparisons (C speed), halving the range on a mismatch."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SharedPrefixTracker:
    """The shared prefix of each decode batch, reusing the last batch's scan."""

    def __init__(self) -> None:
        self._rids: tuple[str, ...] = ()
        self._shared = 0  # the last batch's shared prefix
        self._capped = False  # whether its shortest row cut it (it may grow with the rows)

    def shared_len(self, reqs: list[Req], positions: list[int]) -> int:
        """Leading positions whose slots every request of the batch shares, below every
        request's new token (at ``positions[i]``); 0 for fewer than two requests."""
        if len(reqs) < 2:
            return 0
        limit = min(positions)
        rids = tuple(r.rid for r in reqs)
        if rids != self._rids or self._capped:
            # new requests, or the last answer was cut by the shortest row: scan again
            first = reqs[0].kv_indices
            shared = limit
            for r in reqs[1:]:
                shared = common_prefix_len(first, r.kv_indices, shared)
                if shared == 0:
                    break
            self._rids, self._shared, self._capped = rids, shared, shared == limit
        return min(self._shared, limit)
