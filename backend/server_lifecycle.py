"""The stub's view of the server's life: is tritonserver stopping (or unloading our
model), and how to stop it.

No Triton import here: it reads the stub's parent process (/proc), the model's HTTP
readiness endpoint and the stop signals of the stub's process group.
"""
from __future__ import annotations

import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote


def stop_tritonserver(logger) -> None:
    """SIGTERM to tritonserver, the stub's parent: it stops serving (readiness fails at
    once), unloads the models and exits."""
    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        name = "?"
    if name != "tritonserver":
        logger.log_error(f"radixlm: the stub's parent is {name!r} (pid {parent}), not "
                         "tritonserver: not stopping it")
        return
    logger.log_error(f"radixlm: stopping tritonserver (pid {parent}) so that it is restarted")
    os.kill(parent, signal.SIGTERM)


def tritonserver_flags(args: list[str]) -> dict[str, str]:
    """tritonserver's ``--flag=value`` / ``--flag value`` arguments by name (``_`` read as
    ``-``; the last of a repeated flag wins)."""
    flags: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            flags[key.replace("_", "-")] = value
    return flags


def http_base_url(args: list[str]) -> str | None:
    """Where this host reaches tritonserver's HTTP endpoint, from its flags (Triton's
    default port 8000); None when it serves no HTTP."""
    flags = tritonserver_flags(args)
    if flags.get("allow-http", "true").lower() in ("false", "0", "no", "off"):
        return None
    host = flags.get("http-address", "0.0.0.0")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://{host}:{flags.get('http-port', '8000')}"


def model_ready_url(model: str, version: str = "", pid: int | None = None) -> str | None:
    """The readiness URL of ``model`` on tritonserver, the stub's parent (read from its
    flags); None when the parent is not tritonserver or serves no HTTP.

    Why the model's and not the server's (``/v2/health/ready``): with strict readiness
    (Triton's default) the server is not ready while any model is not, so in explicit
    model-control mode a failed load of another model turns it false. Our model's
    readiness turns false only when it is being unloaded, and the endpoint stops
    answering when the server stops: both mean our requests must end now."""
    pid = pid or os.getppid()
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() != "tritonserver":
            return None
        args = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return None
    base = http_base_url(args)
    if base is None:
        return None
    path = f"/v2/models/{quote(model, safe='')}" + (f"/versions/{version}" if version else "")
    return f"{base}{path}/ready"


def not_ready(url: str, timeout_s: float = 2.0) -> bool:
    """True when tritonserver says the model at ``url`` is not ready (being unloaded) or
    no longer answers (stopping); False when ready or when the answer did not come in
    time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return answer.status != 200
    except urllib.error.HTTPError as exc:
        # 403: the health API is restricted (an operator's --http-restricted-api), which
        # says nothing about the model; signals are then the only sign of a stop
        return exc.code != 403
    except (urllib.error.URLError, ConnectionError) as exc:
        return not isinstance(getattr(exc, "reason", None), TimeoutError)
    except TimeoutError:
        return False


def watch_stop_signals() -> threading.Event | None:
    """An event set when this process gets SIGTERM or SIGINT; None where handlers cannot
    be installed (only the main thread may).

    Why: on shutdown tritonserver neither cancels in-flight decoupled requests nor calls
    ``finalize`` before each has sent its final response, so a long stream would hold the
    server up. The Python backend stub shares tritonserver's process group, so Ctrl-C or
    ``kill -TERM -<pgid>`` reaches it too. Its main thread sits in C++ (a Python handler
    would run late), so the signal is read from a wakeup fd by a watcher thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    stopping = threading.Event()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)  # the stub keeps running until finalize
    signal.set_wakeup_fd(write_fd)

    def watch() -> None:
        while os.read(read_fd, 64):
            stopping.set()

    threading.Thread(target=watch, name="radixlm-signal-watch", daemon=True).start()
    return stopping
