"""The engine in a process of its own, behind the interface ``serving.EngineLoop`` uses.

Why: in the Triton stub, the engine's step loop and the threads that build and send
responses share one interpreter lock. A decode step is many short host operations, each
of which may wait for the lock behind a thread building a response; on the H200 a 2.5 ms
step of the 1B shape took ~6 ms inside tritonserver. Here the engine steps in a child
process with an interpreter of its own and sends each step's outputs to the stub in one
message; the stub only routes and sends responses.

``EngineProcess`` (in the stub) has the methods EngineLoop calls on an ``Engine``:
``add_request``, ``add_score_request``, ``abort``, ``has_work``, ``wait_for_work``,
``step``, ``stats``, ``check_integrity``, ``tokenizer``, plus ``close``. Bad prompts
(empty, too long, a constraint that does not compile) come back as an error output for
that request, not as ``ValueError``: the child finds them, after ``add_request`` returned.

The child (``python -m backend.engine_process FD``) talks over one socket pair:
  stub -> child: ("add", rid, prompt, params) ("score", rid, prompt, choices)
                 ("abort", rid) ("stats", token) ("integrity", token) ("close",)
  child -> stub: ("ready", info) ("init_error", message)
                 ("out", [output tuples], busy, sent_at, received)
                 ("step_error", message)
                 ("reply", token, value)
The child exits when the socket closes (the stub died) or on "close". ``sent_at`` is the
child's wall clock when the step's outputs left: ``last_made_at`` (the oldest of those the
last ``step`` returned) and ``transfer`` (the lag from there to the stub's reader) show
where a response's time went. When the stub traces requests (``RADIXLM_TRACE_REQUESTS``,
which the child inherits), ``received`` maps each request whose first output is in the
message to the child's wall clock when its "add" arrived (``received_at`` in the stub).
"""
from __future__ import annotations

import collections
import gc
import logging
import operator
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import fields
from multiprocessing.connection import Connection
from typing import Any

from backend.core.outputs import StepOutput
from backend.serving import TRACE_ENV, env_int

log = logging.getLogger("radixlm.engine_process")

# StepOutputs cross the socket as plain tuples (pickling a tuple of primitives is several
# times cheaper than pickling the dataclass, and the child does it every step)
_FIELDS = tuple(f.name for f in fields(StepOutput))
_as_tuple = operator.attrgetter(*_FIELDS)


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
    """An ``Engine`` running in a child process; see the module docstring."""

    def __init__(self, config, start_timeout_s: float = 1800.0, python: str | None = None,
                 rpc_timeout_s: float = 60.0) -> None:
        self.config = config
        self._rpc_timeout_s = rpc_timeout_s
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the child imports exactly what this interpreter can
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.python = python or child_python()
        self._proc = subprocess.Popen(
            [self.python, "-m", "backend.engine_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(os.dup(ours.fileno()))
        ours.close()
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
        self._tokenizer = None
        self.info: dict = {}
        try:
            self._conn.send(("init", config))
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
            elif self._proc.poll() is not None:
                break
        code = self._proc.poll()
        if code is None:
            raise EngineProcessDied(f"the engine process did not start within {timeout_s:.0f} s")
        raise EngineProcessDied(f"the engine process exited with status {code} while starting "
                                "(its error is in the server log)")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child: ask, then wait up to ``timeout_s``, then kill."""
        try:
            self._send(("close",))
        except (OSError, EngineProcessDied, ValueError):
            pass
        if self._writer is not None:  # it ends once "close" has left
            self._writer.join(min(timeout_s, 5.0))
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
        return self._proc.pid

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
                        self._events.append(([StepOutput(*t) for t in msg[1]], msg[3]))
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
                    self._cv.notify_all()
        except (EOFError, OSError) as exc:
            reason = type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - a bad message ends the channel
            reason = f"{type(exc).__name__}: {exc}"
        try:
            code = self._proc.wait(2.0)
        except subprocess.TimeoutExpired:
            code = None
        with self._cv:
            if self._dead is None:
                self._dead = (f"the engine process exited (status {code})" if code is not None
                              else f"lost the engine process ({reason})")
            self._cv.notify_all()


# ---- the child ---------------------------------------------------------------------------

class _Worker:
    def __init__(self, engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.send_lock = threading.Lock()
        self.controls: collections.deque = collections.deque()
        self.closing = False
        self.timings = {"step_s": 0.0, "send_s": 0.0, "idle_s": 0.0, "steps": 0}
        # when each traced request's "add" arrived, until its first output leaves
        self.received: dict[str, float] | None = {} if env_int(TRACE_ENV) > 0 else None

    def firsts(self, outputs) -> dict[str, float] | None:
        """The arrival times of the requests whose first output is among ``outputs`` (an
        aborted or refused request has one too: its final)."""
        received = self.received
        if not received:
            return None
        found = {o.request_id: received.pop(o.request_id) for o in outputs
                 if o.request_id in received}
        return found or None

    def send(self, msg) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def refuse(self, rid: str, message: str) -> None:
        out = StepOutput(rid, 0, [], "", True, "abort", 0, 0, 0, error=message)
        self.send(("out", [_as_tuple(out)], self.engine.has_work(), time.time(),
                   self.firsts([out])))

    def read(self) -> None:
        """Commands from the stub; add and abort go straight to the engine's inbox."""
        try:
            while True:
                msg = self.conn.recv()
                for one in (msg[1] if msg[0] == "many" else (msg,)):
                    if not self.handle(one):
                        return  # the loop ends the process after answering "close"
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        os._exit(0)  # the stub is gone: nobody to serve

    def handle(self, msg) -> bool:
        """One command; False once the stub asked to close."""
        engine = self.engine
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params, stream = msg
            if self.received is not None:
                self.received[rid] = time.time()
            try:
                engine.add_request(prompt, params, request_id=rid, stream=stream)
            except ValueError as exc:
                self.refuse(rid, str(exc))
        elif kind == "score":
            _, rid, prompt, choices = msg
            try:
                engine.add_score_request(prompt, choices, request_id=rid)
            except ValueError as exc:
                self.refuse(rid, str(exc))
        elif kind == "abort":
            engine.abort(msg[1])
        else:  # stats, integrity, close: answered by the loop, between steps
            self.controls.append(msg)
            engine.wake()
            if kind == "close":
                return False
        return True

    def answer_controls(self) -> None:
        while self.controls:
            msg = self.controls.popleft()
            kind = msg[0]
            if kind == "close":
                self.closing = True
                return
            if kind == "stats":
                value = dict(self.engine.stats())
                value["engine_loop"] = {k: round(v, 4) for k, v in self.timings.items()}
            else:
                try:
                    self.engine.check_integrity()
                    value = None
                except AssertionError as exc:
                    value = str(exc) or "failed"
            self.send(("reply", msg[1], value))

    def run(self) -> None:
        engine, timings = self.engine, self.timings
        while not self.closing:
            self.answer_controls()
            if self.closing:
                break
            if not engine.has_work():
                started = time.perf_counter()
                engine.wait_for_work(0.5)
                timings["idle_s"] += time.perf_counter() - started
                continue
            started = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - the stub fails the requests
                traceback.print_exc()
                self.send(("step_error", f"engine error: {exc}"))
                continue
            stepped = time.perf_counter()
            if outputs:
                self.send(("out", [_as_tuple(o) for o in outputs], engine.has_work(),
                           time.time(), self.firsts(outputs)))
            elif not engine.has_work():
                self.send(("out", [], False, time.time(), None))
            timings["step_s"] += stepped - started
            timings["send_s"] += time.perf_counter() - stepped
            timings["steps"] += 1


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="radixlm engine process: %(message)s")
    # A SIGTERM or Ctrl-C to the server's process group reaches this process too: the
    # stub decides when it ends (it aborts the requests in flight and sends each its
    # final response first), by "close" or by going away.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return 0
    try:
        from backend.core import Engine

        engine = Engine(msg[1])
    except BaseException as exc:  # noqa: BLE001 - reported to the stub, which fails to load
        traceback.print_exc()
        conn.send(("init_error", f"building the engine failed: {type(exc).__name__}: {exc}"))
        return 1
    # What exists now (torch, the model, the tokenizer: ~10^6 objects) lives as long as
    # the process: out of the collector's reach, a full collection no longer stalls a
    # step for 100+ ms while it walks them.
    gc.collect()
    gc.freeze()
    conn.send(("ready", {"pid": os.getpid(), "vocab_size": engine.runner.vocab_size,
                         "context_len": engine.context_len}))
    worker = _Worker(engine, conn)
    threading.Thread(target=worker.read, name="radixlm-commands", daemon=True).start()
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
