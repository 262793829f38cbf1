"""The engine process itself: ``python -m backend.engine_worker FD``.

It builds an ``Engine`` from the config its first stub sends, then steps it and sends each
step's outputs to the stub that asked for them (``backend.engine_process`` is the stub's
side and has the message list). One stub starts it over an inherited socket; when that
stub asks it to listen, more stubs (other Triton instances of the same model on the same
device) may attach over a Unix socket and share the engine, its KV pool and its radix
cache. Each is a peer: its requests' outputs, refusals and replies go to it alone.

It ends when its last peer leaves: by "close", or by its socket closing (a stub that
died; the requests it had in flight are aborted, freeing their KV slots).
"""
from __future__ import annotations

import collections
import gc
import logging
import operator
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from pathlib import Path

from backend.core.outputs import StepOutput
from backend.serving import PROFILE_ENV, TRACE_ENV, env_int, write_profile

log = logging.getLogger("radixlm.engine_worker")

# StepOutputs cross the socket as plain tuples (pickling a tuple of primitives is several
# times cheaper than pickling the dataclass, and the child does it every step)
FIELDS = tuple(f.name for f in fields(StepOutput))
as_tuple = operator.attrgetter(*FIELDS)


class _Peer:
    """One stub's connection. Sends may come from the step loop and a reader thread."""

    __slots__ = ("conn", "lock", "name", "gone")

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn, self.name = conn, name
        self.lock = threading.Lock()
        self.gone = False

    def send(self, msg) -> None:
        with self.lock:
            if not self.gone:
                try:
                    self.conn.send(msg)
                except (OSError, ValueError):
                    self.gone = True  # its reader sees the socket close and detaches it


def _num_outputs(params) -> int:
    """How many finished outputs a generate request ends with (one per sample)."""
    n = params.get("n") if isinstance(params, dict) else getattr(params, "n", None)
    return n if isinstance(n, int) and n > 0 else 1


class Worker:
    def __init__(self, engine, info: dict) -> None:
        self.engine = engine
        self.info = info  # the "ready" message's payload, for every peer
        self.peers: list[_Peer] = []
        self.peers_lock = threading.Lock()
        # request id -> (its peer, finished outputs still to come): set before the engine
        # sees the request, dropped with its last output
        self.owners: dict[str, list] = {}
        self.controls: collections.deque = collections.deque()  # (peer, message)
        self.closing = False
        self.timings = {"step_s": 0.0, "send_s": 0.0, "idle_s": 0.0, "steps": 0}
        # when each traced request's "add" arrived, until its first output leaves
        self.received: dict[str, float] | None = {} if env_int(TRACE_ENV) > 0 else None
        # RADIXLM_PROFILE_DIR (which the stub passes on): the step loop under cProfile,
        # written at every stats request and at the end
        self.profiler = self.profile_path = None
        self.listener: socket.socket | None = None
        self.socket_path: str | None = None  # a path to remove at exit
        if os.environ.get(PROFILE_ENV):
            import cProfile
            self.profiler = cProfile.Profile()
            self.profile_path = Path(os.environ[PROFILE_ENV]) / f"engine_process_{os.getpid()}.txt"

    # ---- peers
    def add_peer(self, conn: Connection, name: str) -> _Peer:
        peer = _Peer(conn, name)
        with self.peers_lock:
            self.peers.append(peer)
        threading.Thread(target=self.read, args=(peer,), name=f"radixlm-commands-{name}",
                         daemon=True).start()
        return peer

    def remove_peer(self, peer: _Peer) -> int:
        """Detach ``peer`` and abort what it still had running; the peers left. With none
        left no stub may attach any more: this process is about to end."""
        with self.peers_lock:
            if peer in self.peers:
                self.peers.remove(peer)
            left = len(self.peers)
            if left == 0 and self.listener is not None:
                try:  # wakes the accept() under way (a close alone would leave it listening)
                    self.listener.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self.listener.close()
                self.listener = None
        for rid in [rid for rid, owner in list(self.owners.items()) if owner[0] is peer]:
            self.engine.abort(rid)
        return left

    def listen(self, address: str) -> None:
        """Accept more stubs on the Unix socket ``address`` (a path, or an abstract name:
        ``\\0...``). A path left by an engine process that died is replaced: the stubs
        hold a lock while one of them starts this process."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not address.startswith("\0"):
            try:
                os.unlink(address)
            except FileNotFoundError:
                pass
            self.socket_path = address
        server.bind(address)
        server.listen(16)
        self.listener = server
        threading.Thread(target=self._accept, args=(server,), name="radixlm-accept",
                         daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        _off_loop_cpus()
        count = 1
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return  # closed: the last stub left
            conn = Connection(sock.detach())
            try:
                if not conn.poll(30.0) or conn.recv()[0] != "hello":
                    conn.close()
                    continue
                conn.send(("ready", self.info))
            except (EOFError, OSError):
                conn.close()
                continue
            self.add_peer(conn, str(count))
            log.info("a stub attached (%d attached)", len(self.peers))
            count += 1

    def remove_socket(self) -> None:
        if self.socket_path is not None:
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass

    # ---- outputs
    def firsts(self, outputs) -> dict[str, float] | None:
        """The arrival times of the requests whose first output is among ``outputs`` (an
        aborted or refused request has one too: its final)."""
        received = self.received
        if not received:
            return None
        found = {o.request_id: received.pop(o.request_id) for o in outputs
                 if o.request_id in received}
        return found or None

    def refuse(self, peer: _Peer, rid: str, message: str) -> None:
        out = StepOutput.refusal(rid, message)
        peer.send(("out", [as_tuple(out)], self.engine.has_work(), time.time(),
                   self.firsts([out])))

    def deliver(self, outputs: list[StepOutput], busy: bool) -> None:
        """One message per peer with outputs; when the engine went idle (``busy`` false),
        every other peer hears it too (a stub keeps polling for outputs while it thinks
        the engine busy)."""
        owners = self.owners
        by_peer: dict[_Peer, list[StepOutput]] = {}
        for o in outputs:
            owner = owners.get(o.request_id)
            if owner is None:
                continue  # its stub left
            by_peer.setdefault(owner[0], []).append(o)
            if o.finished:
                owner[1] -= 1
                if owner[1] <= 0:
                    del owners[o.request_id]
        now = time.time()
        for peer, outs in by_peer.items():
            peer.send(("out", [as_tuple(o) for o in outs], busy, now, self.firsts(outs)))
        if not busy:
            for peer in list(self.peers):
                if peer not in by_peer:
                    peer.send(("out", [], False, now, None))

    # ---- commands
    def read(self, peer: _Peer) -> None:
        """Commands from one stub; add and abort go straight to the engine's inbox."""
        _off_loop_cpus()
        try:
            while True:
                msg = peer.conn.recv()
                for one in (msg[1] if msg[0] == "many" else (msg,)):
                    if not self.handle(peer, one):
                        return  # the loop answers "close" and detaches the peer
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        peer.gone = True
        if self.remove_peer(peer) == 0:
            self.remove_socket()
            os._exit(0)  # the last stub is gone: nobody to serve

    def handle(self, peer: _Peer, msg) -> bool:
        """One command; False once the stub asked to close."""
        engine = self.engine
        kind = msg[0]
        if kind in ("add", "score"):
            rid = msg[1]
            if kind == "add" and self.received is not None:
                self.received[rid] = time.time()
            # a score request ends with one output, carrying every choice's score
            self.owners[rid] = [peer, _num_outputs(msg[3]) if kind == "add" else 1]
            try:
                if kind == "add":
                    engine.add_request(msg[2], msg[3], request_id=rid, stream=msg[4])
                else:
                    engine.add_score_request(msg[2], msg[3], request_id=rid)
            except ValueError as exc:
                self.owners.pop(rid, None)
                self.refuse(peer, rid, str(exc))
        elif kind == "abort":
            engine.abort(msg[1])
        else:  # stats, integrity, close: answered by the loop, between steps
            self.controls.append((peer, msg))
            engine.wake()
            if kind == "close":
                return False
        return True

    def answer_controls(self) -> None:
        while self.controls:
            peer, msg = self.controls.popleft()
            kind = msg[0]
            if kind == "close":
                left = self.remove_peer(peer)
                peer.send(("bye", left == 0))
                if left == 0:
                    self.closing = True
                    return
                with peer.lock:  # the others go on: this stub's socket is done
                    peer.gone = True
                    peer.conn.close()
                continue
            if kind == "stats":
                if self.profiler is not None:
                    write_profile(self.profiler, self.profile_path)
                    self.profiler.enable()
                value = dict(self.engine.stats())
                value["engine_loop"] = {k: round(v, 4) for k, v in self.timings.items()}
                value["engine_peers"] = len(self.peers)
            else:
                try:
                    self.engine.check_integrity()
                    value = None
                except AssertionError as exc:
                    value = str(exc) or "failed"
            peer.send(("reply", msg[1], value))

    # ---- the step loop
    def run(self) -> None:
        if self.profiler is None:
            self._run()
            return
        self.profiler.enable()
        try:
            self._run()
        finally:
            self.profiler.disable()
            write_profile(self.profiler, self.profile_path)

    def _run(self) -> None:
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
            except Exception as exc:  # noqa: BLE001 - the stubs fail the requests
                traceback.print_exc()
                for peer in list(self.peers):
                    peer.send(("step_error", f"engine error: {exc}"))
                continue
            stepped = time.perf_counter()
            busy = engine.has_work()
            if outputs or not busy:
                self.deliver(outputs, busy)
            timings["step_s"] += stepped - started
            timings["send_s"] += time.perf_counter() - stepped
            timings["steps"] += 1


CPUS_ENV = "RADIXLM_ENGINE_CPUS"
# threads other than the step loop run here (None: wherever the process may run)
_OTHER_CPUS: set[int] | None = None


def parse_cpus(text: str) -> set[int]:
    """CPU numbers from a list like ``"8"``, ``"8,10"`` or ``"8-11,14"``."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{CPUS_ENV}={text!r}: expected auto, none, or CPU numbers "
                             "like 8,10-11")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{CPUS_ENV}={text!r}: range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus


@dataclass(frozen=True)
class HostCpus:
    """What ``auto`` pinning looks at besides the CPUs this process may use."""

    online: int  # CPUs of the machine
    shared: bool  # under a CPU quota or in Kubernetes: other tenants' processes share them
    visible_gpus: tuple[int, ...] = ()  # CUDA/NVIDIA_VISIBLE_DEVICES as machine ordinals

    @classmethod
    def here(cls) -> "HostCpus":
        return cls(os.cpu_count() or 1, _cpu_quota() or "KUBERNETES_SERVICE_HOST" in os.environ,
                   _visible_gpus())


def _cpu_quota() -> bool:
    """A CFS quota on this process's cgroup (v2 cpu.max, v1 cpu.cfs_quota_us)."""
    own = ""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = line[3:].strip().strip("/")
    except OSError:
        pass
    v2 = [f"/sys/fs/cgroup/{own}/cpu.max"] if own else []
    for path in v2 + ["/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"]:
        try:
            first = Path(path).read_text().split()[0]
        except (OSError, IndexError):
            continue
        return first not in ("max", "-1")
    return False


def _visible_gpus() -> tuple[int, ...]:
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        parts = os.environ.get(name, "").replace(" ", "").split(",")
        if parts and all(p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)
    return ()


def loop_cpus(setting: str, allowed: set[int], device: str,
              host: HostCpus | None = None) -> set[int] | None:
    """The CPUs of the step loop thread for a ``RADIXLM_ENGINE_CPUS`` value: ``none``: no
    pinning; a list: those CPUs; ``auto`` (the default): on a CUDA device, with at least 4
    CPUs to choose from, one CPU of its own, counted down from the highest by GPU, so that
    the engine processes of a machine's GPUs get one each. Within a cpuset of its own
    (fewer CPUs allowed than the machine has) the count goes by the device index; on CPUs
    shared with other tenants (a CPU quota, Kubernetes) without such a cpuset, ``auto``
    does not pin (another pod's engine could pick the same CPU); otherwise it goes by the
    GPU's machine ordinal when the visible devices say it."""
    setting = setting.strip().lower() or "auto"
    if setting == "none":
        return None
    if setting != "auto":
        return parse_cpus(setting)
    if not device.startswith("cuda") or len(allowed) < 4:
        return None
    host = host or HostCpus.here()
    index = int(device.partition(":")[2] or 0)
    if len(allowed) >= host.online:  # the machine's CPUs, not a set of our own
        if host.shared:
            return None
        if index < len(host.visible_gpus):
            index = host.visible_gpus[index]
    ordered = sorted(allowed)
    return {ordered[-1 - index % (len(ordered) - 1)]}


def pin_loop(device: str) -> set[int] | None:
    """Keep the calling thread (the step loop) on its CPUs and every later thread of
    this process (command readers, the listener) off them. Why: the step loop's host
    time per step is close to the device's at large batches, and its messages wake the
    stub's reader thread, which the kernel likes to place on the waker's CPU; on the
    H200 host an unpinned child stepped at 2.13 ms against 1.78 ms pinned (1B, batch 128,
    53.5k against 64.2k tokens/s; in-process 63.7k)."""
    global _OTHER_CPUS
    allowed = os.sched_getaffinity(0)
    try:
        cpus = loop_cpus(os.environ.get(CPUS_ENV, ""), allowed, device)
        if cpus is None:
            if device.startswith("cuda") and not os.environ.get(CPUS_ENV, "").strip():
                logging.info("step loop not pinned (CPUs shared with other tenants, or too "
                             "few); %s=LIST pins it", CPUS_ENV)
            return None
        os.sched_setaffinity(0, cpus)  # may lie outside the parent's set: the child's own
    except (ValueError, OSError) as exc:
        logging.warning("step loop not pinned: %s", exc)
        return None
    rest = allowed - cpus
    _OTHER_CPUS = rest or None
    logging.info("step loop pinned to CPUs %s", sorted(cpus))
    return cpus


def _off_loop_cpus() -> None:
    """At the start of a thread other than the step loop."""
    if _OTHER_CPUS:
        try:
            os.sched_setaffinity(0, _OTHER_CPUS)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="radixlm engine process: %(message)s")
    # A SIGTERM or Ctrl-C to the server's process group reaches this process too: the
    # stubs decide when it ends (each aborts its requests in flight and sends each its
    # final response first), by "close" or by going away.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    try:
        msg = conn.recv()  # ("init", config, listen address or None)
    except (EOFError, OSError):
        return 0
    pin_loop(str(getattr(msg[1], "device", "cpu")))
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
    info = {"pid": os.getpid(), "vocab_size": engine.runner.vocab_size,
            "context_len": engine.context_len}
    worker = Worker(engine, info)
    address = msg[2] if len(msg) > 2 else None
    if address:
        try:
            worker.listen(address)
        except OSError as exc:
            conn.send(("init_error", f"listening on {address!r} for more stubs failed: {exc}"))
            return 1
    conn.send(("ready", info))
    worker.add_peer(conn, "0")
    try:
        worker.run()
    finally:
        worker.remove_socket()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
