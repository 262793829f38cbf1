"""RadixAttention's prefix cache: a token-granular radix tree over KV slots.

Each edge holds a run of token ids and the KV slot of each of those tokens. A node's
``lock_ref`` counts the running requests whose matched prefix passes through it; only
nodes with ``lock_ref == 0`` can be evicted, leaves first, least recently used first.
A parent becomes evictable when its last child is gone, so shared trunks outlive the
branches that hang off them.

Slot accounting (checked by ``check_integrity``)::

    slots.size == free slots + slots in the tree + slots owned by running requests
                                (evictable + protected)   (not yet inserted)

``NoCache`` keeps the same interface with an always-empty tree (the cache-off baseline).
"""
from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

from .kv_allocator import KVSlotAllocator


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: list[int], parent: "TreeNode | None",
                 last_access: int) -> None:
        self.key = key  # token ids on the edge from parent to this node
        self.value = value  # KV slot of each token of ``key``
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access  # the cache's LRU clock when last matched

    def __lt__(self, other: "TreeNode") -> bool:  # for heapq
        return self.last_access < other.last_access


class MatchResult(NamedTuple):
    kv_indices: list[int]  # slots of the matched prefix, one per token
    last_node: TreeNode  # deepest node of the match; lock it while the prefix is in use


class RadixCache:
    def __init__(self, slots: KVSlotAllocator) -> None:
        self.slots = slots  # evicted slots go back here
        # monotonic LRU timestamps; ties broken by creation order
        self._clock = itertools.count()
        self.root = TreeNode([], [], None, next(self._clock))
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes

    @property
    def enabled(self) -> bool:
        return True

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---------------------------------------------------------------- match / insert
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids``; splits an edge if the match ends inside it."""
        node, matched = self.root, []
        node.last_access = next(self._clock)
        i = 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            n = common_prefix_len(child.key, token_ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            matched.extend(child.value)
            child.last_access = next(self._clock)
            node = child
            i += n
        return MatchResult(matched, node)

    def insert(self, token_ids: list[int], kv_indices: list[int]) -> int:
        """Insert a sequence and its slots; returns how many leading tokens were already
        cached. The caller owns (and must free) its own slots for those tokens, which the
        tree does not take."""
        assert len(token_ids) == len(kv_indices)
        node, i = self.root, 0
        node.last_access = next(self._clock)
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                leaf = TreeNode(list(token_ids[i:]), list(kv_indices[i:]), node, next(self._clock))
                node.children[token_ids[i]] = leaf
                self.evictable_size += len(leaf.key)
                return i
            n = common_prefix_len(child.key, token_ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(self._clock)
            node = child
            i += n
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        return upper

    # ---------------------------------------------------------------- pinning
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
            node = node.parent

    # ---------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, LRU first (or as many
        as are evictable). Returns the number freed."""
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.slots.free(leaf.value)
            freed += len(leaf.value)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def reset(self) -> None:
        for node in self._nodes():
            self.slots.free(node.value)
        self.root.children = {}
        self.evictable_size = self.protected_size = 0

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ---------------------------------------------------------------- checking
    def cached_slots(self) -> list[int]:
        return [slot for node in self._nodes() for slot in node.value]

    def check_integrity(self) -> None:
        evictable = protected = 0
        for node in self._nodes():
            assert len(node.key) == len(node.value) > 0, "empty or ragged edge"
            assert node.parent.children.get(node.key[0]) is node, "broken parent link"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "child locked more than its parent"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self.evictable_size, f"evictable {evictable} != {self.evictable_size}"
        assert protected == self.protected_size, f"protected {protected} != {self.protected_size}"


class NoCache(RadixCache):
    """The cache-off baseline: nothing matches and nothing is kept."""

    @property
    def enabled(self) -> bool:
        return False

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult([], self.root)

    def insert(self, token_ids: list[int], kv_indices: list[int]) -> int:
        return len(token_ids)  # "all present": the caller frees every slot it passed


_CHUNK = 32


def common_prefix_len(key: list[int], token_ids: list[int], start: int = 0) -> int:
    """How many leading tokens of ``key`` equal ``token_ids[start:]``."""
    n = min(len(key), len(token_ids) - start)
    i = 0
    if type(key) is type(token_ids):  # slices compare in C: whole chunks first
        while i + _CHUNK <= n and key[i:i + _CHUNK] == token_ids[start + i:start + i + _CHUNK]:
            i += _CHUNK
    while i < n and key[i] == token_ids[start + i]:
        i += 1
    return i
