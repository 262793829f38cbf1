"""N replicas (tritonserver + radixlm-openai each) behind sglang-router, on one machine.

    .venv/bin/python tools/replicas.py --replicas 2 --policy cache_aware --port 8080

The router (sglang-router, from PyPI) sends each request to the replica whose radix cache
most likely holds its prefix (``cache_aware``: an approximate prefix tree of the text each
replica was sent; a prefix it has not seen goes to the least-loaded replica, and all go by
load once the loads drift far apart) or in turn (``round_robin``). It checks every
replica's ``/health`` and takes a failing one out of rotation; a request that fails on a
replica before any answer is retried on another. Ctrl-C (or SIGTERM) stops everything.
``Cluster`` is the same thing as a context manager, for tests and benchmarks.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.prefix) / "bin"
START_TIMEOUT_S = 300


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _spawn(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:  # its own process group: stopping it reaches its children
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _signal(process: subprocess.Popen, sig: int) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass


def _stop(process: subprocess.Popen, timeout_s: float = 30) -> None:
    _signal(process, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal(process, signal.SIGKILL)
        process.wait(timeout=10)


def _wait(url: str, processes: list[subprocess.Popen], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _ok(url):
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"{what} did not start ({url}):\n{tail}")
        time.sleep(0.5)


@dataclass
class Replica:
    index: int
    triton: subprocess.Popen
    openai: subprocess.Popen
    http_url: str  # Triton's HTTP endpoint (debug stats)
    grpc_url: str
    url: str  # the OpenAI server: what the router is given

    def kill(self) -> None:
        """A crash: SIGKILL both servers of the replica, no graceful shutdown."""
        _signal(self.openai, signal.SIGKILL)
        _signal(self.triton, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.openai)
        _stop(self.triton)


@dataclass
class Cluster:
    replicas: int = 2
    policy: str = "cache_aware"
    port: int | None = None
    models: tuple[str, ...] = ("llm", "postprocessing")
    health_interval_s: int = 1
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="radixlm-replicas-")))
    members: list[Replica] = field(default_factory=list)
    router: subprocess.Popen | None = None
    url: str = ""

    def start(self) -> "Cluster":
        try:
            started = [self._start_triton(i) for i in range(self.replicas)]
            for i, (triton, http, grpc) in enumerate(started):
                _wait(f"http://{http}/v2/health/ready", [triton], f"tritonserver {i}",
                      self.log_dir / f"triton-{i}.log")
                self.members.append(self._start_openai(i, triton, http, grpc))
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_triton(self, i: int):
        http, grpc, metrics = free_ports(3)
        command = [str(BIN / "radixlm-serve"), f"--http-port={http}", f"--grpc-port={grpc}",
                   f"--metrics-port={metrics}", "--model-control-mode=explicit",
                   *[f"--load-model={m}" for m in self.models]]
        triton = _spawn(command, self.log_dir / f"triton-{i}.log")
        return triton, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"

    def _start_openai(self, i: int, triton, http: str, grpc: str) -> Replica:
        (port,) = free_ports(1)
        log = self.log_dir / f"openai-{i}.log"
        openai = _spawn([str(BIN / "radixlm-openai"), f"--grpc-url={grpc}", "--host=127.0.0.1",
                         f"--port={port}", "--log-level=warning"], log)
        url = f"http://127.0.0.1:{port}"
        replica = Replica(i, triton, openai, http, grpc, url)
        self.members.append(replica)  # stopped with the others if it fails to start
        _wait(url + "/health", [openai], f"radixlm-openai {i}", log)
        return self.members.pop()

    def _start_router(self) -> None:
        self.port = self.port or free_ports(1)[0]
        ports = free_ports(1)
        log = self.log_dir / "router.log"
        command = [str(BIN / "sglang-router"), "launch", "--host=127.0.0.1", f"--port={self.port}",
                   f"--policy={self.policy}", "--worker-urls", *[r.url for r in self.members],
                   f"--health-check-interval-secs={self.health_interval_s}",
                   "--health-failure-threshold=1", "--health-check-timeout-secs=2",
                   f"--prometheus-port={ports[0]}", "--log-level=warn"]
        self.router = _spawn(command, log)
        self.url = f"http://127.0.0.1:{self.port}"
        _wait(self.url + "/readiness", [self.router], "sglang-router", log)

    def stop(self) -> None:
        if self.router is not None:
            _stop(self.router)
        for replica in self.members:
            replica.stop()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the cluster as Ctrl-C does


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policy", default="cache_aware",
                        choices=["cache_aware", "round_robin", "power_of_two", "random"])
    parser.add_argument("--port", type=int, default=8080, help="the router's port")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    with Cluster(replicas=args.replicas, policy=args.policy, port=args.port) as cluster:
        for r in cluster.members:
            print(f"replica {r.index}: OpenAI {r.url}  Triton gRPC {r.grpc_url}  HTTP {r.http_url}")
        print(f"== router ({args.policy}): {cluster.url}/v1  (logs: {cluster.log_dir}; Ctrl-C stops)",
              flush=True)
        try:
            while cluster.router.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
