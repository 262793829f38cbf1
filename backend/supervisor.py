"""radixlm-serve's own process: tritonserver as its child, watched and stopped in bounded time.

A bare tritonserver 2.51 has three gaps that no code inside a stub can close:

* a stub that dies is not noticed (``stub_watch`` says why): the supervisor learns it at
  once from the stub's watch connection, sends tritonserver SIGTERM (its HTTP endpoint
  closes at once, so readiness fails, and the other stubs end their requests with a final
  "abort" response), and SIGKILLs it ``stub_death_s`` later: the requests the dead stub
  held are answered by nobody, and only the end of the process gives their clients an
  error (their connection closes) instead of a hang;
* after SIGTERM it waits for every client to close its gRPC stream, even past its own
  ``--exit-timeout-secs`` ("Exit timeout expired. Exiting immediately." and then it stays):
  every stop (a signal, a stub asking, tritonserver stopping on its own) ends with SIGKILL
  at ``exit_s`` at the latest;
* processes it started outlive it when it is killed: the supervisor is their subreaper
  (PID 1 in the image), reaps them, and gives them ``descendants_s`` to end before SIGKILL.

When tritonserver has ended it removes what the server leaves behind when killed: its
stubs' shared-memory regions (named with a prefix of this process's pid) and its files in
the runtime folder. Files left by servers whose supervisor was killed are swept at start.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from backend.runtime_dir import PrivateDir, SocketAddress, default_location, pid_alive
from backend.stub_watch import WATCH_SOCKET_ENV, WatchEvent, WatchServer

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
SHM_DIR = Path("/dev/shm")
_SHM_OWNER = re.compile(r"^radixlm-(\d+)-")


def shm_prefix(pid: int) -> str:
    """The prefix of the shared-memory regions of the stubs of the server supervised by
    ``pid`` (tritonserver's ``--backend-config=python,shm-region-prefix-name=...``)."""
    return f"radixlm-{pid}-"


@dataclass(frozen=True)
class Bounds:
    exit_s: float = 15.0  # from the start of a stop to SIGKILL
    stub_death_s: float = 2.0  # after a stub died: the others' time to send their finals
    descendants_s: float = 5.0  # after tritonserver ended: its stubs' and engines' time


@dataclass(frozen=True)
class ServerPlan:
    command: list[str]
    env: dict[str, str]
    shm_prefix: str | None = None  # the stubs' regions: removed when the server has ended
    http_url: str | None = None  # tritonserver's HTTP endpoint: is it still serving


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with_parent() -> None:  # in the child, before exec: no threads, no locks
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    def __init__(self, plan: ServerPlan, bounds: Bounds = Bounds(), out=sys.stderr) -> None:
        self.plan, self.bounds, self._out = plan, bounds, out
        self.pid: int | None = None  # tritonserver's
        self.returncode: int | None = None
        self.stop_reason: str | None = None
        self.failed = False  # the stop came from a failure (exit status 1)
        self._kill_at: float | None = None
        self._signals: list[int] = []
        self._server_went_away = threading.Event()
        self._protected: set[str] = set()

    def say(self, message: str) -> None:
        print(f"radixlm-serve: {message}", file=self._out, flush=True)

    def run(self) -> int:
        if not _prctl(_PR_SET_CHILD_SUBREAPER, 1) and os.getpid() != 1:
            self.say("warning: cannot become the subreaper of the server's processes; "
                     "an engine process whose stub was killed is then left to init")
        self._sweep_leftovers()
        watch = WatchServer(SocketAddress(f"watch-{os.getpid()}.sock", str(default_location())))
        env = dict(self.plan.env)
        env[WATCH_SOCKET_ENV] = watch.environ_value
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda signum, _: self._signals.append(signum))
        try:
            proc = subprocess.Popen(self.plan.command, env=env, preexec_fn=_die_with_parent)
        except OSError as exc:
            watch.close()
            self.say(f"error: cannot start {self.plan.command[0]}: {exc}")
            return 127
        self.pid = proc.pid
        if self.plan.http_url is not None:
            threading.Thread(target=self._watch_http, daemon=True,
                             name="radixlm-serve-liveness").start()
        try:
            self._supervise(watch)
        finally:
            proc.returncode = self.returncode  # reaped here, not by Popen
            watch.close()
            self._end_descendants()
            self._clean_up()
        if self.failed:
            return 1
        if self.stop_reason is not None:
            return 0  # a stop that was asked for, even when it needed SIGKILL
        code = self.returncode or 0
        return code if code >= 0 else 128 - code

    # ---- the loop
    def _supervise(self, watch: WatchServer) -> None:
        while self.returncode is None:
            for event in watch.poll(0.1):
                self._on_event(event)
            while self._signals:
                self._on_signal(self._signals.pop(0))
            if self._server_went_away.is_set() and self.stop_reason is None:
                self._begin_stop("tritonserver is stopping", self.bounds.exit_s)
            self._reap()
            self._protect_shm()
            if self._kill_at is not None and time.monotonic() >= self._kill_at \
                    and self.returncode is None:
                self.say(f"tritonserver (pid {self.pid}) is still running "
                         f"{self._since_stop():.1f} s after the stop began: SIGKILL")
                os.kill(self.pid, signal.SIGKILL)
                self._kill_at = None

    def _on_event(self, event: WatchEvent) -> None:
        stub = event.stub
        what = f"the stub of {stub.model} ({stub.instance}, pid {stub.pid})"
        if event.kind == "died":
            self._begin_stop(f"{what} died: {event.reason}", self.bounds.stub_death_s,
                             failed=True)
        else:
            self._begin_stop(f"{what} asks to stop the server: {event.reason}",
                             self.bounds.exit_s, failed=True)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.stop_reason is None:
            self._begin_stop(f"got {name}", self.bounds.exit_s)
        else:  # a second Ctrl-C: no more waiting
            self.say(f"got {name} again: stopping tritonserver now")
            self._kill_at = time.monotonic()

    def _begin_stop(self, reason: str, bound_s: float, failed: bool = False) -> None:
        now = time.monotonic()
        if self.stop_reason is None:
            self.stop_reason, self._stop_started = reason, now
            self.say(f"{reason}; stopping tritonserver (pid {self.pid}), SIGKILL in "
                     f"{bound_s:g} s if it has not ended")
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        else:
            self.say(f"{reason} (stopping already)")
        self.failed = self.failed or failed
        kill_at = now + bound_s
        self._kill_at = kill_at if self._kill_at is None else min(self._kill_at, kill_at)

    def _since_stop(self) -> float:
        return time.monotonic() - self._stop_started

    def _reap(self) -> None:
        """Reap every child that ended: tritonserver, and the orphans we inherit."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.say(f"tritonserver ended ({self.returncode})" + (
                    f" {self._since_stop():.1f} s after the stop began"
                    if self.stop_reason is not None else ""))

    def _watch_http(self) -> None:
        """A stop nobody told us about (a SIGTERM sent to tritonserver itself): once it has
        served, its HTTP endpoint refusing connections means it is stopping. (It opens
        the endpoint only once its models are loaded: until then it is asked often, so
        that a stop soon after is not missed.)"""
        url, served = f"{self.plan.http_url}/v2/health/live", False
        while self.returncode is None and not self._server_went_away.is_set():
            try:
                with urllib.request.urlopen(url, timeout=2):
                    served = True
            except urllib.error.HTTPError:
                served = True
            except (urllib.error.URLError, ConnectionError) as exc:
                reason = getattr(exc, "reason", exc)
                if served and isinstance(reason, ConnectionRefusedError):
                    self._server_went_away.set()
            except OSError:
                pass
            time.sleep(0.5 if served else 0.05)

    # ---- shared memory and files
    def _protect_shm(self) -> None:
        """Regions of our stubs for their user only, as soon as they appear (see
        ``stub_watch.protect_shm_region``)."""
        prefix = self.plan.shm_prefix
        if prefix is None:
            return
        try:
            names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
        except OSError:
            return
        for name in names:
            if name not in self._protected:
                try:
                    os.chmod(SHM_DIR / name, 0o600, follow_symlinks=False)
                    self._protected.add(name)
                except (OSError, NotImplementedError):
                    pass

    def _end_descendants(self) -> None:
        """The stubs notice tritonserver is gone within ~0.3 s, engine processes their
        stub; whatever still runs after ``descendants_s`` is killed."""
        deadline = time.monotonic() + self.bounds.descendants_s
        while _children() and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        for pid in _children():
            self.say(f"process {pid} of the server outlived it by "
                     f"{self.bounds.descendants_s:g} s: SIGKILL")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while _children() and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)

    def _clean_up(self) -> None:
        removed = []
        if self.plan.shm_prefix is not None:
            removed += _remove_shm(lambda name: name.startswith(self.plan.shm_prefix))
        if self.pid is not None:
            try:
                with PrivateDir() as d:
                    removed += d.remove_files_of(self.pid)
            except OSError:
                pass
        if removed:
            self.say(f"removed what the server left: {', '.join(sorted(removed))}")

    def _sweep_leftovers(self) -> None:
        def dead_owner(name: str) -> bool:
            match = _SHM_OWNER.match(name)
            return match is not None and not pid_alive(int(match.group(1)))

        removed = _remove_shm(dead_owner)
        try:
            with PrivateDir() as d:
                removed += d.remove_files_of_dead()
        except OSError:
            pass
        if removed:
            self.say(f"removed what servers that were killed left: {', '.join(sorted(removed))}")


def _children() -> list[int]:
    """This process's children that have not been reaped (zombies included)."""
    me, found = os.getpid(), []
    for task in Path(f"/proc/{me}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _remove_shm(wanted) -> list[str]:
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if wanted(name):
            try:
                os.unlink(SHM_DIR / name)
                removed.append(f"/dev/shm/{name}")
            except OSError:
                pass
    return removed


def supervise(plan: ServerPlan, bounds: Bounds = Bounds()) -> int:
    return Supervisor(plan, bounds).run()
