"""Which unpinned leaf of the radix tree goes first: eviction policies (plain Python).

A policy ranks the evictable leaves of a tier by ``priority(node, now)``; the lowest goes
first, and among equals the most recently used (what was cached before stays). ``now``
is the cache's use clock: it ticks once per reuse (a request whose prompt hits the cache,
or a dropped prefix coming back), so gaps are counted in reuses, not in seconds or
requests, and a burst of one-off prompts does not age what is cached.

``lru`` ranks by the last match that walked through a node (the original RadixAttention
rule). It churns on cycles: with room for four prefixes and five in rotation it evicts
exactly the prefix that comes next, every time.

``adaptive`` ranks a leaf by its expected saving per token of cache it holds (hit
density, after LHD): how likely its prefix is to be used again, over how long the cache
must hold it until then, times what a token of it costs to recompute. Each node keeps
how often it was used (``uses``), when last (``last_use``) and its typical gap between
uses (``gap``); ``reuse_model.py`` learns from all nodes how gaps are spread around that
typical value and how likely a prefix used k times is to come back:

* **Frequency and recency.** A prefix with a short gap (a popular one) waits little for
  its next use and ranks high; one that has stayed away for long, relative to its gap,
  has probably stopped coming and ranks low.
* **Cycles.** Where reuse is periodic (every prefix comes back one period after its last
  use) the learned gap shape says the prefix used last is the one needed last: it is
  evicted first, as the offline optimum does, and the others stay and hit. Where reuse
  is memoryless the same rule ranks by rate (LFU-like). Chats with think times lie in
  between and get what the data says.
* **Ghosts.** A cycle longer than the cache is invisible while each prefix is evicted
  before its second use. When a prefix leaves the cache altogether its statistics stay
  in a small bounded history keyed by its position and first tokens; a prefix that comes
  back resumes its use count and learns its gap from the ghost.
* **Scans.** The chance of reuse is learned per use count (how many prefixes used k
  times came back, against how many were dropped first), so a burst of one-off prompts
  drives the chance of a first reuse down and ranks new leaves below prefixes that keep
  coming back, instead of flushing them.
* **Cost.** Recomputing a token costs more the deeper it sits (attention reads every
  earlier token): a token at depth d weighs ``1 + d / ATTENTION_DEPTH``.

Only leaves can go (a lock pins a whole path; a parent becomes a leaf when its last
child leaves), and the tree enforces that: a policy only orders candidates.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import NamedTuple, Protocol

from .config import RADIX_EVICTION_POLICIES
from .reuse_model import GapShape, ReuseOdds

# depth at which a token's attention costs as much again as the rest of its layer
ATTENTION_DEPTH = 8192
# use counts above this share one class (their reuse probability is learned together)
MAX_USE_CLASS = 4
# a gap estimate moves this share of the way to each newly observed gap
GAP_SMOOTHING = 0.5
# the typical first gap (over all prefixes) moves this share towards each new one
FIRST_GAP_SMOOTHING = 1 / 16
# ghosts remember at most this many tokens' worth of dropped prefixes per cached token
GHOST_TOKENS_PER_TOKEN = 8.0
# Scans: while never-reused prefixes hold more than this share of the cache they go before
# any prefix that was reused (a probation area, as in 2Q); below it, all rank alike, so
# new prefixes always have room to prove themselves
PROBATION_SHARE = 0.1
PROBATION_RANK = 1e9  # far below any density
# tokens of context on each side of a prefix's start that identify its ghost
GHOST_WINDOW = 32


class NodeStats(Protocol):
    """What a policy reads of a tree node (``radix_cache.TreeNode``)."""

    key: list[int]
    last_access: int  # the tree's recency clock at the last match through the node
    uses: int
    last_use: int
    gap: float
    depth: int  # tokens above the node's first token


class Ghost(NamedTuple):
    uses: int
    last_use: int
    gap: float
    num_tokens: int


class GhostKey(NamedTuple):
    """Where a prefix starts (its depth, the tokens just before it, its first token) and
    its first tokens: independent of how the tree happens to split the path into edges."""

    anchor: int
    head: tuple[int, ...]


def ghost_key(before: list[int], start: list[int], depth: int) -> GhostKey:
    return GhostKey(hash((depth, tuple(before[-GHOST_WINDOW:]), start[0])),
                    tuple(start[:GHOST_WINDOW]))


class GhostHistory:
    """Statistics of recently dropped prefixes, oldest forgotten first, bounded by the
    tokens they stood for. A prefix matches a ghost that starts where it starts when the
    shorter of their first tokens begins the longer (a dropped edge may have been
    shorter or longer than the leaf that brings it back)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[GhostKey, Ghost] = OrderedDict()
        self._heads: dict[int, list[tuple[int, ...]]] = {}
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: GhostKey) -> bool:
        return self._find(key) is not None

    def _find(self, key: GhostKey) -> GhostKey | None:
        for head in self._heads.get(key.anchor, ()):
            n = min(len(head), len(key.head))
            if head[:n] == key.head[:n]:
                return GhostKey(key.anchor, head)
        return None

    def remember(self, key: GhostKey, ghost: Ghost) -> None:
        if key in self._entries:
            self._forget(key)
        self._entries[key] = ghost
        self._heads.setdefault(key.anchor, []).append(key.head)
        self._tokens += ghost.num_tokens
        while self._tokens > self.max_tokens and self._entries:
            self._forget(next(iter(self._entries)))

    def recall(self, key: GhostKey) -> Ghost | None:
        """The ghost matching ``key``, forgotten as it is read (the prefix is back)."""
        found = self._find(key)
        return self._forget(found) if found is not None else None

    def _forget(self, key: GhostKey) -> Ghost:
        ghost = self._entries.pop(key)
        heads = self._heads[key.anchor]
        heads.remove(key.head)
        if not heads:
            del self._heads[key.anchor]
        self._tokens -= ghost.num_tokens
        return ghost


class EvictionPolicy(ABC):
    """Orders a tier's evictable leaves. The tree calls the hooks; ``priority`` must not
    change a node (eviction computes it for every candidate)."""

    name: str
    remembers = False  # whether on_drop needs the dropped prefix's ghost key
    trims = False  # evict only the tail of a leaf that is needed (else whole edges)
    # never-reused prefixes holding more than this share of the cache are "crowded"
    probation_share = 1.0

    @abstractmethod
    def priority(self, node: NodeStats, now: int, crowded: bool = False) -> float:
        """Lower is evicted first. ``crowded``: never-reused prefixes hold more than
        ``probation_share`` of the cache."""

    def knows(self, key: GhostKey) -> bool:
        """Whether ``key`` is a prefix dropped recently (a ghost)."""
        return False

    def on_use(self, node: NodeStats, now: int) -> None:
        """A request uses the node's prefix (it lies on the request's cached path)."""

    def on_create(self, node: NodeStats, key: GhostKey, now: int) -> None:
        """A new leaf was inserted; ``key`` identifies its prefix (ghost_key)."""

    def on_drop(self, node: NodeStats, key: GhostKey, now: int) -> None:
        """The node's KV left the cache (every tier)."""


class LRUPolicy(EvictionPolicy):
    """Least recently matched first."""

    name = "lru"

    def priority(self, node: NodeStats, now: int, crowded: bool = False) -> float:
        return node.last_access


class AdaptivePolicy(EvictionPolicy):
    """Hit density from learned reuse odds and gap shapes (module doc)."""

    name = "adaptive"
    remembers = True
    trims = True
    probation_share = PROBATION_SHARE

    def __init__(self, capacity_tokens: int) -> None:
        self.ghosts = GhostHistory(max(int(capacity_tokens * GHOST_TOKENS_PER_TOKEN), 1))
        self.odds = ReuseOdds(MAX_USE_CLASS)
        # a prefix's first gap is unknown until it is reused: new leaves are measured
        # against the typical first gap of all prefixes (its own shape)
        self.first_gap = 0.0
        self.first_shape = GapShape()
        self.repeat_shape = GapShape()

    # ---------------------------------------------------------------- ranking
    def priority(self, node: NodeStats, now: int, crowded: bool = False) -> float:
        first = node.uses < 2
        gap = max(self.first_gap if first else node.gap, 1.0)
        survival, remaining = (self.first_shape if first else self.repeat_shape).tail(
            (now - node.last_use) / gap)
        p = self.odds.probability(node.uses) * survival
        p = p / (p + 1.0 - self.odds.probability(node.uses))  # not back yet: less likely
        cost = 1.0 + (node.depth + len(node.key) / 2) / ATTENTION_DEPTH
        density = p * cost / (remaining * gap)
        return density - PROBATION_RANK if crowded and first else density

    # ---------------------------------------------------------------- learning
    def on_use(self, node: NodeStats, now: int) -> None:
        if node.last_use == now:
            return  # already counted for this request
        self._reuse(node, node.uses, node.gap, now - node.last_use)
        node.last_use = now

    def knows(self, key: GhostKey) -> bool:
        return key in self.ghosts

    def on_create(self, node: NodeStats, key: GhostKey, now: int) -> None:
        ghost = self.ghosts.recall(key)
        node.last_use = now
        if ghost is None:
            node.uses, node.gap = 1, 0.0
        else:
            self._reuse(node, ghost.uses, ghost.gap, now - ghost.last_use)

    def on_drop(self, node: NodeStats, key: GhostKey, now: int) -> None:
        self.odds.dropped(node.uses)
        self.ghosts.remember(key, Ghost(node.uses, node.last_use, node.gap, len(node.key)))

    def _reuse(self, node: NodeStats, uses: int, gap: float, observed: int) -> None:
        """``node`` (with ``uses`` uses so far, typical ``gap``) is used again after
        ``observed`` requests."""
        if uses < 2:
            if self.first_gap > 0:
                self.first_shape.add(observed / self.first_gap)
            self.first_gap = observed if self.first_gap == 0 else \
                self.first_gap + FIRST_GAP_SMOOTHING * (observed - self.first_gap)
            node.gap = observed
        else:
            self.repeat_shape.add(observed / max(gap, 1.0))
            node.gap = _smooth(gap, observed)
        self.odds.reused(uses)
        node.uses = uses + 1


def _smooth(old: float, new: float) -> float:
    return old + GAP_SMOOTHING * (new - old)


def make_policy(name: str, capacity_tokens: int) -> EvictionPolicy:
    """The policy called ``name`` for a cache of ``capacity_tokens`` (both tiers)."""
    if name == "lru":
        return LRUPolicy()
    if name == "adaptive":
        return AdaptivePolicy(capacity_tokens)
    raise ValueError(f"radix_eviction_policy must be one of {RADIX_EVICTION_POLICIES}, "
                     f"got {name!r}")
