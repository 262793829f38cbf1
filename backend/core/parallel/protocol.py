"""What rank 0 sends the other ranks of a tensor-parallel engine, and its codec.

One message per step, before rank 0 starts the step's forward pass: the request-table
writes and the batch's host lists (``forward_batch.BatchSpec``), so every rank builds
the same ``ForwardBatch`` and runs the same collectives in the same order. Then the
``Stop`` message when the engine closes (or the connection's end, if rank 0 is gone).

A frame is msgpack of plain types (maps, lists, numbers, booleans), decoded into these
dataclasses by field name; anything else is refused. Nothing received is executed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack

from ..forward_batch import BatchSpec


class RankProtocolError(ValueError):
    """A frame that is not one of the messages below."""


@dataclass(frozen=True)
class RankStep:
    """One step's device work, as every rank runs it."""

    table_writes: list[list]  # [row, start, slots] as schedule_plan.TableWrite
    batch: BatchSpec
    # rows sampled this step (rank 0 broadcasts the tokens when the next step may read
    # them through placeholders, i.e. with overlap scheduling); 0: none
    num_sampled: int = 0


@dataclass(frozen=True)
class Stop:
    pass


RankMessage = RankStep | Stop
_KINDS = {"step": RankStep, "stop": Stop}


def encode(msg: RankMessage) -> bytes:
    if isinstance(msg, RankStep):
        plain = {"kind": "step", "table_writes": [list(w) for w in msg.table_writes],
                 "batch": dataclasses.asdict(msg.batch), "num_sampled": msg.num_sampled}
    elif isinstance(msg, Stop):
        plain = {"kind": "stop"}
    else:
        raise RankProtocolError(f"not a rank message: {type(msg).__name__}")
    return msgpack.packb(plain, use_bin_type=True)


def decode(payload: bytes) -> RankMessage:
    try:
        plain = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise RankProtocolError(f"undecodable frame: {exc}") from exc
    if not isinstance(plain, dict) or plain.get("kind") not in _KINDS:
        raise RankProtocolError("a rank message is a map with a known 'kind'")
    if plain["kind"] == "stop":
        return Stop()
    try:
        batch = BatchSpec(**plain["batch"])
        writes = [[int(row), int(start), [int(s) for s in slots]]
                  for row, start, slots in plain["table_writes"]]
        return RankStep(writes, batch, int(plain["num_sampled"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise RankProtocolError(f"malformed step: {exc}") from exc
