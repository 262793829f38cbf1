"""Moving radix-tree nodes between the device and host tiers (plain Python).

Eviction from the device takes unlocked device leaves in the policy's order. A victim
already on the host just gives its slots back. Otherwise its KV is saved to the host
when it ranks above what the host would have to give up for it (the host tier is
evicted by the same policy) and a later load could reach ``host_load_min_tokens`` (a
shorter host match is recomputed), else it is dropped, with any host-only nodes below it. The
tree is updated at once; the copies are queued as ``HostSave``/``HostLoad`` records in
the order the device side must run them (``take_copies``).

A node is a host candidate when it is unlocked and has a host copy, and either is also
on the device (dropping the copy loses nothing the device lacks) or has no children (a
host-only leaf; dropping it removes the node). Both tiers' candidates come from
``eviction_queue.EvictionCandidates`` (kept up to date by the tree's touches), not from
a walk of the tree.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable

from .eviction import ghost_key
from .eviction_queue import CandidateHeap, device_candidate, host_candidate
from .host_tier import HostCopy, HostLoad, HostSave
from .radix_node import MatchResult, TreeNode


class TierMover:
    def __init__(self, cache) -> None:
        self.cache = cache  # the RadixCache whose tree this moves (it owns the accounting)
        self._copies: list[HostCopy] = []
        self._tickets = itertools.count(1)
        self._loads: dict[int, TreeNode] = {}  # ticket -> deepest node it fills
        # totals since start (Engine.stats)
        self.saved_tokens = 0
        self.loaded_tokens = 0

    def take_copies(self) -> list[HostCopy]:
        out, self._copies = self._copies, []
        return out

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    # ------------------------------------------------------------------ device eviction
    def evict(self, num_tokens: int) -> int:
        cache = self.cache
        policy, index = cache.policy, cache.candidates
        now = cache.use_clock
        index.refresh()
        crowded = self.crowded()

        def entry(node: TreeNode) -> tuple:
            # equal priority: the most recently used goes first (what was there stays;
            # LRU's priorities are all distinct)
            return index.entry(node, policy.priority(node, now, crowded))

        def push(tier: CandidateHeap, node: TreeNode) -> None:
            if last_victim:
                # nothing more is popped in this eviction: the node waits unscored for
                # the next one, which scores it then (the same rank if nothing moved) or
                # rebuilds the heap
                tier.add(node)
            else:
                # scored now: the model may have learned from a drop since the start
                tier.push(entry(node), policy.score_epoch(now, crowded))

        def push_host(node: TreeNode) -> None:
            push(index.host, node)

        heap = index.device.prepare(policy.score_epoch(now, crowded), entry)
        host_heap: list | None = None
        freed = 0
        last_victim = False
        while freed < num_tokens and heap:
            prio, _, _, stamp, leaf = heapq.heappop(heap)
            if stamp != leaf.stamp or not device_candidate(leaf):
                continue  # stale, or queued twice (a trimmed head is also its tail's parent)
            keep = len(leaf.key) - (num_tokens - freed)
            last_victim = freed + len(leaf.key) >= num_tokens
            if keep > 0 and policy.trims:
                # only the tail that is needed goes; the head stays cached as a leaf
                upper = cache._split(leaf, keep)
                push(index.device, upper)
            freed += len(leaf.value)
            cache.evictable_size -= len(leaf.key)
            if cache.host is not None and not leaf.host and self._loadable(leaf):
                # the host's candidates are ranked only once the host is full: ranking
                # every host copy costs more than the rest of an eviction
                if host_heap is None and not cache.host.can_alloc(len(leaf.key)):
                    host_heap = index.host.prepare(policy.score_epoch(now, crowded), entry)
                if self._make_host_room(len(leaf.key), prio,
                                        host_heap if host_heap is not None else [], push_host):
                    self._save(leaf)
            cache.slots.free(leaf.value)
            leaf.value = []
            index.touch(leaf)
            parent = leaf.parent
            if leaf.host:
                if host_heap is None:
                    index.host.add(leaf)  # a candidate if the heap is built later
                elif not leaf.children:
                    push_host(leaf)
            else:
                self._drop_subtree(leaf, now)
            if parent is not cache.root and device_candidate(parent):
                push(index.device, parent)
        return freed

    def crowded(self) -> bool:
        """Whether never-reused prefixes hold more than the policy's probation share of
        what is cached (either tier); the candidates must be refreshed."""
        cache = self.cache
        total = cache.evictable_size + cache.protected_size + cache.host_size
        return cache.candidates.new_tokens > cache.policy.probation_share * total

    def check_candidates(self, nodes: list[TreeNode]) -> None:
        """The candidate heaps against a walk of the tree (``RadixCache.check_integrity``)."""
        cache = self.cache
        cache.candidates.refresh()
        now, crowded = cache.use_clock, self.crowded()
        cache.candidates.check(nodes, cache.policy.score_epoch(now, crowded),
                               lambda n: (cache.policy.priority(n, now, crowded),
                                          -n.last_access))

    def _loadable(self, node: TreeNode) -> bool:
        """Whether a later load could bring back ``host_load_min_tokens`` with ``node``:
        even with its whole path on the host it would be shorter, and a shorter host
        match is recomputed, so a copy would never be used."""
        return node.depth + len(node.key) >= self.cache.host_load_min_tokens

    def _save(self, node: TreeNode) -> None:
        blocks = self.cache.host.alloc(len(node.key))
        self._copies.append(HostSave(node.value, blocks))
        node.host = blocks
        self.cache.host_size += len(blocks)
        self.cache.candidates.touch(node)
        self.saved_tokens += len(blocks)

    # ------------------------------------------------------------------ host eviction
    def _make_host_room(self, n: int, victim_priority: float, heap: list,
                        push_host: Callable[[TreeNode], None]) -> bool:
        """Free ``n`` host blocks by dropping host copies that rank below the victim;
        False (nothing dropped) when those are not enough."""
        host = self.cache.host
        if n > host.size:
            return False
        taken: list[tuple] = []
        gain = host.available_size()
        seen: set[int] = set()
        while gain < n and heap and heap[0][0] < victim_priority:
            entry = heapq.heappop(heap)
            node = entry[4]
            # entries go stale as the tree changes, and a node may be queued twice
            if entry[3] == node.stamp and host_candidate(node) and id(node) not in seen:
                seen.add(id(node))
                taken.append(entry)
                gain += len(node.host)
        if gain < n:
            for entry in taken:
                heapq.heappush(heap, entry)
            return False
        now = self.cache.use_clock
        for *_, node in taken:
            self._drop_host(node, now, push_host)
        return True

    def _drop_host(self, node: TreeNode, now: int, push_host: Callable[[TreeNode], None]) -> None:
        cache = self.cache
        cache.host.free(node.host)
        cache.host_size -= len(node.host)
        node.host = []
        cache.candidates.touch(node)
        if node.value:
            return  # still on the device
        parent = node.parent
        self._forget(node, now)
        if parent is not cache.root and host_candidate(parent):
            push_host(parent)

    def _drop_subtree(self, node: TreeNode, now: int) -> None:
        """Remove ``node`` (KV on neither tier now) with the host-only nodes below it."""
        cache = self.cache
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            stack.extend(below.children.values())
            cache.host.free(below.host)
            cache.host_size -= len(below.host)
            below.host = []  # gone: stale heap entries must not see a candidate
            self._forget(below, now, unlink=False)
        self._forget(node, now)

    def _forget(self, node: TreeNode, now: int, unlink: bool = True) -> None:
        cache = self.cache
        if cache.policy.remembers:
            before = _tokens_before(node, cache.root)
            cache.policy.on_drop(node, ghost_key(before, node.key, node.depth), now)
        if unlink:
            del node.parent.children[node.key[0]]
        cache.candidates.touch(node)

    # ------------------------------------------------------------------ loads
    def start_load(self, match: MatchResult, slots: list[int]) -> int:
        cache = self.cache
        nodes = []
        node = match.host_node
        while node is not match.last_node:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        assert len(slots) == match.host_len == sum(len(n.key) for n in nodes)
        ticket = next(self._tickets)
        blocks: list[int] = []
        offset = 0
        for node in nodes:
            cache._set_device(node, slots[offset:offset + len(node.key)])
            offset += len(node.key)
            blocks += node.host
            node.loading = ticket
        self._copies.append(HostLoad(ticket, blocks, list(slots)))
        cache.lock(match.host_node)  # the load pins its nodes until it is done
        self._loads[ticket] = match.host_node
        self.loaded_tokens += len(slots)
        return ticket

    def finish_load(self, ticket: int) -> None:
        deepest = self._loads.pop(ticket)
        node = deepest
        while node is not self.cache.root and node.loading == ticket:
            node.loading = 0
            node = node.parent
        self.cache.unlock(deepest)


def _tokens_before(node: TreeNode, root: TreeNode, want: int = 32) -> list[int]:
    """The last ``want`` tokens on the path above ``node`` (or fewer near the root)."""
    parts: list[list[int]] = []
    total = 0
    node = node.parent
    while node is not root and total < want:
        parts.append(node.key)
        total += len(node.key)
        node = node.parent
    out = [t for part in reversed(parts) for t in part]
    return out[-want:]
