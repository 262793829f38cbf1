"""One engine process in front of several Triton instances of a model on a device.

Triton runs each model instance in a stub process of its own; with N instances on one
device, the first stub to load starts the engine process and has it listen in this
user's private runtime folder (``runtime_dir``), and the others attach to it there, so
all of them share one engine, KV pool and radix cache. A lock file in the same folder
orders the stubs (the second waits while the first builds the engine); the last stub to
leave removes it, and the engine process removes its socket (a stub that finds the engine
dead removes both). Both files carry tritonserver's pid in their names, so that
radixlm-serve removes them after a server that was killed (``runtime_dir``).
"""
from __future__ import annotations

import hashlib
import os

from backend.engine_process import EngineProcess
from backend.runtime_dir import FileLock, SocketAddress, default_location


def shared_address(config, key: str, folder=None,
                   server_pid: int | None = None) -> tuple[SocketAddress, str]:
    """The socket address and the lock file name of the engine process shared under
    ``key`` with ``config`` (another config, say after a model reload with new settings,
    gets an engine of its own) by the stubs of tritonserver ``server_pid`` (the stub's
    parent by default), in this user's private runtime folder."""
    digest = hashlib.sha1(f"{key}\n{config!r}".encode()).hexdigest()[:16]
    stem = f"engine-{os.getppid() if server_pid is None else server_pid}-{digest}"
    folder = str(folder or default_location())
    return SocketAddress(f"{stem}.sock", folder), f"{stem}.lock"


def open_shared(config, key: str, start_timeout_s: float = 1800.0, folder=None,
                server_pid: int | None = None, **kwargs) -> EngineProcess:
    """The engine process of ``key`` (one per tritonserver, model and device) for
    ``config``: attach to the one another stub started, or start it, listening for the
    others. A lock file orders the stubs, so the second waits while the first builds the
    engine."""
    address, lock_name = shared_address(config, key, folder, server_pid)
    lock = FileLock(address.folder, lock_name)
    with lock:
        try:
            engine = EngineProcess.attach(address, config,
                                          rpc_timeout_s=kwargs.get("rpc_timeout_s", 60.0))
        except (ConnectionRefusedError, FileNotFoundError):
            # none yet, or the socket of one that ended: the child binds afresh
            engine = EngineProcess(config, start_timeout_s=start_timeout_s, listen=address,
                                   **kwargs)
    engine.lock, engine.address = lock, address
    return engine
