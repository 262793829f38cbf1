"""The engine in a process of its own, behind the same ``EngineHandle`` as in-process.

Why: in the Triton stub, the engine's step loop and the threads that build and send
responses share one interpreter lock. A decode step is many short host operations, each
of which may wait for the lock behind a thread building a response; on the H200 a 2.5 ms
step of the 1B shape took ~6 ms inside tritonserver. Here the engine steps in a child
process with an interpreter of its own (``backend.engine_worker``) and sends each step's
outputs to the stub in one message; the stub only routes and sends responses.

Several stubs may share one engine (``shared_engine.open_shared``): Triton runs each model instance in
a stub process of its own, and with N instances on one device, N stubs take requests in
and send responses in parallel, in front of one engine, KV pool and radix cache. The
first stub starts the engine process and has it listen on a Unix socket in a private
runtime folder (``runtime_dir``); the others attach to it there. The messages are in
``engine_protocol``.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from backend import engine_protocol as proto
from backend.core.handle import EngineDied, GenerateRequest, OutputBatch, Submission
from backend.core.parallel.env import MULTICAST_OFF
from backend.runtime_dir import FileLock, SocketAddress

log = logging.getLogger("radixlm.engine_process")


class EngineProcessDied(EngineDied):
    """The engine's process is gone (crashed, killed, or never started)."""


def child_python() -> str:
    """The interpreter for the child: the stub's own when it is a Python binary, else the
    first ``python3`` on PATH (the stub imports from that one's site-packages)."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python") and os.access(exe, os.X_OK):
        return exe
    found = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}") \
        or shutil.which("python3")
    if not found:
        raise EngineProcessDied("no python3 on PATH to run the engine process with")
    return found


class EngineProcess:
    """An ``EngineHandle`` for an engine in a child process. ``EngineProcess(config)``
    starts the child; with ``listen`` the child also lets other stubs ``attach``."""

    def __init__(self, config, start_timeout_s: float = 1800.0, python: str | None = None,
                 rpc_timeout_s: float = 60.0, listen: SocketAddress | None = None) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the child imports exactly what this interpreter can
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.update(MULTICAST_OFF)  # NCCL of tensor-parallel ranks: no NVLink multicast
        self.python = python or child_python()
        proc = subprocess.Popen(
            [self.python, "-m", "backend.engine_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        start = proto.Start(dataclasses.asdict(config),
                            dataclasses.asdict(listen) if listen is not None else None)
        self._open(config, ours, proc, start, start_timeout_s, rpc_timeout_s)

    @classmethod
    def attach(cls, address: SocketAddress, config, start_timeout_s: float = 60.0,
               rpc_timeout_s: float = 60.0) -> "EngineProcess":
        """Share the engine process another stub started with ``listen=address``. Raises
        ``ConnectionRefusedError`` (or ``FileNotFoundError``) when nothing listens there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            address.connect(sock)
        except OSError:
            sock.close()
            raise
        self = cls.__new__(cls)
        self.python = None
        self._open(config, sock, None, proto.Attach(), start_timeout_s, rpc_timeout_s)
        return self

    def _open(self, config, sock: socket.socket, proc: subprocess.Popen | None, first,
              start_timeout_s: float, rpc_timeout_s: float) -> None:
        self.config = config
        self._channel = proto.Channel(sock)
        self._proc = proc  # None: attached to a child another stub started
        self._rpc_timeout_s = rpc_timeout_s
        # Messages leave through a writer thread: the caller (Triton's execute) only
        # queues, so it never gives up the GIL for a socket write and then waits behind
        # the router and senders to get it back. What queued up leaves as one frame.
        self._outq: collections.deque = collections.deque()
        self._out_ready = threading.Event()
        self._writer: threading.Thread | None = None
        self._cv = threading.Condition()
        self._batches: collections.deque[OutputBatch] = collections.deque()
        # the lag from a step message leaving the child to the reader here (diagnosis)
        self.transfer = {"messages": 0, "lag_s": 0.0, "max_lag_s": 0.0}
        self._replies: dict[int, Any] = {}
        self._next_token = 0
        self._dead: str | None = None
        self._left: bool | None = None  # the child's answer to Leave: was this the last stub
        self.lock: FileLock | None = None  # shared (open_shared): held while leaving
        self.address: SocketAddress | None = None  # shared: the engine's socket
        self._tokenizer = None
        try:
            self._channel.send(first)
            self.info = self._await_ready(start_timeout_s)
        except BaseException:
            self.close(0.0)
            raise
        self._reader = threading.Thread(target=self._read, name="radixlm-engine-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="radixlm-engine-writer",
                                        daemon=True)
        self._writer.start()

    # ---- start and stop
    @property
    def started_here(self) -> bool:
        """This stub started the child (and reports the engine-wide gauges)."""
        return self._proc is not None

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else self.info.pid

    def _exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def _await_ready(self, timeout_s: float) -> proto.Ready:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                messages = self._channel.recv(0.5)
            except TimeoutError:
                if self._exit_code() is not None:
                    break
                continue
            except (EOFError, OSError, proto.ProtocolError):
                break
            for msg in messages:
                if isinstance(msg, proto.Ready):
                    return msg
                if isinstance(msg, proto.StartFailed):
                    raise EngineProcessDied(msg.message)
        code = self._exit_code()
        if code is not None:
            raise EngineProcessDied(f"the engine process exited with status {code} while "
                                    "starting (its error is in the server log)")
        if time.monotonic() >= deadline:
            raise EngineProcessDied(f"the engine process did not start within {timeout_s:.0f} s")
        raise EngineProcessDied("the engine process closed the connection while starting")

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave the child: ask, and wait up to ``timeout_s`` for its answer. When no other
        stub is attached it exits; the stub that started it waits for that (up to
        ``timeout_s``, then kills it). A shared engine's lock is held meanwhile, so that no
        stub attaches to a child that is about to end; the last stub removes the lock, and
        a stub that finds the child gone (killed: it could not remove its socket) removes
        the socket too."""
        if self.lock is None:
            self._close(timeout_s)
            return
        with self.lock:
            engine_gone = self._close(timeout_s)
            if engine_gone and self.address is not None:
                self.address.unlink()
            if self._left or engine_gone:
                self.lock.remove()

    def _close(self, timeout_s: float) -> bool:
        """Leave; True when the child was found gone (it ended without answering)."""
        try:
            self._send(proto.Leave())
        except (OSError, EngineDied):
            pass
        if self._writer is not None:  # it ends once Leave has left
            self._writer.join(min(timeout_s, 5.0))
            with self._cv:
                self._cv.wait_for(lambda: self._left is not None or self._dead is not None,
                                  timeout_s)
        with self._cv:
            engine_gone = self._left is None and self._dead is not None
        if self._proc is not None and self._left is not False:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10.0)
        self._channel.close()
        with self._cv:
            self._dead = self._dead or "the engine process was closed"
            self._cv.notify_all()
        return engine_gone

    # ---- EngineHandle (submission from any thread)
    def _send(self, msg) -> None:
        if self._dead is not None:
            raise EngineProcessDied(self._dead)
        self._outq.append(msg)  # no lock: deque appends are atomic
        # Set only when clear: a set flag means the writer has not yet cleared it, and
        # it drains the queue (this message included) after clearing. Setting takes
        # the event's lock, once per request in a burst otherwise.
        if not self._out_ready.is_set():
            self._out_ready.set()

    def _write(self) -> None:
        queued = self._outq
        while True:
            self._out_ready.wait()
            self._out_ready.clear()  # before draining: a later append sets it again
            batch = []
            while queued:
                batch.append(queued.popleft())
            try:
                if batch:
                    self._channel.send(*batch)
            except (OSError, proto.ProtocolError) as exc:
                log.error("sending to the engine process failed: %s", exc)
                return  # the reader notices the child is gone and says why
            if any(isinstance(msg, proto.Leave) for msg in batch):
                return

    def submit(self, request: Submission) -> None:
        if isinstance(request, GenerateRequest):
            self._send(proto.Generate(request.request_id, request.prompt,
                                      request.params.to_dict(), request.stream))
        else:
            self._send(proto.Score(request.request_id, request.prompt, list(request.choices)))

    def abort(self, request_id: str) -> None:
        try:
            self._send(proto.Abort(request_id))
        except (OSError, EngineDied):
            pass  # nothing left to abort

    def prompt_text(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            from backend.core.loaders import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.tokenizer_dir)
        return self._tokenizer.decode(token_ids)

    # ---- EngineHandle (the loop thread)
    def next_outputs(self, timeout_s: float) -> OutputBatch:
        """Every batch the child sent since the last call, as one (waiting up to
        ``timeout_s`` for one). A step failure comes after the outputs that preceded it."""
        with self._cv:
            if not self._batches and self._dead is None:
                self._cv.wait(timeout_s)
            if not self._batches:
                if self._dead is not None:
                    raise EngineProcessDied(self._dead)
                return OutputBatch()
            merged = self._batches.popleft()
            while self._batches and merged.step_error is None:
                more = self._batches.popleft()
                merged.outputs.extend(more.outputs)
                merged.step_error = more.step_error
                if more.arrivals:
                    merged.arrivals = {**(merged.arrivals or {}), **more.arrivals}
            return merged

    def stats(self) -> dict:
        stats = self._call("stats")
        with self._cv:
            stats["transfer"] = {k: round(v, 6) for k, v in self.transfer.items()}
        return stats

    def flush_cache(self) -> int:
        return self._call("flush_cache")

    def check_integrity(self) -> None:
        error = self._call("integrity")
        if error is not None:
            raise AssertionError(error)

    def _call(self, what: str):
        with self._cv:
            token = self._next_token
            self._next_token += 1
        self._send(proto.Query(token, what))
        with self._cv:
            if not self._cv.wait_for(lambda: token in self._replies or self._dead is not None,
                                     self._rpc_timeout_s):
                raise TimeoutError(f"the engine process did not answer {what!r} "
                                   f"within {self._rpc_timeout_s:.0f} s")
            if token not in self._replies:
                raise EngineProcessDied(self._dead)
            return self._replies.pop(token)

    # ---- the reader thread
    def _read(self) -> None:
        reason = None
        try:
            while True:
                messages = self._channel.recv()
                with self._cv:
                    for msg in messages:
                        self._receive(msg)
                    self._cv.notify_all()
        except (EOFError, OSError) as exc:
            reason = type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - a bad message ends the channel
            reason = f"{type(exc).__name__}: {exc}"
        try:
            code = self._proc.wait(2.0) if self._proc is not None and self._left is not False \
                else None
        except subprocess.TimeoutExpired:
            code = None
        with self._cv:
            if self._dead is None:
                self._dead = (f"the engine process exited (status {code})" if code is not None
                              else f"lost the engine process ({reason})")
            self._cv.notify_all()

    def _receive(self, msg) -> None:
        """One message from the child (under the lock)."""
        if isinstance(msg, proto.Outputs):
            self._batches.append(OutputBatch(msg.outputs, msg.made_at, arrivals=msg.arrivals))
            lag = time.time() - msg.made_at
            transfer = self.transfer
            transfer["messages"] += 1
            transfer["lag_s"] += lag
            transfer["max_lag_s"] = max(transfer["max_lag_s"], lag)
        elif isinstance(msg, proto.StepFailed):
            self._batches.append(OutputBatch(made_at=time.time(), step_error=msg.message))
        elif isinstance(msg, proto.Reply):
            self._replies[msg.token] = msg.value
        elif isinstance(msg, proto.Left):
            self._left = msg.last
