"""A bounded history of prefixes that left the cache (plain Python): what the adaptive
eviction policy remembers of them, so that a prefix coming back resumes its statistics
and one that never comes back is counted as such.

A ghost is keyed by where its prefix starts (its depth and the tokens just before it:
the *anchor*) and by its first tokens (the *head*), independent of how the tree happens
to cut the path into edges. A prefix matches a ghost with its anchor when the shorter of
their heads begins the longer (a dropped edge may have been shorter or longer than the
leaf that brings it back)::

    path   ... [ 32 tokens before | head: first 32 tokens of the dropped edge ... ]
                ^ anchor = (depth, tokens before)

Leaves leave first, so the ghosts of a path's deeper edges exist when the edge above them
goes: they are folded into its ghost (``absorb``), and one ghost stands for the dropped
tail of the path, as one leaf will when the path comes back.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

# tokens of context on each side of a prefix's start that identify its ghost
GHOST_WINDOW = 32


class Ghost(NamedTuple):
    uses: int
    last_use: int
    gap: float
    num_tokens: int


class GhostKey(NamedTuple):
    anchor: int
    head: tuple[int, ...]


def anchor_of(before: list[int], depth: int) -> int:
    """The anchor of a prefix starting at ``depth`` after the tokens ``before``."""
    return hash((depth, tuple(before[-GHOST_WINDOW:])))


def ghost_key(before: list[int], start: list[int], depth: int) -> GhostKey:
    return GhostKey(anchor_of(before, depth), tuple(start[:GHOST_WINDOW]))


class GhostHistory:
    """Ghosts, oldest forgotten first, bounded by the tokens they stand for."""

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

    def remember(self, key: GhostKey, ghost: Ghost) -> list[Ghost]:
        """Keep ``ghost``; returns the ghosts forgotten to make room (oldest first):
        prefixes that did not come back while remembered."""
        if key in self._entries:
            self._forget(key)
        self._entries[key] = ghost
        self._heads.setdefault(key.anchor, []).append(key.head)
        self._tokens += ghost.num_tokens
        forgotten = []
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            forgotten.append(self._forget(next(iter(self._entries))))
        return forgotten

    def recall(self, key: GhostKey) -> Ghost | None:
        """The ghost matching ``key``, forgotten as it is read (the prefix is back)."""
        found = self._find(key)
        return self._forget(found) if found is not None else None

    def absorb(self, anchor: int) -> int:
        """Forget every ghost starting at ``anchor`` (the edge above them is leaving and
        its ghost stands for them); returns the tokens they stood for."""
        tokens = 0
        for head in list(self._heads.get(anchor, ())):
            tokens += self._forget(GhostKey(anchor, head)).num_tokens
        return tokens

    def _forget(self, key: GhostKey) -> Ghost:
        ghost = self._entries.pop(key)
        heads = self._heads[key.anchor]
        heads.remove(key.head)
        if not heads:
            del self._heads[key.anchor]
        self._tokens -= ghost.num_tokens
        return ghost
