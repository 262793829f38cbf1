"""The two-tier radix cache against a reference model of what must be where, driven by
random operation sequences (hypothesis), for each eviction policy.

The reference is the memory itself: a fake device (slot -> content) and a fake host
(block -> content) that run the cache's ``HostSave``/``HostLoad`` records in the order
the cache hands them out, as the device side does. A token's content is the prefix it
ends. After every operation:

* every tree node's device slots and host blocks hold exactly the prefixes of its path
  (so copies ran in a correct order and no slot or block was reused while in use);
* every running request's matched path is on the device (pinned: never demoted);
* slots are free, in the tree, or owned by exactly one request; host blocks are free or
  in the tree (``check_integrity`` checks the tree's own accounting).
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.core.eviction import make_policy
from backend.core.host_tier import HostBlockAllocator, HostSave
from backend.core.kv_allocator import KVSlotAllocator
from backend.core.radix_cache import RadixCache

DEVICE, HOST = 16, 12
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=7)
picks = st.integers(0, 10_000)


class TwoTierMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.slots = KVSlotAllocator(DEVICE)
        self.cache = RadixCache(self.slots, make_policy(self.policy, DEVICE + HOST),
                                HostBlockAllocator(HOST))
        self.device: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}
        # running requests: tokens, kv slots, cached length (tree-owned), pinned node
        self.requests: list[tuple[list[int], list[int], int, object]] = []
        self.tickets: list[int] = []

    # ------------------------------------------------------------------ the device side
    def _run_copies(self) -> None:
        for copy in self.cache.take_copies():
            if isinstance(copy, HostSave):
                for slot, block in zip(copy.device_slots, copy.host_blocks):
                    self.host[block] = self.device[slot]
            else:
                for block, slot in zip(copy.host_blocks, copy.device_slots):
                    self.device[slot] = self.host[block]

    def _compute(self, tokens: list[int], start: int, slots: list[int]) -> None:
        for i, slot in enumerate(slots, start):
            self.device[slot] = tuple(tokens[:i + 1])

    def _room(self, n: int) -> bool:
        short = n - self.slots.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.slots.can_alloc(n)

    # ------------------------------------------------------------------ rules
    @rule(tokens=seqs)
    def insert(self, tokens):
        if not self._room(len(tokens)):
            self._run_copies()
            return
        kv = self.slots.alloc(len(tokens))
        self._run_copies()
        self._compute(tokens, 0, kv)
        present = self.cache.insert(tokens, kv)
        self.slots.free(kv[:present])

    @rule(tokens=seqs)
    def start_request(self, tokens):
        """As the scheduler admits: match either tier, pin, load the host part, compute."""
        match = self.cache.match_prefix(tokens)
        node = match.deepest
        self.cache.lock(node)
        cached = len(match.kv_indices) + match.host_len
        if not self._room(match.host_len + len(tokens) - cached):
            self.cache.unlock(node)
            self._run_copies()
            return
        kv = list(match.kv_indices)
        if match.host_len:
            loaded = self.slots.alloc(match.host_len)
            self.tickets.append(self.cache.start_load(match, loaded))
            kv += loaded
        self.cache.record_use(node)
        own = self.slots.alloc(len(tokens) - cached)
        self._run_copies()
        self._compute(tokens, cached, own)
        self.requests.append((tokens, kv + own, cached, node))

    @precondition(lambda self: self.tickets)
    @rule(pick=picks)
    def finish_load(self, pick):
        self.cache.finish_load(self.tickets.pop(pick % len(self.tickets)))

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def release_request(self, pick):
        tokens, kv, cached, node = self.requests.pop(pick % len(self.requests))
        present = self.cache.insert(tokens, kv)
        assert present >= cached, "a pinned prefix left the device"
        self.slots.free(kv[cached:present])
        self.cache.unlock(node)

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        freed = self.cache.evict(n)
        assert freed >= min(n, 1) or self.cache.evictable_size == 0
        self._run_copies()

    @rule(tokens=seqs)
    def match(self, tokens):
        result = self.cache.match_prefix(tokens)
        assert [self.device[s] for s in result.kv_indices] == \
            [tuple(tokens[:i + 1]) for i in range(len(result.kv_indices))]

    # ------------------------------------------------------------------ invariants
    @invariant()
    def tree_is_consistent(self):
        self.cache.check_integrity()

    @invariant()
    def every_node_holds_the_prefixes_of_its_path_in_each_tier(self):
        stack = [((), self.cache.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                path = prefix
                for i, token in enumerate(child.key):
                    path = path + (token,)
                    if child.value:
                        assert self.device[child.value[i]] == path, "device slot holds other KV"
                    if child.host:
                        assert self.host[child.host[i]] == path, "host block holds other KV"
                stack.append((path, child))

    @invariant()
    def running_requests_keep_their_path_on_the_device(self):
        for tokens, kv, cached, node in self.requests:
            assert [self.device[s] for s in kv] == [tuple(tokens[:i + 1]) for i in range(len(kv))]
            while node is not self.cache.root:
                assert node.value, "a pinned node left the device"
                node = node.parent

    @invariant()
    def every_slot_is_free_cached_or_held_exactly_once(self):
        held = [s for _, kv, cached, _ in self.requests for s in kv[cached:]]
        everything = self.slots.free_slots() + self.cache.cached_slots() + held
        assert sorted(everything) == list(range(1, DEVICE + 1))


class AdaptiveTwoTierMachine(TwoTierMachine):
    policy = "adaptive"


_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TwoTierMachine.TestCase.settings = _SETTINGS
AdaptiveTwoTierMachine.TestCase.settings = _SETTINGS
TestTwoTiersLRU = TwoTierMachine.TestCase
TestTwoTiersAdaptive = AdaptiveTwoTierMachine.TestCase
