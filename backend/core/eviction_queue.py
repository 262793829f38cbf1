"""Each tier's eviction candidates, kept up to date as the tree changes (plain Python).

Candidates (what ``TierMover`` may take next)::

    device: unlocked nodes on the device none of whose children is on the device
    host:   unlocked nodes with a host copy that are on the device too or have no children

Each tier keeps its candidates in a binary heap of entries
``(priority, -last_access, seq, stamp, node)``: the policy's rank, lowest first; among
equals the most recently used first; ``seq`` only makes the order total. So an eviction
pops its victims instead of walking the whole tree (inner and host-only nodes included)
to find the leaves.

**Lazy invalidation.** The tree calls ``touch(node)`` on every change of what a node's
rank reads (its edge, recency, use statistics) or of whether it is a candidate (slots,
host copy, lock, children): the node goes into a dirty set. ``refresh``, at the start of
an eviction, bumps the ``stamp`` of each dirty node (its older entries become stale and
are skipped when popped) and queues it to be pushed again where it is a candidate.
Stamps change there only, so during one eviction the heaps hold exactly what a walk at
its start would have found, plus what the eviction pushes itself (the parent left a
leaf, the head of a trimmed edge, a leaf saved to the host).

**Scores that change with time.** A heap is right only while every live entry was
scored under the conditions a fresh scoring would use now. The policy names them with
``score_epoch(now, crowded)``, and a heap whose entries were scored in another epoch (or
in several) is rebuilt from its candidate set before use:

* LRU ranks by the recency clock of the last match through the node, which changes only
  with the node (a touch): its epoch is constant, the heap lives on and each eviction
  pushes only the touched candidates (O(log n) each).
* The adaptive policy ranks by hit density, which reads the use clock (a leaf's age),
  the learned model (reuse odds and gap shapes change with every reuse and every drop)
  and whether new prefixes are crowded. The order of two leaves is not time-invariant:
  with nothing happening to either, their ages grow together and the learned survival
  curves cross (a periodic prefix ranks higher as it falls due, then drops once it is
  overdue), and one new observation reshapes every curve. Nor can a top-k be re-scored
  lazily with a bound: no score is bounded by its old value once the model moves. So an
  adaptive heap is rebuilt (the candidates scored again, not the tree walked) whenever
  its epoch moved, and reused as is when nothing the scores read has moved (evictions
  with no reuse between them, as a long prompt's chunks make room step after step).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Hashable

from .radix_node import TreeNode

__all__ = ["CandidateHeap", "EvictionCandidates", "device_candidate", "host_candidate"]

# a heap with more stale entries than this many times its candidates (plus a few) is
# rebuilt: LRU's heap only grows by pushes otherwise
STALE_FACTOR = 2
STALE_SLACK = 64

Entry = tuple  # (priority, -last_access, seq, stamp, node)


def device_candidate(node: TreeNode) -> bool:
    return bool(node.value) and node.lock_ref == 0 and \
        not any(c.value for c in node.children.values())


def host_candidate(node: TreeNode) -> bool:
    return bool(node.host) and node.lock_ref == 0 and (bool(node.value) or not node.children)


class CandidateHeap:
    """One tier's candidates: ``members`` (a superset of them: a node that stopped being
    one without a touch leaves at the next rebuild) and the heap of their entries."""

    def __init__(self, is_candidate: Callable[[TreeNode], bool]) -> None:
        self.is_candidate = is_candidate
        self.members: dict[TreeNode, None] = {}
        self.heap: list[Entry] = []
        self.epoch: Hashable | None = None  # every entry scored in it; None: rebuild
        self.pending: dict[TreeNode, None] = {}  # members to push at the next prepare

    def add(self, node: TreeNode) -> None:
        """``node`` may be a candidate: pushed (if it is) at the next ``prepare``."""
        self.members[node] = None
        self.pending[node] = None

    def discard(self, node: TreeNode) -> None:
        self.members.pop(node, None)
        self.pending.pop(node, None)

    def prepare(self, epoch: Hashable | None, entry: Callable[[TreeNode], Entry]) -> list[Entry]:
        """The heap, with an entry of every candidate scored now (``entry``): the pending
        ones pushed where the heap is still of ``epoch``, else all of them again."""
        if epoch is None or epoch != self.epoch or \
                len(self.heap) > STALE_FACTOR * len(self.members) + STALE_SLACK:
            self.members = {n: None for n in self.members if self.is_candidate(n)}
            self.heap = [entry(n) for n in self.members]
            heapq.heapify(self.heap)
        else:
            for node in self.pending:
                if self.is_candidate(node):
                    heapq.heappush(self.heap, entry(node))
        self.pending = {}
        self.epoch = epoch
        return self.heap

    def push(self, entry: Entry, epoch: Hashable | None) -> None:
        """An entry scored during an eviction (``epoch``: the policy's then)."""
        heapq.heappush(self.heap, entry)
        self.members[entry[4]] = None
        if epoch != self.epoch:
            self.epoch = None  # scored in two epochs: the next prepare rebuilds

    def reset(self) -> None:
        self.members, self.heap, self.epoch, self.pending = {}, [], None, {}


class EvictionCandidates:
    """The two tiers' candidate heaps and the tokens held by never-reused prefixes (what
    the policy's ``crowded`` reads), maintained from the tree's touches."""

    def __init__(self) -> None:
        self.device = CandidateHeap(device_candidate)
        self.host = CandidateHeap(host_candidate)
        self.new_tokens = 0  # tokens (either tier) of nodes used fewer than twice
        self._dirty: dict[TreeNode, None] = {}
        self._seq = itertools.count()

    def touch(self, node: TreeNode) -> None:
        """Something ``node``'s rank or candidacy reads has changed (or may have)."""
        self._dirty[node] = None

    def refresh(self) -> None:
        """Bring the candidates up to date with the touches so far (an eviction starts)."""
        dirty, self._dirty = self._dirty, {}
        device, host = self.device, self.host
        new_tokens = self.new_tokens
        for node in dirty:  # (the hot loop of an eviction: the predicates inlined)
            node.stamp += 1
            value, blocks = node.value, node.host
            counted = len(node.key) * (bool(value) + bool(blocks)) if node.uses < 2 else 0
            new_tokens += counted - node.counted
            node.counted = counted
            unlocked = not node.lock_ref
            if value and unlocked and not any(c.value for c in node.children.values()):
                device.add(node)  # device_candidate
            elif node in device.members:
                device.discard(node)
            if blocks and unlocked and (value or not node.children):
                host.add(node)  # host_candidate
            elif node in host.members:
                host.discard(node)
        self.new_tokens = new_tokens

    def entry(self, node: TreeNode, priority: float) -> Entry:
        return (priority, -node.last_access, next(self._seq), node.stamp, node)

    def reset(self) -> None:
        """The tree was emptied (``RadixCache.reset``)."""
        self.device.reset()
        self.host.reset()
        self.new_tokens = 0
        self._dirty = {}

    def check(self, nodes: list[TreeNode], epoch: Hashable | None,
              entry: Callable[[TreeNode], Entry]) -> None:
        """Integrity against a walk of the tree's ``nodes``: the never-reused tokens, and
        every candidate a member with a live entry (or one pending), ranked as ``entry``
        ranks it now where its heap is of ``epoch``; call after ``refresh``."""
        new = sum(len(n.key) * (bool(n.value) + bool(n.host)) for n in nodes if n.uses < 2)
        assert new == self.new_tokens, f"never-reused tokens {self.new_tokens} != {new}"
        for tier in (self.device, self.host):
            live: dict[TreeNode, list[Entry]] = {}
            for e in tier.heap:
                if e[3] == e[4].stamp:
                    live.setdefault(e[4], []).append(e)
            for node in nodes:
                if not tier.is_candidate(node):
                    continue
                assert node in tier.members, "a candidate missing from its tier"
                if tier.epoch is None or node in tier.pending:
                    continue  # rebuilt, or pushed, at the next prepare
                assert node in live, "a candidate without a live heap entry"
                if tier.epoch == epoch:
                    want = entry(node)[:2]
                    assert all(e[:2] == want for e in live[node]), "a stale rank"
