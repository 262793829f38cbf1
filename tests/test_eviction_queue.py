"""The eviction candidate heaps choose what a walk of the whole tree would choose.

Two caches get the same random operations (inserts, matches, pinned requests, host loads,
evictions of random sizes, resets). One keeps its candidates in the heaps of
``eviction_queue.py``; the other finds them by brute force, walking the tree at every
eviction and scoring every candidate anew (what eviction did before the heaps). After
every operation the two trees, allocators and planned copies must be identical (the
same victims, trimmed at the same tokens, saved to the same host blocks, in the same
order), and ``check_integrity`` holds (it checks the heaps against a walk).
"""
from __future__ import annotations

import heapq
import random

import pytest

from backend.core.eviction import AdaptivePolicy, LRUPolicy, make_policy
from backend.core.eviction_queue import host_candidate
from backend.core.host_tier import HostBlockAllocator
from backend.core.kv_allocator import KVSlotAllocator
from backend.core.radix_cache import RadixCache


class WalkHeap:
    """A tier's candidates as the walk found them: a snapshot at the eviction's start
    (plus what the eviction adds), every one scored when the heap is prepared."""

    def __init__(self, is_candidate) -> None:
        self.is_candidate = is_candidate
        self.snapshot: list = []
        self.heap: list = []

    def add(self, node) -> None:
        self.snapshot.append(node)

    def prepare(self, epoch, entry) -> list:
        self.heap = [entry(n) for n in self.snapshot if self.is_candidate(n)]
        heapq.heapify(self.heap)
        return self.heap

    def push(self, entry, epoch) -> None:
        heapq.heappush(self.heap, entry)


class WalkCandidates:
    """The brute-force reference for ``EvictionCandidates``: no state between evictions."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self.device = WalkHeap(lambda n: bool(n.value) and n.lock_ref == 0 and
                               not any(c.value for c in n.children.values()))
        self.host = WalkHeap(host_candidate)
        self.new_tokens = 0
        self.seq = 0

    def touch(self, node) -> None:
        pass

    def refresh(self) -> None:
        nodes = self.cache.nodes()
        self.device.snapshot = [n for n in nodes if n.value]
        self.host.snapshot = [n for n in nodes if n.host]
        self.new_tokens = sum(len(n.key) * (bool(n.value) + bool(n.host))
                              for n in nodes if n.uses < 2)

    def entry(self, node, priority: float) -> tuple:
        self.seq += 1
        return (priority, -node.last_access, self.seq, node.stamp, node)

    def reset(self) -> None:
        pass

    def check(self, nodes, epoch, entry) -> None:
        pass


def make_cache(policy: str, device: int, host: int, brute_force: bool) -> RadixCache:
    cache = RadixCache(KVSlotAllocator(device), make_policy(policy, device + host),
                       HostBlockAllocator(host) if host else None, host_load_min_tokens=2)
    if brute_force:
        cache.candidates = WalkCandidates(cache)
    return cache


class Driver:
    """Serves requests as the scheduler does (match, pin, make room, load the host part,
    record the use, insert, unpin later), with random evictions and unpins between."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self.running: list = []  # (node pinned, kv owned, cached length) per request
        self.copies: list = []

    def request(self, tokens: list[int]) -> None:
        cache = self.cache
        match = cache.match_prefix(tokens)
        cache.lock(match.deepest)
        cached = len(match.kv_indices) + match.host_len
        need = match.host_len + len(tokens) - cached
        short = need - cache.slots.available_size()
        if short > 0:
            cache.evict(short)
        if not cache.slots.can_alloc(need):
            cache.unlock(match.deepest)
            return
        kv = list(match.kv_indices)
        if match.host_len:
            cache.finish_load(cache.start_load(match, cache.slots.alloc(match.host_len)))
            kv = [s for s in self._path_slots(match.deepest)]
        cache.record_use(match.deepest)
        kv += cache.slots.alloc(len(tokens) - cached)
        present = cache.insert(tokens, kv)
        cache.slots.free(kv[cached:present])
        self.running.append(match.deepest)

    def _path_slots(self, node) -> list[int]:
        parts = []
        while node is not self.cache.root:
            parts.append(node.value)
            node = node.parent
        return [s for part in reversed(parts) for s in part]

    def finish(self, i: int) -> None:
        self.cache.unlock(self.running.pop(i))

    def evict(self, n: int) -> None:
        self.cache.evict(n)

    def take_copies(self) -> None:
        self.copies += self.cache.take_copies()

    def state(self) -> tuple:
        """Everything eviction decides, as plain values."""
        cache = self.cache
        tree = []
        stack = [((), cache.root)]
        while stack:
            path, node = stack.pop()
            for first in sorted(node.children):
                child = node.children[first]
                here = path + tuple(child.key)
                tree.append((here, tuple(child.value), tuple(child.host), child.lock_ref,
                             child.uses, child.last_use, child.last_access))
                stack.append((here, child))
        host = cache.host.free_blocks() if cache.host is not None else []
        return (sorted(tree), cache.slots.free_slots(), host, self.copies,
                cache.evictable_size, cache.protected_size, cache.host_size)


def random_ops(seed: int, n: int) -> list[tuple]:
    """Requests over a few shared stems (branching paths, repeats, one-offs), unpins,
    evictions of random sizes and, rarely, a reset."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 6) for _ in range(rng.randrange(1, 6))] for _ in range(5)]
    ops = []
    for _ in range(n):
        r = rng.random()
        if r < 0.55:
            tokens = list(rng.choice(stems)) + [rng.randrange(1, 6)
                                                for _ in range(rng.randrange(0, 6))]
            ops.append(("request", tokens))
        elif r < 0.8:
            ops.append(("finish", rng.randrange(1 << 30)))
        elif r < 0.99:
            ops.append(("evict", rng.randrange(1, 12)))
        else:
            ops.append(("reset", 0))
    return ops


def apply(driver: Driver, op: tuple) -> None:
    kind, arg = op
    if kind == "request":
        driver.request(arg)
    elif kind == "finish" and driver.running:
        driver.finish(arg % len(driver.running))
    elif kind == "evict":
        driver.evict(arg)
    elif kind == "reset" and not driver.running:
        driver.cache.reset()
    driver.take_copies()


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
@pytest.mark.parametrize("host", [0, 24])
@pytest.mark.parametrize("seed", range(6))
def test_heaps_evict_what_a_walk_of_the_tree_evicts(policy, host, seed):
    heaps = Driver(make_cache(policy, 20, host, brute_force=False))
    walk = Driver(make_cache(policy, 20, host, brute_force=True))
    evictions = 0
    for step, op in enumerate(random_ops(seed, 400)):
        apply(heaps, op)
        apply(walk, op)
        assert heaps.state() == walk.state(), f"diverged at step {step}: {op}"
        heaps.cache.check_integrity()
        evictions += op[0] == "evict"
    assert evictions > 50 and len(heaps.copies) == len(walk.copies)


def test_lru_heap_lives_on_between_evictions():
    """LRU's rank is the node's own recency: an eviction scores only what was touched
    since the last one, not every candidate again."""
    scored = []

    class CountingLRU(LRUPolicy):
        def priority(self, node, now, crowded=False):
            scored.append(node)
            return super().priority(node, now, crowded)

    cache = RadixCache(KVSlotAllocator(64), CountingLRU())
    for first in range(1, 9):  # eight unpinned leaves of four tokens
        cache.insert([first, 0, 0, 0], cache.slots.alloc(4))
    cache.evict(4)  # the first eviction scores all eight
    assert len(scored) == 8
    scored.clear()
    cache.match_prefix([5, 0, 0, 0])  # one leaf touched
    assert cache.evict(4) == 4
    assert scored == [cache.root.children[5]]  # scored again, nothing else
    assert sorted(cache.root.children) == [3, 4, 5, 6, 7, 8]  # [1..] then [2..] went


def test_adaptive_heap_is_rescored_when_the_model_moves():
    """The adaptive rank reads the age and the learned model: an eviction with nothing
    changed since the last one reuses its heap (scoring only what was touched); one
    after a reuse (the model learned) scores every candidate again."""
    scored = []

    class CountingAdaptive(AdaptivePolicy):
        def priority(self, node, now, crowded=False):
            scored.append(node)
            return super().priority(node, now, crowded)

    # a host tier with room: evicted tails are saved, not dropped (a drop teaches the model)
    cache = RadixCache(KVSlotAllocator(64), CountingAdaptive(128), HostBlockAllocator(64))
    for first in range(1, 9):
        cache.insert([first, 0, 0, 0], cache.slots.alloc(4))
    leaves = list(cache.root.children.values())
    cache.evict(1)  # the lowest leaf loses its last token (to the host)
    assert set(leaves) <= set(scored)
    heads = list(cache.root.children.values())  # the trimmed leaf's head is a new node
    untouched = [n for n in heads if len(n.key) == 4]
    assert len(untouched) == 7 and cache.candidates.device.epoch is not None
    scored.clear()
    cache.evict(1)  # nothing happened in between: only the trimmed head is scored again
    assert scored and not set(scored) & set(untouched)
    cache.record_use(cache.match_prefix([8, 0, 0, 0]).last_node)  # a reuse: the model learns
    scored.clear()
    cache.evict(1)
    assert set(untouched) <= set(scored)
    cache.check_integrity()


def test_integrity_check_catches_a_change_the_heaps_were_not_told_of():
    cache = RadixCache(KVSlotAllocator(64), LRUPolicy())
    for first in range(1, 5):
        cache.insert([first, 0, 0, 0], cache.slots.alloc(4))
    cache.evict(4)
    cache.check_integrity()
    leaf = cache.root.children[3]
    leaf.last_access += 100  # a rank read changed without a touch
    with pytest.raises(AssertionError, match="stale rank"):
        cache.check_integrity()
    cache.candidates.touch(leaf)
    cache.check_integrity()
    del cache.candidates.device.members[leaf]  # a candidate lost from its tier
    with pytest.raises(AssertionError, match="missing"):
        cache.check_integrity()
