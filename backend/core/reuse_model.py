"""What the adaptive eviction policy learns from traffic (plain Python, no state shared
between caches): how gaps between uses are distributed, and how likely a prefix used k
times is to be used again.

Gaps are learned *relative to an expected gap* (``x = gap / expected``; the prefix's own
or its group's, ``gap_model.py``), so one histogram describes the shape of reuse
whatever the rate: strictly
periodic traffic (cycles) puts all mass at x = 1, memoryless traffic (independent
requests to popular prefixes) spreads it as an exponential, chats with think times lie
in between. From the shape, a prefix that has waited ``u`` expected gaps since its last
use has ``survival(u)`` = P(X > u) and an expected remaining wait ``E[X - u | X > u]``:
shrinking with u for periodic reuse (the prefix is due), constant for memoryless reuse.
"""
from __future__ import annotations

import math

# relative gaps are binned up to this many expected gaps; beyond is one overflow bin
MAX_RATIO = 8.0
NUM_BINS = 32
# observations before the counts are halved (old traffic fades)
HISTOGRAM_HORIZON = 2048
# tables are rebuilt after this many new observations
REFRESH_EVERY = 8
# observations' worth of the class below that a class of reuse odds starts from
ODDS_PRIOR = 2.0
# the prior: this many observations spread as an exponential (memoryless reuse)
PRIOR_WEIGHT = 8.0


class GapShape:
    """Histogram of relative gaps, with the tail statistics eviction reads."""

    def __init__(self) -> None:
        self.width = MAX_RATIO / NUM_BINS
        self.counts = [0.0] * (NUM_BINS + 1)  # the last bin: x >= MAX_RATIO
        self.sums = [0.0] * (NUM_BINS + 1)
        for i in range(NUM_BINS + 1):  # exponential prior: mass e^-lo - e^-hi per bin
            lo = i * self.width
            hi = (i + 1) * self.width if i < NUM_BINS else math.inf
            mass = PRIOR_WEIGHT * (math.exp(-lo) - math.exp(-hi))
            self.counts[i] = mass
            self.sums[i] = mass * (lo + 1.0 if hi == math.inf else (lo + hi) / 2)
        self._pending = 0
        self._survival: list[float] = []  # P(X >= lower edge of bin i)
        self._integral: list[float] = []  # integral of P(X > x) from that edge on
        self._refresh()

    def add(self, ratio: float, weight: float = 1.0) -> None:
        i = min(int(ratio / self.width), NUM_BINS)
        self.counts[i] += weight
        self.sums[i] += weight * ratio
        self._pending += 1
        if sum(self.counts) > HISTOGRAM_HORIZON:
            self.counts = [c / 2 for c in self.counts]
            self.sums = [s / 2 for s in self.sums]
        if self._pending >= REFRESH_EVERY:
            self._refresh()

    def _refresh(self) -> None:
        """Survival at each bin's lower edge, and the integral of the survival from there
        on (the survival is taken as linear within a bin; past the last edge the mean of
        the overflow bin gives its integral)."""
        total = sum(self.counts)
        edges = [0.0] * (NUM_BINS + 1)
        count = 0.0
        for i in range(NUM_BINS, -1, -1):
            count += self.counts[i]
            edges[i] = count / total
        over = self.counts[NUM_BINS]
        beyond = edges[NUM_BINS] * (self.sums[NUM_BINS] / over - MAX_RATIO) if over > 0 else 0.0
        integrals = [0.0] * (NUM_BINS + 1)
        integrals[NUM_BINS] = beyond
        for i in range(NUM_BINS - 1, -1, -1):
            integrals[i] = integrals[i + 1] + self.width * (edges[i] + edges[i + 1]) / 2
        self._survival, self._integral = edges, integrals
        self._pending = 0

    def log_density(self, ratio: float) -> float:
        """log of the learned density of relative gaps at ``ratio``."""
        i = min(int(ratio / self.width), NUM_BINS)
        width = self.width if i < NUM_BINS else MAX_RATIO
        return math.log(max(self.counts[i], 1e-3) / sum(self.counts) / width)

    def tail(self, u: float) -> tuple[float, float]:
        """(P(X > u), E[X - u | X > u]) for a prefix ``u`` expected gaps past its last use."""
        if u >= MAX_RATIO:  # past the histogram the data says little: the wait grows with age
            over = self.counts[NUM_BINS]
            mean = self.sums[NUM_BINS] / over if over > 0 else MAX_RATIO + 1.0
            return self._survival[NUM_BINS], max(mean - u, u / 2)
        i = int(u / self.width)
        hi = (i + 1) * self.width
        s_lo, s_hi = self._survival[i], self._survival[i + 1]
        survival = s_lo + (s_hi - s_lo) * (u - i * self.width) / self.width
        if survival <= 0.0:
            return 0.0, self.width / 2
        area = (hi - u) * (survival + s_hi) / 2 + self._integral[i + 1]
        return survival, max(area / survival, self.width / 4)


class ReuseOdds:
    """P(a prefix used k times is used again), learned per k up to ``max_class``.

    A class with little data leans on the one below it (``ODDS_PRIOR`` observations at
    its odds; class 1 on even odds): a prefix used more often than any seen so far is
    taken to come back as often as the most used ones did.
    """

    def __init__(self, max_class: int = 4, horizon: int = 4096) -> None:
        self.max_class = max_class
        self.horizon = horizon
        self._reused = [0.0] * (max_class + 1)
        self._dropped = [0.0] * (max_class + 1)
        self._odds: list[float] = []
        self._refresh()

    def _k(self, uses: int) -> int:
        return min(max(uses, 1), self.max_class)

    def probability(self, uses: int) -> float:
        return self._odds[self._k(uses)]

    def reused(self, uses: int, weight: float = 1.0) -> None:
        self._reused[self._k(uses)] += weight
        self._fade()

    def dropped(self, uses: int, weight: float = 1.0) -> None:
        self._dropped[self._k(uses)] += weight
        self._fade()

    def undropped(self, uses: int, weight: float = 1.0) -> None:
        """A prefix counted as dropped came back after all."""
        k = self._k(uses)
        self._dropped[k] = max(self._dropped[k] - weight, 0.0)
        self._refresh()

    def _fade(self) -> None:
        if sum(self._reused) + sum(self._dropped) > self.horizon:
            self._reused = [c / 2 for c in self._reused]
            self._dropped = [c / 2 for c in self._dropped]
        self._refresh()

    def _refresh(self) -> None:
        odds, below = [0.5] * (self.max_class + 1), 0.5
        for k in range(1, self.max_class + 1):
            below = (self._reused[k] + ODDS_PRIOR * below) / (
                self._reused[k] + self._dropped[k] + ODDS_PRIOR)
            odds[k] = below
        self._odds = odds
