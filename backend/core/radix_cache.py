"""RadixAttention's prefix cache: a token-granular radix tree over KV in two tiers.

Each edge holds a run of token ids and where the KV of those tokens lives: device slots
(``value``), host blocks (``host``), or both. A node's ``lock_ref`` counts the running
requests (and in-flight loads) whose path passes through it; only unlocked nodes can
leave a tier, leaves of that tier first, in the order of the eviction policy
(``eviction.py``). A parent becomes a candidate when its last child of the tier is gone,
so shared trunks outlive the branches that hang off them. The candidates wait in one heap
per tier (``eviction_queue.py``), not found by walking the tree: every change of what a
node's rank or candidacy reads (recency, use statistics, edge, slots, host copy, lock,
children) calls ``candidates.touch(node)``.

Tiers (``tiers.py`` moves KV between them)::

    device-resident nodes form a subtree from the root (a node on the device has its
    parent on the device), so a match is   [ device part | host-only part ]
    device eviction: a device leaf's KV goes to the host (a HostSave), or is dropped
    host eviction:   a node's host copy is dropped; a host-only leaf leaves the tree
    host hit:        the matched host-only nodes get device slots and a HostLoad; they
                     stay locked ("loading") until the device side reports it done

Slot and block accounting (``radix_integrity.py`` checks the tree's side, with its
other invariants; ``Engine.check_integrity`` the slots')::

    slots.size == free slots + slots in the tree + slots owned by running requests
                                (evictable + protected)   (not yet inserted)
    host.size  == free host blocks + host blocks in the tree

``NoCache`` keeps the same interface with an always-empty tree (the cache-off baseline).
"""
from __future__ import annotations

import itertools

from .eviction import EvictionPolicy, LRUPolicy, ghost_key
from .eviction_queue import EvictionCandidates
from .host_tier import HostBlockAllocator, HostCopy
from .kv_allocator import KVSlotAllocator
from .radix_integrity import check_tree
from .radix_node import MatchResult, TreeNode, common_prefix_len
from .tiers import TierMover

__all__ = ["NoCache", "RadixCache"]


class RadixCache:
    def __init__(self, slots: KVSlotAllocator, policy: EvictionPolicy | None = None,
                 host: HostBlockAllocator | None = None, host_load_min_tokens: int = 0) -> None:
        self.slots = slots  # evicted slots go back here
        self.policy = policy or LRUPolicy()
        self.host = host if host is not None and host.size > 0 else None
        # recency: monotonic, one tick per node walked; use clock: one tick per request
        self._clock = itertools.count()
        self.use_clock = 0
        self.root = TreeNode([], [], None, next(self._clock))
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0  # device tokens in unlocked nodes
        self.protected_size = 0  # device tokens in locked nodes
        self.host_size = 0  # tokens with a host copy
        # host matches shorter than this count as misses (recomputed, not loaded)
        self.host_load_min_tokens = host_load_min_tokens
        # each tier's eviction candidates: every change of a node that its rank or its
        # candidacy reads must ``touch`` it (eviction_queue.py)
        self.candidates = EvictionCandidates()
        self.tiers = TierMover(self)

    @property
    def enabled(self) -> bool:
        return True

    def total_size(self) -> int:
        """Tokens on the device."""
        return self.evictable_size + self.protected_size

    # ---------------------------------------------------------------- match / insert
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids`` (either tier); splits an edge if the
        match ends inside it. A host part shorter than ``host_load_min_tokens`` is left
        out: recomputing it costs less than loading it."""
        node, matched = self.root, []
        device_node, host_node, host_len = node, None, 0
        node.last_access = next(self._clock)
        i = 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            n = common_prefix_len(child.key, token_ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(self._clock)
            self.candidates.touch(child)
            if child.value:
                matched.extend(child.value)
                device_node = child
            else:
                host_len += n
                host_node = child
            node = child
            i += n
        if host_len < self.host_load_min_tokens:
            return MatchResult(matched, device_node)
        return MatchResult(matched, device_node, host_len, host_node)

    def prefix_len(self, token_ids: list[int], limit: int | None = None) -> int:
        """How many leading tokens of ``token_ids[:limit]`` ``match_prefix`` would find
        (either tier, a host part only from ``host_load_min_tokens`` on); changes nothing
        (no split, no recency): what ordering a queue needs, cheaper than a match."""
        end = len(token_ids) if limit is None else min(limit, len(token_ids))
        matched, on_device = self._walk(token_ids, end)
        return matched if matched - on_device >= self.host_load_min_tokens else on_device

    def device_prefix_len(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` the tree holds on the device; changes
        nothing. ``insert`` takes a caller's slots from exactly there on."""
        return self._walk(token_ids, len(token_ids))[1]

    def _walk(self, token_ids: list[int], end: int) -> tuple[int, int]:
        """The leading tokens of ``token_ids[:end]`` the tree holds on either tier, and
        how many of them are on the device (device nodes form a subtree from the root,
        so those come first)."""
        node, i, on_device = self.root, 0, 0
        while i < end:
            child = node.children.get(token_ids[i])
            if child is None:
                break
            key, start = child.key, i
            if i + len(key) <= end and token_ids[i:i + len(key)] == key:
                i += len(key)  # the usual case, without a call: the whole edge matches
            else:
                i += min(common_prefix_len(key, token_ids, i), end - i)
            if child.value:
                on_device = i
            if i - start < len(key):
                break  # the match ends inside this edge
            node = child
        return i, on_device

    def record_use(self, node: TreeNode) -> None:
        """A request uses the cached path ending at ``node`` (call once per admission):
        the policy's statistics learn from it. The use clock counts reuses only (a hit,
        or a dropped prefix coming back), so one-off prompts do not age what is cached."""
        if node is self.root:
            return
        self.use_clock += 1
        now = self.use_clock
        while node is not self.root:
            self.policy.on_use(node, now)
            self.candidates.touch(node)
            node = node.parent

    def insert(self, token_ids: list[int], kv_indices: list[int]) -> int:
        """Insert a sequence and its device slots; returns how many leading tokens were
        already on the device. The caller owns (and must free) its own slots for those
        tokens, which the tree does not take; the tree takes the rest (host-only nodes on
        the path adopt the caller's slots: they are on both tiers again)."""
        assert len(token_ids) == len(kv_indices)
        node, i = self.root, 0
        present = None
        node.last_access = next(self._clock)
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                self._new_leaf(node, token_ids, kv_indices, i)
                return i if present is None else present
            n = common_prefix_len(child.key, token_ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(self._clock)
            self.candidates.touch(child)
            if not child.value:
                present = i if present is None else present
                self._set_device(child, list(kv_indices[i:i + n]))
            node = child
            i += n
        return i if present is None else present

    def _new_leaf(self, parent: TreeNode, token_ids: list[int], kv_indices: list[int],
                  i: int) -> None:
        leaf = TreeNode(list(token_ids[i:]), list(kv_indices[i:]), parent, next(self._clock),
                        depth=i)
        parent.children[token_ids[i]] = leaf
        self.evictable_size += len(leaf.key)
        key = ghost_key(token_ids[:i], leaf.key, i)
        if parent is self.root and self.policy.knows(key):
            # a dropped prefix is back: a reuse (below the root, the request's match has
            # already ticked the clock in record_use)
            self.use_clock += 1
        self.policy.on_create(leaf, key, self.use_clock)
        self.candidates.touch(leaf)
        self.candidates.touch(parent)  # no longer a device leaf

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent, child.last_access,
                         child.depth)
        upper.host = child.host[:n]
        for attr in ("lock_ref", "uses", "last_use", "gap", "loading"):
            setattr(upper, attr, getattr(child, attr))
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.host = child.host[n:]
        child.depth += n
        self.candidates.touch(upper)
        self.candidates.touch(child)
        return upper

    def _set_device(self, node: TreeNode, slots: list[int]) -> None:
        """A host-only node gets device slots (a load or an adoption)."""
        node.value = slots
        self.candidates.touch(node)
        self.candidates.touch(node.parent)  # no longer a device leaf
        if node.lock_ref:
            self.protected_size += len(slots)
        else:
            self.evictable_size += len(slots)

    # ---------------------------------------------------------------- pinning
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.candidates.touch(node)
                if node.value:
                    self.evictable_size -= len(node.key)
                    self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.candidates.touch(node)
                if node.value:
                    self.protected_size -= len(node.key)
                    self.evictable_size += len(node.key)
            node = node.parent

    # ---------------------------------------------------------------- tiers
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots from unlocked device leaves, in the
        policy's order (or as many as are evictable); with a host tier their KV moves
        there when it ranks above what the host would give up. Returns the slots freed."""
        return self.tiers.evict(num_tokens)

    def start_load(self, match: MatchResult, slots: list[int]) -> int:
        """Give the host part of ``match`` (locked by the caller) the device ``slots``
        and plan their load; returns its ticket (``finish_load`` when the device is done)."""
        return self.tiers.start_load(match, slots)

    def finish_load(self, ticket: int) -> None:
        self.tiers.finish_load(ticket)

    def is_ready(self, node: TreeNode) -> bool:
        """Whether the KV of the path ending at ``node`` is all on the device (no load in
        flight on it)."""
        while node is not self.root:
            if node.loading:
                return False
            node = node.parent
        return True

    def take_copies(self) -> list[HostCopy]:
        """The copies planned since the last call, in the order they must run."""
        return self.tiers.take_copies()

    def reset(self) -> None:
        for node in self.nodes():
            self.slots.free(node.value)
            if node.host:
                self.host.free(node.host)
        self.root.children = {}
        self.evictable_size = self.protected_size = self.host_size = 0
        self.candidates.reset()

    def nodes(self) -> list[TreeNode]:
        """Every node but the root (a walk of the whole tree: for resets and checks)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ---------------------------------------------------------------- checking
    def cached_slots(self) -> list[int]:
        return [slot for node in self.nodes() for slot in node.value]

    def cached_host_blocks(self) -> list[int]:
        return [block for node in self.nodes() for block in node.host]

    def check_integrity(self) -> None:
        """Assert the tree's invariants and totals (radix_integrity.py); no step calls it."""
        check_tree(self)


class NoCache(RadixCache):
    """The cache-off baseline: nothing matches and nothing is kept."""

    def __init__(self, slots: KVSlotAllocator) -> None:
        super().__init__(slots)

    @property
    def enabled(self) -> bool:
        return False

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult([], self.root)

    def prefix_len(self, token_ids: list[int], limit: int | None = None) -> int:
        return 0

    def insert(self, token_ids: list[int], kv_indices: list[int]) -> int:
        return len(token_ids)  # "all present": the caller frees every slot it passed
