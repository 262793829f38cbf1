"""The engine in a process of its own, behind the interface ``serving.EngineLoop`` uses.

Why: in the Triton stub, the engine's step loop and the threads that build and send
responses share one interpreter lock. A decode step is many short host operations, each
of which may wait for the lock behind a thread building a response; on the H200 a 2.5 ms
step of the 1B shape took ~6 ms inside tritonserver. Here the engine steps in a child
process with an interpreter of its own (``backend.engine_worker``) and sends each step's
outputs to the stub in one message; the stub only routes and sends responses.

``EngineProcess`` (in the stub) has the methods EngineLoop calls on an ``Engine``:
``add_request``, ``add_score_request``, ``abort``, ``has_work``, ``wait_for_work``,
``step``, ``stats``, ``check_integrity``, ``tokenizer``, plus ``close``. Bad prompts
(empty, too long, a constraint that does not compile) come back as an error output for
that request, not as ``ValueError``: the child finds them, after ``add_request`` returned.

Several stubs may share one engine (``open_shared``): Triton runs each model instance in
a stub process of its own and hands each stub one request per ``execute`` call, and each
stub's responses leave one send at a time; with N instances on one device, N stubs take
requests in and send responses in parallel, in front of one engine, KV pool and radix
cache. The first stub starts the engine process and has it listen on a Unix socket; the
others attach to it there.

Messages (each stub has its own connection; outputs go to the stub that added the request):
  stub -> child: ("init", config, listen address or None)   (the starting stub, first)
                 ("hello",)                                  (an attaching stub, first)
                 ("add", rid, prompt, params, stream) ("score", rid, prompt, choices)
                 ("abort", rid) ("stats", token) ("integrity", token) ("close",)
  child -> stub: ("ready", info) ("init_error", message)
                 ("out", [output tuples], busy, sent_at, received)
                 ("step_error", message)
                 ("reply", token, value) ("bye", last)
On "close" the child answers "bye" and lets the stub go; it exits once the last stub has
gone (or its socket closed: a stub that died has its requests aborted). ``sent_at`` is the
child's wall clock when the step's outputs left: ``last_made_at`` (the oldest of those the
last ``step`` returned) and ``transfer`` (the lag from there to the stub's reader) show
where a response's time went. When the stub traces requests (``RADIXLM_TRACE_REQUESTS``,
which the child inherits), ``received`` maps each request whose first output is in the
message to the child's wall clock when its "add" arrived (``received_at`` in the stub).
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dataclasses import fields

from backend.core.outputs import StepOutput

_FIELDS = tuple(f.name for f in fields(StepOutput))

log = logging.getLogger("radixlm.engine_process")


class EngineProcessDied(RuntimeError):
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
    """An ``Engine`` running in a child process; see the module docstring.

    ``EngineProcess(config)`` starts the child; with ``listen`` (a Unix socket address) the
    child also lets other stubs ``attach`` to it there."""

    def __init__(self, config, start_timeout_s: float = 1800.0, python: str | None = None,
                 rpc_timeout_s: float = 60.0, listen: str | None = None) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the child imports exactly what this interpreter can
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.python = python or child_python()
        proc = subprocess.Popen(
            [self.python, "-m", "backend.engine_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        conn = Connection(os.dup(ours.fileno()))
        ours.close()
        self._open(config, conn, proc, ("init", config, listen), start_timeout_s, rpc_timeout_s)

    @classmethod
    def attach(cls, address: str, config, start_timeout_s: float = 60.0,
               rpc_timeout_s: float = 60.0) -> "EngineProcess":
        """Share the engine process another stub started with ``listen=address``. Raises
        ``ConnectionRefusedError`` (or ``FileNotFoundError``) when nothing listens there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        self = cls.__new__(cls)
        self.python = None
        self._open(config, Connection(sock.detach()), None, ("hello",), start_timeout_s,
                   rpc_timeout_s)
        return self

    def _open(self, config, conn: Connection, proc: subprocess.Popen | None, first,
              start_timeout_s: float, rpc_timeout_s: float) -> None:
        self.config = config
        self._conn = conn
        self._proc = proc  # None: attached to a child another stub started
        self._rpc_timeout_s = rpc_timeout_s
        # Messages leave through a writer thread: the caller (Triton's execute) only
        # queues, so it never gives up the GIL for a socket write and then waits behind
        # the router and senders to get it back. What queued up meanwhile leaves as one
        # message.
        self._outq: collections.deque = collections.deque()
        self._out_ready = threading.Event()
        self._writer: threading.Thread | None = None
        self._cv = threading.Condition()
        # (output list, the child's sent_at) per step message, or a step error (str)
        self._events: collections.deque = collections.deque()
        self.last_made_at: float | None = None  # see the module docstring
        self.received_at: dict[str, float] = {}  # see the module docstring
        self.transfer = {"messages": 0, "lag_s": 0.0, "max_lag_s": 0.0}
        self._busy = False  # the child had work after its last step
        self._replies: dict[int, Any] = {}
        self._next_token = 0
        self._dead: str | None = None
        self._bye: bool | None = None  # the child's answer to "close": was this the last stub
        self.lock_path: Path | None = None  # shared (open_shared): held while leaving
        self._tokenizer = None
        self.info: dict = {}
        try:
            self._conn.send(first)
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

    def _exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def _await_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._conn.poll(0.5):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "init_error":
                    raise EngineProcessDied(msg[1])
            elif self._exit_code() is not None:
                break
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
        stub attaches to a child that is about to end."""
        if self.lock_path is None:
            self._close(timeout_s)
            return
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._close(timeout_s)

    def _close(self, timeout_s: float) -> None:
        try:
            self._send(("close",))
        except (OSError, EngineProcessDied, ValueError):
            pass
        if self._writer is not None:  # it ends once "close" has left
            self._writer.join(min(timeout_s, 5.0))
            with self._cv:
                self._cv.wait_for(lambda: self._bye is not None or self._dead is not None,
                                  timeout_s)
        if self._proc is not None and self._bye is not False:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10.0)
        try:
            self._conn.close()
        except OSError:
            pass
        with self._cv:
            self._dead = self._dead or "the engine process was closed"
            self._cv.notify_all()

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else self.info["pid"]

    # ---- submission (any thread)
    def _send(self, msg) -> None:
        if self._dead is not None:
            raise EngineProcessDied(self._dead)
        self._outq.append(msg)  # no lock: deque appends are atomic
        self._out_ready.set()

    # ---- the writer thread
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
                    self._conn.send(batch[0] if len(batch) == 1 else ("many", batch))
            except (OSError, ValueError):
                return  # the reader notices the child is gone and says why
            if any(msg[0] == "close" for msg in batch):
                return

    def add_request(self, prompt, sampling_params=None, request_id: str | None = None,
                    stream: bool = True) -> str:
        if request_id is None:
            raise ValueError("EngineProcess.add_request needs a request_id")
        self._busy = True  # a plain store (no lock to wait for, see _send)
        self._send(("add", request_id, prompt, sampling_params, stream))
        return request_id

    def add_score_request(self, prompt, choices, request_id: str | None = None) -> str:
        if request_id is None:
            raise ValueError("EngineProcess.add_score_request needs a request_id")
        self._busy = True
        self._send(("score", request_id, prompt, choices))
        return request_id

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, EngineProcessDied):
            pass  # nothing left to abort

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_dir)
        return self._tokenizer

    # ---- the loop thread
    def has_work(self) -> bool:
        with self._cv:
            if self._events:
                return True
            if self._dead is not None:
                raise EngineProcessDied(self._dead)
            return self._busy

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Wait until outputs arrive (or the child dies): True when there are some."""
        with self._cv:
            self._cv.wait_for(lambda: self._events or self._dead is not None, timeout)
            if not self._events and self._dead is not None:
                raise EngineProcessDied(self._dead)
            return bool(self._events)

    def step(self, wait_s: float = 0.05) -> list[StepOutput]:
        """The outputs that arrived (waiting up to ``wait_s`` for some). A step error of
        the child's is raised, after the outputs that preceded it were returned."""
        with self._cv:
            if not self._events and self._dead is None:
                self._cv.wait(wait_s)
            outputs: list[StepOutput] = []
            made_at = None
            while self._events:
                item = self._events[0]
                if isinstance(item, str):  # a step error
                    if outputs:
                        break
                    self._events.popleft()
                    raise RuntimeError(item)
                self._events.popleft()
                outputs.extend(item[0])
                made_at = item[1] if made_at is None else made_at
            self.last_made_at = made_at
            if not outputs and not self._events and self._dead is not None:
                raise EngineProcessDied(self._dead)
            return outputs

    def stats(self) -> dict:
        stats = self._call("stats")
        with self._cv:
            transfer = dict(self.transfer)
        stats["transfer"] = {k: round(v, 6) for k, v in transfer.items()}
        return stats

    def check_integrity(self) -> None:
        error = self._call("integrity")
        if error is not None:
            raise AssertionError(error)

    def _call(self, kind: str):
        with self._cv:
            token = self._next_token
            self._next_token += 1
        self._send((kind, token))
        with self._cv:
            if not self._cv.wait_for(lambda: token in self._replies or self._dead is not None,
                                     self._rpc_timeout_s):
                raise TimeoutError(f"the engine process did not answer {kind!r} "
                                   f"within {self._rpc_timeout_s:.0f} s")
            if token not in self._replies:
                raise EngineProcessDied(self._dead)
            return self._replies.pop(token)

    # ---- the reader thread
    def _read(self) -> None:
        reason = None
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                with self._cv:
                    if kind == "out":
                        self._events.append(([StepOutput(**dict(zip(_FIELDS, t))) for t in msg[1]], msg[3]))
                        self._busy = msg[2]
                        if msg[4]:
                            self.received_at.update(msg[4])
                        lag = time.time() - msg[3]
                        transfer = self.transfer
                        transfer["messages"] += 1
                        transfer["lag_s"] += lag
                        if lag > transfer["max_lag_s"]:
                            transfer["max_lag_s"] = lag
                    elif kind == "reply":
                        self._replies[msg[1]] = msg[2]
                    elif kind == "step_error":
                        self._events.append(msg[1])
                    elif kind == "bye":
                        self._bye = msg[1]
                    self._cv.notify_all()
        except (EOFError, OSError) as exc:
            reason = type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - a bad message ends the channel
            reason = f"{type(exc).__name__}: {exc}"
        try:
            code = self._proc.wait(2.0) if self._proc is not None and self._bye is not False \
                else None
        except subprocess.TimeoutExpired:
            code = None
        with self._cv:
            if self._dead is None:
                self._dead = (f"the engine process exited (status {code})" if code is not None
                              else f"lost the engine process ({reason})")
            self._cv.notify_all()


def shared_paths(config, key: str) -> tuple[Path, Path]:
    """The Unix socket and the lock file of the engine process shared under ``key`` with
    ``config`` (another config, say after a model reload with new settings, gets an engine
    of its own), in a folder only this user may enter."""
    folder = Path(tempfile.gettempdir()) / f"radixlm-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise EngineProcessDied(f"{folder} must belong to this user with mode 0700: it holds "
                                "the engine's socket")
    digest = hashlib.sha1(f"{key}\n{config!r}".encode()).hexdigest()[:16]
    return folder / f"engine-{digest}.sock", folder / f"engine-{digest}.lock"


def open_shared(config, key: str, start_timeout_s: float = 1800.0, **kwargs) -> EngineProcess:
    """The engine process of ``key`` (one per tritonserver, model and device) for
    ``config``: attach to the one another stub started, or start it, listening for the
    others. A lock file orders the stubs, so the second waits while the first builds the
    engine."""
    address, lock_path = shared_paths(config, key)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            engine = EngineProcess.attach(str(address), config,
                                          rpc_timeout_s=kwargs.get("rpc_timeout_s", 60.0))
        except (ConnectionRefusedError, FileNotFoundError):
            # none yet, or the socket of one that ended: the child binds afresh
            engine = EngineProcess(config, start_timeout_s=start_timeout_s,
                                   listen=str(address), **kwargs)
    engine.lock_path = lock_path
    return engine
