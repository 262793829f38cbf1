"""What one scheduler step decides, in the form the device side receives it (plain Python).

``Scheduler.schedule()`` returns a ``SchedulePlan``: ``Engine.step`` runs its tier copies
(``KVMover``), ``ForwardStep.launch`` its table writes and its items' forward, and
``StepProcessor`` accounts for the items' tokens. These types are the one boundary
between the scheduler and the device side, so they live apart from ``scheduler.py``:
the device side reads them without importing the scheduler's policy, and a reader finds
what crosses in one short file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .host_tier import HostCopy
from .request import Req


@dataclass(slots=True)
class ScheduledItem:
    req: Req
    num_new: int  # tokens given KV this step
    start_pos: int  # position of the first of them (= tokens with KV before this step)
    new_slots: list[int]
    samples: bool  # all of the request's tokens have KV after this step: it samples one
    out_index: int = -1  # where its sampled token goes in output_ids (set at launch)


class TableWrite(NamedTuple):
    """Positions ``start..start + len(slots)`` of table row ``row`` now hold ``slots``."""

    row: int
    start: int
    slots: list[int]


@dataclass(slots=True)
class SchedulePlan:
    """One step's decisions: what the forward side runs, what it writes first."""

    items: list[ScheduledItem]
    # applied to the request-to-token table, in order, before this step's forward
    table_writes: list[TableWrite] = field(default_factory=list)
    # running requests that cannot grow (one alone fills the KV pool): to finish, "length"
    out_of_room: list[Req] = field(default_factory=list)
    # copies between the device and host tiers, run in this order before this step's
    # forward (also when there are no items)
    host_copies: list[HostCopy] = field(default_factory=list)
