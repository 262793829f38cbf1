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
how often it was used (``uses``), when last (``last_use``) and its mean gap between uses
(``gap``); from all nodes the policy learns how likely a prefix used k times is to come
back (``reuse_model.ReuseOdds``) and how long it then takes (``gap_model.GapModel``, one
per group of use counts: 1, 2-15, 16+), every observation weighed by the tokens it
concerns (tokens are what eviction trades):

* **Frequency and recency.** A prefix with a short gap (a popular one) waits little for
  its next use and ranks high; one that has stayed away for long, relative to its gap,
  has probably stopped coming and ranks low.
* **Cycles.** Where reuse is periodic (every prefix comes back one period after its last
  use) the learned gap shape says the prefix used last is the one needed last: it is
  evicted first, as the offline optimum does, and the others stay and hit. Where reuse
  is memoryless the same rule ranks by rate (LFU-like). Chats with think times lie in
  between and get what the data says.
* **Conversations.** A leaf created right below the end of an earlier request's path
  (``ends_path``) is that conversation's next turn: it starts with the history of the
  turns it extends (use count, gap), not as a one-off. The use count then counts turns,
  and the odds per use count learn how likely a chat with k turns is to have another.
* **Ghosts.** A cycle longer than the cache is invisible while each prefix is evicted
  before its second use. When a prefix leaves the cache altogether its statistics stay
  in a small bounded history (``ghost_history.py``); a prefix that comes back resumes
  its use count and learns its gap from the ghost. A prefix counts as not reused when it
  is dropped, and that is taken back if it returns: the odds measure prefixes that did
  not come back, not those evicted too early.
* **Scans.** A burst of one-off prompts drives the odds of a first reuse down and ranks
  new leaves below prefixes that keep coming back, instead of flushing them.
* **Cost.** Recomputing a token costs more the deeper it sits (attention reads every
  earlier token): a token at depth d weighs ``1 + d / ATTENTION_DEPTH``.

Only leaves can go (a lock pins a whole path; a parent becomes a leaf when its last
child leaves), and the tree enforces that: a policy only orders candidates.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Protocol

from .config import RADIX_EVICTION_POLICIES
from .gap_model import GapModel
from .ghost_history import GHOST_WINDOW, Ghost, GhostHistory, GhostKey, anchor_of, ghost_key
from .reuse_model import ReuseOdds

__all__ = ["AdaptivePolicy", "EvictionPolicy", "GhostKey", "LRUPolicy", "ghost_key",
           "make_policy"]

# depth at which a token's attention costs as much again as the rest of its layer
ATTENTION_DEPTH = 8192
# use counts above this share one class (their reuse probability is learned together)
MAX_USE_CLASS = 16
# a prefix's gap is the mean of its last this many gaps (about)
GAP_MEMORY = 8
# gap models: one for prefixes not yet reused, one for those reused up to 15 times (a
# chat's later turns), one for the hot ones (a shared system prompt, a popular tenant);
# finer groups learn from too few gaps each
GROUP_BOUNDS = (2, 16)
# a group reads the model of all gaps until it has seen this many of its own
GROUP_SETTLES = 32
# the typical tokens of an observation move this share towards each new one
TOKENS_SMOOTHING = 1 / 16
# ghosts remember at most this many tokens' worth of dropped prefixes per cached token
GHOST_TOKENS_PER_TOKEN = 8.0
# Scans: while never-reused prefixes hold more than this share of the cache they go before
# any prefix that was reused (a probation area, as in 2Q); below it, all rank alike, so
# new prefixes always have room to prove themselves
PROBATION_SHARE = 0.1
PROBATION_RANK = 1e9  # far below any density


class NodeStats(Protocol):
    """What a policy reads of a tree node (``radix_node.TreeNode``)."""

    key: list[int]
    last_access: int  # the tree's recency clock at the last match through the node
    uses: int
    last_use: int
    gap: float
    depth: int  # tokens above the node's first token
    ends_path: bool  # a request's path ended here
    parent: "NodeStats | None"


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

    def score_epoch(self, now: int, crowded: bool) -> Hashable | None:
        """What ``priority`` reads besides the node: equal epochs give an unchanged node
        the same priority (eviction_queue.py keeps a heap alive while its epoch holds).
        None: unknown, every node is scored again at each eviction."""
        return None

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

    def score_epoch(self, now: int, crowded: bool) -> Hashable | None:
        return 0  # the rank is the node's own recency: time-invariant


class AdaptivePolicy(EvictionPolicy):
    """Hit density from learned reuse odds and gap shapes (module doc)."""

    name = "adaptive"
    remembers = True
    trims = True
    probation_share = PROBATION_SHARE

    def __init__(self, capacity_tokens: int) -> None:
        self.ghosts = GhostHistory(max(int(capacity_tokens * GHOST_TOKENS_PER_TOKEN), 1))
        self.odds = ReuseOdds(MAX_USE_CLASS)
        # gap models per group of use counts (_group): prefixes used about as often
        # come back alike (a chat's first turn, its later ones, a hot system prompt)
        self.gaps = [GapModel() for _ in range(len(GROUP_BOUNDS) + 1)]
        self.all_gaps = GapModel()  # read by a group that has seen few gaps yet
        self.mean_tokens = float(capacity_tokens) / 64  # typical tokens of a node observed
        # bumped whenever the learned model (odds, gap shapes) may change: the ranks of
        # all nodes move with it (score_epoch)
        self.version = 0
        self._gaps_version = 0  # bumped when the gap models learn (a part of version)
        self._memo_epoch: tuple[int, int] | None = None  # (_gaps_version, now) of _memo
        self._memo: dict[tuple[int, float, int], tuple[float, float]] = {}

    # ---------------------------------------------------------------- ranking
    def score_epoch(self, now: int, crowded: bool) -> Hashable | None:
        # a node's rank reads its age (now), the model and the probation offset
        return (self.version, now, crowded)

    def priority(self, node: NodeStats, now: int, crowded: bool = False) -> float:
        first = node.uses < 2
        survival, remaining = self._tail(node.uses, node.gap, node.last_use, now)
        p = self.odds.probability(node.uses) * survival
        p = p / (p + 1.0 - self.odds.probability(node.uses))  # not back yet: less likely
        cost = 1.0 + (node.depth + len(node.key) / 2) / ATTENTION_DEPTH
        density = p * cost / max(remaining, 1e-9)
        return density - PROBATION_RANK if crowded and first else density

    def _tail(self, uses: int, gap: float, last_use: int, now: int) -> tuple[float, float]:
        """(P(not back yet), expected wait if so) of a prefix with these statistics, from
        its gap model. Remembered until the gap models learn or the clock moves (a drop
        changes the reuse odds only): the edges of one chat's path share their statistics
        (a next turn inherits them, every later turn uses them all), and an eviction that
        ranks the host's copies again after a drop finds their tails unchanged."""
        if self._memo_epoch != (self._gaps_version, now):
            self._memo_epoch, self._memo = (self._gaps_version, now), {}
        key = (uses, gap, last_use)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._gap_model(uses).tail(now - last_use, gap,
                                                                 _own_count(uses))
        return found

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
        parent = node.parent
        if ghost is not None:
            self.version += 1
            self.odds.undropped(ghost.uses, ghost.num_tokens / self.mean_tokens)
            self._reuse(node, ghost.uses, ghost.gap, now - ghost.last_use, ghost.num_tokens)
        elif parent.ends_path:
            # the next turn of a conversation: it will be used as often as the turns it
            # extends (which this request has just used), not once
            node.uses, node.gap = parent.uses, parent.gap
        else:
            node.uses, node.gap = 1, 0.0
        node.ends_path = True

    def on_drop(self, node: NodeStats, key: GhostKey, now: int) -> None:
        # the ghosts of the edges below (gone before it) become part of this one
        below = self.ghosts.absorb(anchor_of(_path_tail(node), node.depth + len(node.key)))
        ghost = Ghost(node.uses, node.last_use, node.gap, len(node.key) + below)
        # counted as not reused until it comes back (then it was only evicted too early;
        # the ghost's tokens include the edges below, each counted when it was dropped)
        self.odds.dropped(node.uses, len(node.key) / self.mean_tokens)
        self.ghosts.remember(key, ghost)
        self.version += 1

    def _reuse(self, node: NodeStats, uses: int, gap: float, observed: int,
               tokens: int | None = None) -> None:
        """``node`` (with ``uses`` uses so far, typical ``gap``) is used again after
        ``observed`` ticks; ``tokens``: what the observation stands for (the node's own
        by default, a ghost's when the node brings a dropped prefix back)."""
        weight = self._weight(len(node.key) if tokens is None else tokens)
        self.version += 1
        self._gaps_version += 1
        self.gaps[_group(uses)].observe(observed, gap, _own_count(uses), weight)
        self.all_gaps.observe(observed, gap, _own_count(uses), weight)
        node.gap = observed if uses < 2 else gap + (observed - gap) / _own_count(uses)
        self.odds.reused(uses, weight)
        node.uses = uses + 1

    def _gap_model(self, uses: int) -> GapModel:
        group = self.gaps[_group(uses)]
        return group if group.seen >= GROUP_SETTLES else self.all_gaps

    def _weight(self, tokens: int) -> float:
        """What an observation of ``tokens`` counts for (tokens are what eviction trades),
        relative to the typical observation so far (so learning speed is the same whatever
        the lengths)."""
        self.mean_tokens += TOKENS_SMOOTHING * (tokens - self.mean_tokens)
        return tokens / self.mean_tokens


def make_policy(name: str, capacity_tokens: int) -> EvictionPolicy:
    """The policy called ``name`` for a cache of ``capacity_tokens`` (both tiers)."""
    if name == "lru":
        return LRUPolicy()
    if name == "adaptive":
        return AdaptivePolicy(capacity_tokens)
    raise ValueError(f"radix_eviction_policy must be one of {RADIX_EVICTION_POLICIES}, "
                     f"got {name!r}")


def _path_tail(node: NodeStats) -> list[int]:
    """The last ``GHOST_WINDOW`` tokens of the path ending with ``node``'s edge."""
    parts: list[list[int]] = []
    total = 0
    while node.parent is not None and total < GHOST_WINDOW:  # the root has no parent
        parts.append(node.key)
        total += len(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part][-GHOST_WINDOW:]


def _group(uses: int) -> int:
    """The gap model a prefix used ``uses`` times reads (GROUP_BOUNDS)."""
    return sum(1 for bound in GROUP_BOUNDS if uses >= bound)


def _own_count(uses: int) -> int:
    """Gaps a prefix used ``uses`` times has seen of its own (its mean remembers this
    many)."""
    return min(uses - 1, GAP_MEMORY)
