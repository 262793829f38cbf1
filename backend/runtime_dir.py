"""Where the shared engine's socket and lock live, so that no other user can interpose.

The folder (``$XDG_RUNTIME_DIR/radixlm``, else ``<tmp>/radixlm-<uid>``) is created with
mode 0700 in one ``mkdir`` and opened without following links (``O_NOFOLLOW |
O_DIRECTORY``); the open folder must belong to this user with no access for others.
Every later use goes through that open descriptor (``/proc/self/fd/N/<name>``), so the
name cannot be swapped for another folder in between. Both ends of every connection
check the other's credentials (``SO_PEERCRED``): a peer of another user is refused.
"""
from __future__ import annotations

import fcntl
import os
import re
import socket
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path


# Every file of ours in the folder is named for the process whose life it belongs to:
# ``engine-<tritonserver pid>-<digest>.sock|.lock`` (a shared engine), ``watch-<pid>.sock``
# (radixlm-serve's stub watch). Files whose process is gone are garbage.
_OWNED = re.compile(r"^(?:engine|watch)-(\d+)[-.]")


class UnsafeRuntimeDir(PermissionError):
    """The runtime folder (or a peer) could be another user's."""


def default_location(uid: int | None = None) -> Path:
    uid = os.getuid() if uid is None else uid
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.stat(runtime).st_uid == uid:
        return Path(runtime) / "radixlm"
    return Path(tempfile.gettempdir()) / f"radixlm-{uid}"


class PrivateDir:
    """An open, checked runtime folder; ``path(name)`` names a file in it through the
    open descriptor."""

    def __init__(self, location: Path | str | None = None, expected_uid: int | None = None) -> None:
        self.location = Path(location) if location is not None else default_location()
        uid = os.getuid() if expected_uid is None else expected_uid
        try:
            os.mkdir(self.location, 0o700)
        except FileExistsError:
            pass
        try:
            self.fd = os.open(self.location, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                              | os.O_CLOEXEC)
        except OSError as exc:  # ELOOP: a symlink; ENOTDIR: not a folder
            raise UnsafeRuntimeDir(f"{self.location} is not a plain folder ({exc.strerror})") from None
        st = os.fstat(self.fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
            os.close(self.fd)
            raise UnsafeRuntimeDir(
                f"{self.location} must be a folder of user {uid} with mode 0700 (it holds the "
                f"engine's socket); it belongs to {st.st_uid} with mode {oct(st.st_mode & 0o777)}")

    def path(self, name: str) -> str:
        return f"/proc/self/fd/{self.fd}/{name}"

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        os.close(self.fd)

    def owned_files(self) -> dict[str, int]:
        """Our files here, with the pid each belongs to."""
        return {name: int(m.group(1)) for name in os.listdir(self.fd)
                if (m := _OWNED.match(name))}

    def remove_files_of(self, pid: int) -> list[str]:
        """Remove the files of process ``pid`` (once it has ended); the names removed."""
        gone = [name for name, owner in self.owned_files().items() if owner == pid]
        for name in gone:
            self.unlink(name)
        return gone

    def remove_files_of_dead(self) -> list[str]:
        """Remove the files of processes that no longer run (a server killed before it
        could clean up); the names removed."""
        gone = [name for name, owner in self.owned_files().items() if not pid_alive(owner)]
        for name in gone:
            self.unlink(name)
        return gone

    def __enter__(self) -> "PrivateDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class SocketAddress:
    """A Unix socket: ``name`` in the private folder ``folder``, or an abstract name
    (``folder`` None; tests only: anyone may bind an abstract name first)."""

    name: str
    folder: str | None = None

    def bind(self, sock: socket.socket) -> None:
        if self.folder is None:
            sock.bind("\0" + self.name)
            return
        with PrivateDir(self.folder) as d:
            d.unlink(self.name)  # a socket an engine that died left behind
            sock.bind(d.path(self.name))

    def connect(self, sock: socket.socket) -> None:
        if self.folder is None:
            sock.connect("\0" + self.name)
        else:
            with PrivateDir(self.folder) as d:
                sock.connect(d.path(self.name))
        check_peer(sock)

    def unlink(self) -> None:
        if self.folder is not None:
            with PrivateDir(self.folder) as d:
                d.unlink(self.name)

    def exists(self) -> bool:
        if self.folder is None:
            return False
        with PrivateDir(self.folder) as d:
            try:
                os.stat(self.name, dir_fd=d.fd, follow_symlinks=False)
                return True
            except FileNotFoundError:
                return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def check_peer(sock: socket.socket, expected_uid: int | None = None) -> None:
    """Refuse (close and raise) a connection whose other end runs as another user."""
    uid = os.getuid() if expected_uid is None else expected_uid
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, peer_uid, _ = struct.unpack("3i", creds)
    if peer_uid != uid:
        sock.close()
        raise UnsafeRuntimeDir(f"refused a peer of user {peer_uid} (expected {uid})")


class FileLock:
    """An exclusive ``flock`` on ``name`` in the private folder. ``remove`` (while held)
    deletes the file; a waiter that then gets the lock of the deleted file notices and
    locks the new one, so deleting never lets two holders in."""

    def __init__(self, folder: str, name: str) -> None:
        self.folder, self.name = folder, name
        self._dir: PrivateDir | None = None
        self._fd: int | None = None

    def __enter__(self) -> "FileLock":
        while True:
            d = PrivateDir(self.folder)
            fd = os.open(self.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=d.fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(self.name, dir_fd=d.fd, follow_symlinks=False).st_ino \
                    == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._dir, self._fd = d, fd
                return self
            os.close(fd)
            d.close()

    def remove(self) -> None:
        if self._dir is not None:
            self._dir.unlink(self.name)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._dir.close()
            self._fd, self._dir = None, None
