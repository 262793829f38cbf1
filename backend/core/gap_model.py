"""How long until a prefix is used again (plain Python): the gap model of one group of
prefixes, learned from the gaps observed between their uses.

Two ways to read a prefix's age are learned side by side and averaged, each weighed by
how likely it is to be the better one (from how well each has predicted the recent gaps:
a mean log-likelihood ratio):

* **absolute**: gaps relative to the group's typical gap. Right where the prefixes of a
  group come back at one rate (chats whose users think alike): a prefix's own few gaps
  are noise around it.
* **relative**: gaps relative to the prefix's own mean gap (drawn towards the typical
  one while it has seen few). Right where rates differ (tenants of Zipf popularity):
  a popular prefix is due sooner than a rare one of the same age.

Each reading's ``GapShape`` turns an age into P(back later than that) and the expected wait
left, in ticks of the use clock.
"""
from __future__ import annotations

import math

from .reuse_model import GapShape

# the typical gap and the evidence move this share towards each observation (of weight 1)
SMOOTHING = 1 / 64
# gaps seen before the absolute reading counts (the relative one is the prior)
SETTLES = 32
# a prefix's own mean gap is weighed against this many typical gaps
OWN_PRIOR = 2.0


class GapModel:
    def __init__(self) -> None:
        self.typical = 0.0
        self.absolute = GapShape()  # observed / typical
        self.relative = GapShape()  # observed / own estimate
        self.evidence = 0.0  # how much better absolute predicts (mean log-likelihood)
        self.seen = 0.0

    def own_estimate(self, own_gap: float, own_count: int) -> float:
        """A prefix's mean gap from its ``own_count`` gaps (mean ``own_gap``)."""
        if own_count <= 0 or self.typical == 0:
            return own_gap or self.typical
        return (OWN_PRIOR * self.typical + own_count * own_gap) / (OWN_PRIOR + own_count)

    @property
    def reads_absolute(self) -> bool:
        """Whether the absolute reading weighs more (relative until it has proved better
        on enough gaps)."""
        return self.absolute_weight > 0.5

    def observe(self, observed: float, own_gap: float, own_count: int,
                weight: float = 1.0) -> None:
        """A prefix of the group came back after ``observed`` ticks; its ``own_count``
        gaps before averaged ``own_gap``; ``weight``: what the observation counts for."""
        if self.typical > 0:
            typical = max(self.typical, 1.0)
            own = max(self.own_estimate(own_gap, own_count), 1.0)
            if own_count > 0:  # a prefix without gaps of its own reads absolute anyway
                gain = (self.absolute.log_density(observed / typical) - math.log(typical)
                        - self.relative.log_density(observed / own) + math.log(own))
                self.evidence += min(SMOOTHING * weight, 0.5) * (gain - self.evidence)
                self.relative.add(observed / own, weight)
            self.absolute.add(observed / typical, weight)
        # the typical gap: a plain mean at first, then a moving one; every gap counts the
        # same here (a large prefix's gap is no better a sample of the rate)
        self.seen += 1
        self.typical += max(SMOOTHING, 1 / self.seen) * (observed - self.typical)

    def tail(self, age: float, own_gap: float, own_count: int) -> tuple[float, float]:
        """(P(back after more than ``age`` ticks), expected ticks left if so): the two
        readings averaged, each weighed by how likely it is the better one."""
        typical = max(self.typical, 1.0)
        s_abs, r_abs = self.absolute.tail(age / typical)
        w = self.absolute_weight if own_count > 0 else 1.0
        if w >= 1.0:
            return s_abs, r_abs * typical
        own = max(self.own_estimate(own_gap, own_count), 1.0)
        s_rel, r_rel = self.relative.tail(age / own)
        survival = w * s_abs + (1 - w) * s_rel
        if survival <= 0.0:
            return 0.0, w * r_abs * typical + (1 - w) * r_rel * own
        return survival, (w * s_abs * r_abs * typical + (1 - w) * s_rel * r_rel * own) / survival

    @property
    def absolute_weight(self) -> float:
        """P(the absolute reading is the better one): the evidence is a mean log-likelihood
        ratio over about 1 / SMOOTHING recent gaps; none before SETTLES gaps."""
        if self.seen < SETTLES:
            return 0.0
        logit = max(min(self.evidence / SMOOTHING, 30.0), -30.0)
        return 1 / (1 + math.exp(-logit))
