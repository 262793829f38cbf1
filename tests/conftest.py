"""Shared fixtures: the default model, a real tritonserver started through radixlm-serve,
and an in-process reference engine configured exactly like the served one."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO / "model_repository"
DEFAULT_MODEL = REPO / "models" / "default"
SERVED_MODEL = "llm"
SERVER_START_TIMEOUT_S = 300


def ensure_default_model() -> Path:
    """Build models/default unless it is up to date (the builder checks its recipe)."""
    subprocess.run([sys.executable, "-m", "backend.core.default_model",
                    "--out", str(DEFAULT_MODEL)], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    return DEFAULT_MODEL


def model_parameters(model: str = SERVED_MODEL) -> dict[str, str]:
    """The `parameters` of model_repository/<model>/config.pbtxt, as strings."""
    text = (MODEL_REPOSITORY / model / "config.pbtxt").read_text()
    pattern = r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}'
    return dict(re.findall(pattern, text))


def free_ports(count: int) -> list[int]:
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclass(frozen=True)
class TritonServer:
    http_url: str  # host:port, as tritonclient.http wants it
    grpc_url: str  # host:port, as tritonclient.grpc wants it
    metrics_url: str
    model: str
    log_path: Path
    process: subprocess.Popen

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (tritonserver and its Python stubs), then KILL."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    except ProcessLookupError:
        pass


def start_server(log_path: Path, extra_args: tuple[str, ...] = ()) -> TritonServer:
    """Start tritonserver through the launcher on free ports; returns once the served
    model is ready. The caller stops it with ``_stop(server.process)``."""
    http, grpc, metrics = free_ports(3)
    launcher = Path(sys.prefix) / "bin" / "radixlm-serve"
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "backend.launcher"]
    command += [f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
                "--exit-on-error=false", *extra_args]
    log = open(log_path, "wb")
    # Its own session, so that stopping it reaches every process it started.
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    server = TritonServer(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}",
                          SERVED_MODEL, log_path, process)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    ready_url = f"http://{server.http_url}/v2/models/{SERVED_MODEL}/ready"
    while not _ready(ready_url):
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise RuntimeError(f"tritonserver did not become ready:\n{server.log_tail()}")
        time.sleep(0.5)
    return server


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory) -> TritonServer:
    """A real tritonserver serving model_repository/ (the `llm` model on the default
    model) for the whole test session; stopped, with its process group, at the end."""
    ensure_default_model()
    server = start_server(tmp_path_factory.mktemp("tritonserver") / "server.log")
    try:
        yield server
    finally:
        _stop(server.process)


@pytest.fixture(scope="session")
def reference_engine():
    """An in-process Engine with the served model's config.pbtxt settings."""
    from backend.core import Engine
    from backend.wire import engine_config_from_parameters

    ensure_default_model()
    search_dirs = [MODEL_REPOSITORY / SERVED_MODEL, MODEL_REPOSITORY, REPO]
    return Engine(engine_config_from_parameters(model_parameters(), search_dirs))
