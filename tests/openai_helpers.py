"""Starting radixlm-openai (and the router) as processes for the tests, on free ports."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO, free_ports

START_TIMEOUT_S = 120


@dataclass(frozen=True)
class Process:
    url: str  # http://127.0.0.1:port
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start(command: list[str], url: str, ready_path: str, log_path: Path) -> Process:
    log = open(log_path, "wb")
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    started = Process(url, process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not http_ok(url + ready_path):
        if process.poll() is not None or time.monotonic() > deadline:
            started.stop()
            raise RuntimeError(f"{command[0]} did not start:\n{started.log_tail()}")
        time.sleep(0.3)
    return started


def official_client(server: Process):
    """The official openai client of a started radixlm-openai (no retries: a test sees
    the first answer)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def start_openai_server(grpc_url: str, log_path: Path, *extra: str) -> Process:
    (port,) = free_ports(1)
    script = Path(sys.prefix) / "bin" / "radixlm-openai"
    command = [str(script), f"--grpc-url={grpc_url}", "--host=127.0.0.1", f"--port={port}",
               "--log-level=warning", *extra]
    return start(command, f"http://127.0.0.1:{port}", "/health", log_path)
