"""The tensor-parallel group of one engine: its rank, its size, and the collectives the
model runs (a sum after each row-parallel projection and the vocabulary-parallel
embedding, a gather of vocabulary-parallel logits, a broadcast of sampled tokens).

The process group is an object of this engine (not torch's default group), so a process
may hold several engines and tear one down without touching the others. gloo on CPU,
NCCL on CUDA; NVLink multicast stays off (``MULTICAST_OFF``, set before NCCL starts).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .env import MULTICAST_OFF

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group. ``group`` is None at size 1, where every
    collective is the identity."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a c10d ProcessGroupGloo / ProcessGroupNCCL

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place."""
        if self.size > 1:
            self.group.broadcast(x, 0).wait()
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks (sizes every rank must agree on)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], options).wait()
        return int(t.item())

    def abort(self) -> None:
        """Break collectives that wait on a dead rank (NCCL waits forever; gloo already
        fails them when a peer's connection closes)."""
        if self.group is not None and isinstance(self.group, _nccl_class()):
            self.group.abort()


def _nccl_class() -> type:
    return dist.ProcessGroupNCCL if dist.is_nccl_available() else type(None)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: CUDA ranks take consecutive GPUs from the configured one."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def join(rank: int, size: int, store_path: str, device: torch.device,
         timeout_s: float = DEFAULT_TIMEOUT_S,
         still_waiting: Callable[[], None] | None = None) -> TensorParallel:
    """Join the group whose ranks meet at the file ``store_path`` (blocks until all
    ``size`` ranks have joined). ``still_waiting`` is called about once a second until
    every rank has arrived; it raises to give up (a rank that died on the way)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.FileStore(store_path, size)
    store.set(f"arrived/{rank}", "1")
    if still_waiting is not None:
        keys = [f"arrived/{r}" for r in range(size)]
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=1))
                break
            except (RuntimeError, dist.DistStoreError):  # not all there yet
                still_waiting()
    if device.type == "cuda":
        os.environ.update(MULTICAST_OFF)  # read when the communicator starts
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    return TensorParallel(rank, size, group)
