"""The link between radixlm-serve's supervisor (``backend.supervisor``) and each stub of ours.

Why: Triton 2.51's Python backend does not notice that a stub of a decoupled model died
(python_backend dropped the restart of unhealthy stubs when it unified the decoupled and
plain paths; server issue 8604): the requests the stub held are never answered, the model
and the server stay ready, and every later request fails with "Stub process ... is not
healthy". So every stub of ours (the engine model's, the ensemble's text steps) holds a
Unix-socket connection to the supervisor for its whole life: the kernel closes it when the
stub dies, however it dies (SIGKILL from the OOM killer included), and a stub that ends
normally says so first. The socket lives in the private runtime folder (``runtime_dir``),
both ends check the other's uid, and the messages are JSON lines of plain data:

    stub -> supervisor   {"hello": {"model": .., "instance": .., "pid": ..}}  once loaded
                         {"stop": "<reason>"}   the engine failed: stop the server
                         {"leaving": true}      finalize began: an exit is expected now

No Triton import here.
"""
from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from backend.runtime_dir import SocketAddress, UnsafeRuntimeDir, check_peer

log = logging.getLogger("radixlm.stub_watch")

WATCH_SOCKET_ENV = "RADIXLM_WATCH_SOCKET"  # "<private runtime folder>/<socket name>"
_MAX_LINE = 64 * 1024


@dataclass(frozen=True)
class StubInfo:
    model: str
    instance: str
    pid: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "died": a stub ended without saying so; "stop": a stub asks to stop the server
    stub: StubInfo
    reason: str


class StubLink:
    """The stub's end: opened at the end of ``initialize``, closed as ``finalize`` begins."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    @classmethod
    def open(cls, model: str, instance: str, environ=None) -> "StubLink | None":
        """Connect to the supervisor named in the environment; None when the server runs
        without one (a plain ``tritonserver``). Raises ``OSError`` when the supervisor
        cannot be reached or is another user's process."""
        where = (os.environ if environ is None else environ).get(WATCH_SOCKET_ENV)
        if not where:
            return None
        folder, name = os.path.split(where)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            SocketAddress(name, folder).connect(sock)
        except OSError:
            sock.close()
            raise
        link = cls(sock)
        link._send({"hello": {"model": model, "instance": instance, "pid": os.getpid()}})
        return link

    @classmethod
    def open_logged(cls, model: str, instance: str, log_error) -> "StubLink | None":
        """``open``, a failure logged instead of raised: the stub serves on, unwatched."""
        try:
            return cls.open(model, instance)
        except OSError as exc:
            log_error(f"radixlm: cannot reach radixlm-serve's supervisor: {exc}")
            return None

    def request_stop(self, reason: str) -> None:
        self._send({"stop": reason})

    def close(self) -> None:
        """Say this stub is leaving (its exit is no death), then hang up."""
        self._send({"leaving": True})
        with self._lock:
            self._sock.close()

    def _send(self, message: dict) -> None:
        with self._lock:
            try:
                self._sock.sendall(json.dumps(message).encode() + b"\n")
            except OSError as exc:  # the supervisor is gone: nothing left to tell
                log.warning("radixlm: the supervisor's watch socket: %s", exc)


def protect_shm_region(cmdline: Path = Path("/proc/self/cmdline"),
                       shm_dir: Path = Path("/dev/shm")) -> Path | None:
    """Make this stub's shared-memory region readable by its user only; the region.

    The Python backend creates each stub's region mode 0644 whatever the umask (Boost sets
    the mode after creating it), so any user of the host could map it and read every
    prompt and answer passing through. The stub's second argument names the region. A
    process that opened the region before this ran keeps its access: radixlm-serve's
    supervisor narrows that window (it changes the mode as soon as a region appears), and
    only a /dev/shm of the server's own (a container) closes it."""
    try:
        args = cmdline.read_bytes().split(b"\0")
        name = args[2].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    region = shm_dir / name
    if "/" in name or not name:
        return None
    try:
        st = os.stat(region, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(region, 0o600, follow_symlinks=False)
    except (OSError, NotImplementedError):
        return None
    return region


class WatchServer:
    """The supervisor's end: accepts stubs and reports each that dies or asks to stop."""

    def __init__(self, address: SocketAddress) -> None:
        self.address = address
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address.bind(self._listener)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        # connection -> [what it said in hello (None before), unread bytes, leaving]
        self._stubs: dict[socket.socket, list] = {}

    @property
    def environ_value(self) -> str:
        return f"{self.address.folder}/{self.address.name}"

    def live_stubs(self) -> list[StubInfo]:
        return [state[0] for state in self._stubs.values() if state[0] is not None]

    def poll(self, timeout_s: float) -> list[WatchEvent]:
        events: list[WatchEvent] = []
        for key, _ in self._selector.select(timeout_s):
            if key.fileobj is self._listener:
                self._accept()
            else:
                self._read(key.fileobj, events)
        return events

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            check_peer(sock)  # another user's process is not a stub of ours
        except UnsafeRuntimeDir as exc:
            log.warning("radixlm-serve: %s", exc)
            return
        sock.setblocking(False)
        self._stubs[sock] = [None, b"", False]
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket, events: list[WatchEvent]) -> None:
        state = self._stubs[sock]
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._selector.unregister(sock)
            sock.close()
            del self._stubs[sock]
            if state[0] is not None and not state[2]:
                events.append(WatchEvent("died", state[0], "its process ended without "
                                         "finalize (killed, or crashed)"))
            return
        state[1] += data
        *lines, state[1] = state[1].split(b"\n")
        if len(state[1]) > _MAX_LINE:
            state[1] = b""  # not a stub of ours: drop what it sends
        for line in lines:
            self._receive(state, line, events)

    @staticmethod
    def _receive(state: list, line: bytes, events: list[WatchEvent]) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        hello = message.get("hello")
        if isinstance(hello, dict) and state[0] is None:
            try:
                state[0] = StubInfo(str(hello["model"]), str(hello["instance"]),
                                    int(hello["pid"]))
            except (KeyError, TypeError, ValueError):
                return
        elif "stop" in message and state[0] is not None:
            events.append(WatchEvent("stop", state[0], str(message["stop"])))
        elif message.get("leaving") is True:
            state[2] = True

    def close(self) -> None:
        for sock in list(self._stubs):
            sock.close()
        self._stubs.clear()
        self._selector.close()
        self._listener.close()
        self.address.unlink()
