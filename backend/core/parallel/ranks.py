"""Rank 0's side of a tensor-parallel engine: the other ranks' processes, the line each
step goes down, and a watcher that notices a rank that died.

Ranks 1..N-1 are forked from a fork server that imported torch and the model code once
(``rank_worker`` preloaded), so starting them costs no interpreter start-up each; they
never share memory with rank 0. Each reads steps from a one-way pipe; when rank 0 ends,
its end of the pipe closes and they exit, so no rank outlives the engine. A rank that
dies makes the engine fail: ``failure`` says which, the collectives waiting for it are
broken (gloo fails them by itself, NCCL's are aborted), and ``close`` stops the rest.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

from ..config import EngineConfig
from ..handle import EngineDied
from .group import TensorParallel, join, rank_device
from .protocol import RankMessage, RankStep, Stop, encode

log = logging.getLogger("radixlm.ranks")
WORKER_MODULE = "backend.core.parallel.rank_worker"
# what every rank imports, imported once by the fork server (transformers reads the
# checkpoint's config and rope tables: seconds of imports per rank otherwise)
PRELOAD = (WORKER_MODULE, "transformers", "transformers.models.auto.configuration_auto",
           "transformers.modeling_rope_utils", "transformers.configuration_utils",
           "transformers.utils.type_validators")


class RankDied(EngineDied):
    """A rank of a tensor-parallel engine is gone, so the engine is too."""


class RankGroup:
    def __init__(self, config: EngineConfig, on_failure: Callable[[], None] | None = None,
                 stop_timeout_s: float = 10.0) -> None:
        """Start ranks 1..N-1 and join the group as rank 0 (returns once every rank has
        joined). ``on_failure`` is called (from the watcher thread) when a rank dies."""
        size = config.tensor_parallel_size
        self._dir = Path(tempfile.mkdtemp(prefix="radixlm-tp-"))
        self._on_failure = on_failure
        self._stop_timeout_s = stop_timeout_s
        self._closing = threading.Event()
        self.failure: str | None = None
        self.tp: TensorParallel | None = None  # set once every rank has joined
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._lines: list[multiprocessing.connection.Connection] = []
        fields = dataclasses.asdict(config)
        store = str(self._dir / "store")
        from . import rank_worker

        try:
            for rank in range(1, size):
                theirs, ours = context.Pipe(duplex=False)
                proc = context.Process(target=rank_worker.run_rank, name=f"radixlm-rank-{rank}",
                                       args=(rank, size, store, fields, theirs), daemon=True)
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._lines.append(ours)
            self._watcher = threading.Thread(target=self._watch, name="radixlm-rank-watcher",
                                             daemon=True)
            self._watcher.start()
            self.tp = join(0, size, store, rank_device(config.device, 0),
                           still_waiting=self.check)
            log.info("tensor-parallel group of %d ranks joined; ranks 1..%d are processes %s",
                     size, size - 1, self.pids)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The processes of ranks 1..N-1."""
        return [p.pid for p in self._procs]

    def send(self, step: RankStep) -> None:
        self._send(step)

    def _send(self, msg: RankMessage) -> None:
        payload = encode(msg)
        for rank, line in enumerate(self._lines, start=1):
            try:
                line.send_bytes(payload)
            except OSError as exc:
                raise RankDied(self.failure or f"rank {rank} is gone ({exc})") from exc

    def check(self) -> None:
        """Raise ``RankDied`` once a rank has died."""
        if self.failure is not None:
            raise RankDied(self.failure)

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing.is_set():
            return
        rank = sentinels[ready[0]]
        code = self._procs[rank - 1].exitcode
        self.failure = f"tensor-parallel rank {rank} exited (code {code})"
        log.error("%s: the engine stops", self.failure)
        if self.tp is not None:  # None: a rank died before rank 0 joined
            self.tp.abort()
        if self._on_failure is not None:
            self._on_failure()

    def close(self) -> None:
        """Stop every rank (asked first, then terminated, then killed) and remove the
        group's files. Safe to call more than once."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self._send(Stop())
        except RankDied:
            pass
        for line in self._lines:
            line.close()
        for proc in self._procs:
            proc.join(self._stop_timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self._dir, ignore_errors=True)
