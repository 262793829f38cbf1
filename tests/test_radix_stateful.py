"""RadixCache against a token-level reference model, driven by random operation sequences.

The model knows nothing about edges. It keeps, for every cached prefix (a tuple of tokens),
the KV slot of its last token and the time of the last operation that walked through it;
locks are the token paths they pin. Its LRU eviction removes, one token at a time, the
unpinned cached prefix with no cached extension and the oldest walk time. The tree frees
whole edges, which are runs of that same order, so after ``evict(n)`` the tree must have
freed exactly the first ``freed`` tokens of the model's order, with ``freed >= n`` unless
everything unpinned is gone.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.core.eviction import LRUPolicy
from backend.core.kv_allocator import KVSlotAllocator
from backend.core.radix_cache import RadixCache

POOL_SIZE = 20
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=8)
picks = st.integers(0, 10_000)

Prefix = tuple[int, ...]


def _tree_tokens(cache: RadixCache) -> dict[Prefix, tuple[int, int]]:
    """Read-only walk: every cached prefix -> (slot of its last token, lock_ref of its node)."""
    out: dict[Prefix, tuple[int, int]] = {}
    stack: list[tuple[Prefix, object]] = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            p = prefix
            for token, slot in zip(child.key, child.value):
                p = p + (token,)
                out[p] = (slot, child.lock_ref)
            stack.append((p, child))
    return out


def _depth(cache: RadixCache, node) -> int:
    depth = 0
    while node is not cache.root:
        depth += len(node.key)
        node = node.parent
    return depth


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KVSlotAllocator(POOL_SIZE)
        self.cache = RadixCache(self.pool, LRUPolicy())
        # reference model
        self.slot: dict[Prefix, int] = {}  # cached prefix -> slot of its last token
        self.stamp: dict[Prefix, int] = {}  # cached prefix -> time of last walk through it
        self.now = 0
        self.locks: list[tuple[object, Prefix]] = []  # (node handle, pinned path)
        # running requests: (tokens, kv slots, prefix_len, locked node); they own kv[prefix_len:]
        self.requests: list[tuple[list[int], list[int], int, object]] = []

    # ------------------------------------------------------------------ model helpers
    def _tick(self) -> int:
        self.now += 1
        return self.now

    def _longest(self, tokens: list[int]) -> int:
        m = 0
        while m < len(tokens) and tuple(tokens[:m + 1]) in self.slot:
            m += 1
        return m

    def _lock_paths(self) -> list[Prefix]:
        return [path for _, path in self.locks] + \
               [tuple(tokens[:plen]) for tokens, _, plen, _ in self.requests]

    def _lock_counts(self) -> Counter:
        counts: Counter = Counter()
        for path in self._lock_paths():
            for k in range(1, len(path) + 1):
                counts[path[:k]] += 1
        return counts

    def _model_eviction_order(self) -> list[Prefix]:
        """Every evictable prefix, in the order LRU eviction removes them."""
        pinned = set(self._lock_counts())
        alive = set(self.slot)
        children = Counter(p[:-1] for p in alive)
        order: list[Prefix] = []
        while True:
            leaves = [p for p in alive if p not in pinned and children[p] == 0]
            if not leaves:
                return order
            victim = min(leaves, key=lambda p: self.stamp[p])
            order.append(victim)
            alive.remove(victim)
            children[victim[:-1]] -= 1

    def _match(self, tokens: list[int]):
        expected = self._longest(tokens)
        result = self.cache.match_prefix(tokens)
        assert result.kv_indices == [self.slot[tuple(tokens[:k])] for k in range(1, expected + 1)], \
            f"match_prefix({tokens}) should return the slots of its {expected}-token cached prefix"
        assert _depth(self.cache, result.last_node) == expected, "last_node must end the match"
        t = self._tick()
        for k in range(1, expected + 1):
            self.stamp[tuple(tokens[:k])] = t
        return result

    def _insert(self, tokens: list[int], kv: list[int]) -> int:
        expected = self._longest(tokens)
        present = self.cache.insert(tokens, kv)
        assert present == expected, f"insert({tokens}) reported {present}, model says {expected}"
        t = self._tick()
        for k in range(1, len(tokens) + 1):
            p = tuple(tokens[:k])
            if k > present:
                self.slot[p] = kv[k - 1]  # the first inserter's slots win
            self.stamp[p] = t
        return present

    def _evict(self, n: int) -> int:
        order = self._model_eviction_order()
        before = dict(self.slot)
        free_before = Counter(self.pool.free_slots())

        freed = self.cache.evict(n)

        gone = set(before) - set(_tree_tokens(self.cache))
        assert freed == len(gone), "evict must report exactly the slots it freed"
        assert freed >= min(n, len(order)), "evict stopped short of the target"
        assert gone == set(order[:freed]), \
            f"evict({n}) freed {sorted(gone)}, LRU order says {order[:freed]}"
        # overshoot only finishes the edge of the token that reached the target
        if freed > n > 0:
            tail = order[n - 1:freed]
            assert all(self.stamp[p] == self.stamp[tail[0]] for p in tail)
            assert all(b == a[:-1] for a, b in zip(tail, tail[1:]))
        assert Counter(self.pool.free_slots()) - free_before == Counter(before[p] for p in gone)
        for p in gone:
            del self.slot[p], self.stamp[p]
        return freed

    def _alloc(self, n: int) -> list[int] | None:
        short = n - self.pool.available_size()
        if short > 0:
            self._evict(short)
        return self.pool.alloc(n) if self.pool.can_alloc(n) else None

    # ------------------------------------------------------------------ rules
    @rule(tokens=seqs)
    def insert(self, tokens):
        kv = self._alloc(len(tokens))
        if kv is None:
            return
        present = self._insert(tokens, kv)
        self.pool.free(kv[:present])

    @rule(tokens=seqs)
    def match(self, tokens):
        self._match(tokens)

    @rule(tokens=seqs)
    def lock(self, tokens):
        result = self._match(tokens)
        self.cache.lock(result.last_node)
        self.locks.append((result.last_node, tuple(tokens[:len(result.kv_indices)])))

    @precondition(lambda self: self.locks)
    @rule(pick=picks)
    def unlock(self, pick):
        node, _ = self.locks.pop(pick % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self._evict(n)

    @rule(tokens=seqs)
    def start_request(self, tokens):
        """As the scheduler admits: match and pin the prefix, allocate the rest."""
        result = self._match(tokens)
        self.cache.lock(result.last_node)
        plen = len(result.kv_indices)
        self.requests.append((tokens, list(result.kv_indices), plen, result.last_node))
        new = self._alloc(len(tokens) - plen)
        tokens, kv, plen, node = self.requests.pop()
        if new is None:  # cannot fit even after eviction: give the pin back
            self.cache.unlock(node)
            return
        self.requests.append((tokens, kv + new, plen, node))

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def release_request(self, pick):
        """As the scheduler releases: insert, free own duplicates, unpin."""
        tokens, kv, plen, node = self.requests.pop(pick % len(self.requests))
        present = self._insert(tokens, kv)
        assert present >= plen, "a pinned prefix cannot have disappeared"
        self.pool.free(kv[plen:present])
        self.cache.unlock(node)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def tree_is_consistent(self):
        self.cache.check_integrity()

    @invariant()
    def tree_holds_exactly_the_model_prefixes_and_slots(self):
        tree = _tree_tokens(self.cache)
        assert {p: slot for p, (slot, _) in tree.items()} == self.slot

    @invariant()
    def lock_counts_match_the_pinned_paths(self):
        tree = _tree_tokens(self.cache)
        counts = self._lock_counts()
        assert {p: ref for p, (_, ref) in tree.items()} == {p: counts[p] for p in tree}
        assert set(counts) <= set(tree), "a pinned prefix was evicted"
        assert self.cache.protected_size == len(counts)
        assert self.cache.evictable_size == len(tree) - len(counts)

    @invariant()
    def every_slot_is_free_cached_or_held_exactly_once(self):
        held = [s for _, kv, plen, _ in self.requests for s in kv[plen:]]
        everything = self.pool.free_slots() + self.cache.cached_slots() + held
        assert sorted(everything) == list(range(1, POOL_SIZE + 1))


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestRadixCache = RadixCacheMachine.TestCase
