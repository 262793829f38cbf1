"""A node of the radix tree and the result of a prefix match (plain Python)."""
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
