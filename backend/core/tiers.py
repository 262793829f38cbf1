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
host-only leaf; dropping it removes the node).
"""
from __future__ import annotations

import heapq
import itertools

from .eviction import ghost_key
from .host_tier import HostCopy, HostLoad, HostSave
from .radix_node import MatchResult, TreeNode


class TierMover:
    def __init__(self, cache) -> None:
        self.cache = cache  # the RadixCache whose tree this moves (it owns the accounting)
        self._copies: list[HostCopy] = []
        self._tickets = itertools.count(1)
        self._loads: dict[int, TreeNode] = {}  # ticket -> deepest node it fills
        self._seq = itertools.count()  # heap tie-break after priority and recency
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
        now = cache.use_clock
        leaves, host_nodes, crowded = self._survey()
        heap = [self._entry(n, now, crowded) for n in leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        host_heap: list | None = None
        freed = 0
        while freed < num_tokens and heap:
            prio, _, _, leaf = heapq.heappop(heap)
            if not leaf.value or any(c.value for c in leaf.children.values()):
                continue  # queued twice (a trimmed head is also its tail's parent)
            keep = len(leaf.key) - (num_tokens - freed)
            if keep > 0 and cache.policy.trims:
                # only the tail that is needed goes; the head stays cached as a leaf
                upper = cache._split(leaf, keep)
                heapq.heappush(heap, self._entry(upper, now, crowded))
            freed += len(leaf.value)
            cache.evictable_size -= len(leaf.key)
            if cache.host is not None and not leaf.host and self._loadable(leaf):
                # the host's candidates are ranked only once the host is full: ranking
                # every host copy costs more than the rest of an eviction
                if host_heap is None and not cache.host.can_alloc(len(leaf.key)):
                    host_heap = [self._entry(n, now, crowded) for n in host_nodes
                                 if _host_candidate(n)]
                    heapq.heapify(host_heap)
                if self._make_host_room(len(leaf.key), prio, host_heap or [], crowded):
                    self._save(leaf)
            cache.slots.free(leaf.value)
            leaf.value = []
            parent = leaf.parent
            if leaf.host:
                if host_heap is None:
                    host_nodes.append(leaf)  # a candidate if the heap is built later
                elif not leaf.children:
                    heapq.heappush(host_heap, self._entry(leaf, now, crowded))
            else:
                self._drop_subtree(leaf, now)
            if (parent is not cache.root and parent.lock_ref == 0
                    and not any(c.value for c in parent.children.values())):
                heapq.heappush(heap, self._entry(parent, now, crowded))
        return freed

    def _entry(self, node: TreeNode, now: int, crowded: bool) -> tuple:
        # equal priority: the most recently used goes first (what was there stays; LRU's
        # priorities are all distinct)
        return (self.cache.policy.priority(node, now, crowded), -node.last_access,
                next(self._seq), node)

    def _survey(self) -> tuple[list[TreeNode], list[TreeNode], bool]:
        """One walk of the tree: the device leaves, the nodes with a host copy, and
        whether never-reused prefixes hold more than their share of what is cached."""
        leaves, host_nodes = [], []
        new = total = 0
        stack = list(self.cache.root.children.values())
        pop, push = stack.pop, stack.extend
        while stack:  # (the hot loop of an eviction: one pass, few calls)
            node = pop()
            children = node.children
            n = 0
            if node.value:
                n = len(node.key)
                if not children or not any(c.value for c in children.values()):
                    leaves.append(node)
            if node.host:
                n += len(node.key)
                host_nodes.append(node)
            if children:
                push(children.values())
            total += n
            if node.uses < 2:
                new += n
        return leaves, host_nodes, new > self.cache.policy.probation_share * total

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
        self.saved_tokens += len(blocks)

    # ------------------------------------------------------------------ host eviction
    def _make_host_room(self, n: int, victim_priority: float, heap: list, crowded: bool) -> bool:
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
            node = entry[3]
            # entries go stale as the tree changes, and a node may be queued twice
            if _host_candidate(node) and id(node) not in seen:
                seen.add(id(node))
                taken.append(entry)
                gain += len(node.host)
        if gain < n:
            for entry in taken:
                heapq.heappush(heap, entry)
            return False
        now = self.cache.use_clock
        for *_, node in taken:
            self._drop_host(node, now, heap, crowded)
        return True

    def _drop_host(self, node: TreeNode, now: int, heap: list, crowded: bool) -> None:
        cache = self.cache
        cache.host.free(node.host)
        cache.host_size -= len(node.host)
        node.host = []
        if node.value:
            return  # still on the device
        parent = node.parent
        self._forget(node, now)
        if parent is not cache.root and _host_candidate(parent):
            heapq.heappush(heap, self._entry(parent, now, crowded))

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


def _host_candidate(node: TreeNode) -> bool:
    return bool(node.host) and node.lock_ref == 0 and (bool(node.value) or not node.children)


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
