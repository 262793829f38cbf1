"""A node of the radix tree, the result of a prefix match, and ``common_prefix_len``:
how a walk compares an edge with the tokens it looks for (plain Python).

What every part of the prefix cache shares, apart from the cache itself: its operations
(``radix_cache.py``), its tier moves (``tiers.py``), its eviction queue and its checks
(``radix_integrity.py``) all read these nodes, and the comparison is the one inner loop
of every match and insert (``intake`` uses it too, for a choice's tokens).
"""
from __future__ import annotations

from typing import NamedTuple


class TreeNode:
    __slots__ = ("key", "value", "host", "children", "parent", "lock_ref", "last_access",
                 "uses", "last_use", "gap", "depth", "loading", "ends_path",
                 "stamp", "counted")

    def __init__(self, key: list[int], value: list[int], parent: "TreeNode | None",
                 last_access: int, depth: int = 0) -> None:
        self.key = key  # token ids on the edge from parent to this node
        self.value = value  # device slot of each token of ``key``; [] when not on the device
        self.host: list[int] = []  # host block of each token; [] when not on the host
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access  # the cache's recency clock when last matched
        self.uses = 1  # policy statistics (eviction.py): requests that used the prefix,
        self.last_use = 0  # the use clock at the latest, the typical gap between uses
        self.gap = 0.0
        self.depth = depth  # tokens above the edge's first token
        self.loading = 0  # ticket of the HostLoad filling ``value``; 0 when none
        # a request's path ended here (the policy marks new leaves; the upper part of a
        # split is not an end): a leaf created below it continues that request
        self.ends_path = False
        # eviction_queue.py: bumped when the node's rank or candidacy may have changed
        # (older heap entries of it are stale), and the tokens it counts as never reused
        self.stamp = 0
        self.counted = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap tie-break
        return self.last_access < other.last_access


class MatchResult(NamedTuple):
    kv_indices: list[int]  # device slots of the matched prefix, one per token
    last_node: TreeNode  # deepest device-resident node of the match
    host_len: int = 0  # matched tokens past it whose KV is on the host only
    host_node: TreeNode | None = None  # deepest node of the match when host_len > 0

    @property
    def deepest(self) -> TreeNode:
        """Lock this while the match is in use (it pins the host part too)."""
        return self.host_node if self.host_node is not None else self.last_node


# below this many tokens left to search, compare token by token
_SCAN = 16


def common_prefix_len(key: list[int], token_ids: list[int], start: int = 0) -> int:
    """How many leading tokens of ``key`` equal ``token_ids[start:]``.

    Slices of lists compare in C: the whole stretch is compared at once (a match runs
    through whole edges but at most one), and where it differs the first difference is
    found by halving the stretch that holds it, not token by token in Python."""
    n = min(len(key), len(token_ids) - start)
    if type(key) is not type(token_ids):
        return _scan(key, token_ids, start, 0, n)
    if n == len(key):
        if key == token_ids[start:start + n]:
            return n
    elif key[:n] == token_ids[start:start + n]:
        return n
    lo, hi = 0, n  # key[:lo] matches; the first difference lies in [lo, hi)
    while hi - lo > _SCAN:
        mid = (lo + hi) // 2
        if key[lo:mid] == token_ids[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    return _scan(key, token_ids, start, lo, hi)


def _scan(key: list[int], token_ids: list[int], start: int, i: int, n: int) -> int:
    while i < n and key[i] == token_ids[start + i]:
        i += 1
    return i
