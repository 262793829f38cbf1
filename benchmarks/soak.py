"""Soak: many mixed requests against a real tritonserver, then what it lost or leaked.

    .venv/bin/python benchmarks/soak.py [--requests 10000] [--workers 24] [--out docs]

Starts ``radixlm-serve`` on the default model (model_repository's ``llm`` with
``request_timeout_s`` 10, so that a non-streamed HTTP client that leaves costs at most
10 s of engine time), sends the requests of ``soak_clients.plan`` (gRPC and HTTP,
streamed and not, a quarter of them constrained; 10% cancelled by their client leaving,
5% malformed) from ``--workers`` threads, and then checks:

* lost: a request that is not malformed and whose client stayed ended in an error, or
  malformed and was accepted; hangs: no end within ``soak_clients.HANG_S``;
* leaked: once the server is at rest, its debug stats must show no request running,
  waiting or pending and no KV slot held by a request (and the KV integrity check);
* metrics: ``radixlm_requests_total`` by finish reason must equal the client's counts
  (finished requests by their reason; every cancelled request as ``abort``).

Writes ``<out>/soak.json`` (compact) and ``<out>/soak.md``. Exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_clients import MODEL, plan, run_all  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.replicas import free_ports  # noqa: E402  (the replicas tool's, one copy)

REPO = Path(__file__).resolve().parents[1]
REASONS = ("stop", "length", "abort", "error")


class Server:
    """radixlm-serve on free ports, its own session (stopped with its process group)."""

    def __init__(self, workdir: Path) -> None:
        repo = workdir / "repo"
        shutil.copytree(REPO / "model_repository" / "llm", repo / "llm")
        config = repo / "llm" / "config.pbtxt"
        config.write_text(config.read_text() + '\nparameters: { key: "request_timeout_s" '
                                               'value: { string_value: "10" } }\n')
        self.http, self.grpc, self.metrics = free_ports(3)
        self.token = secrets.token_hex(16)
        self.log = workdir / "server.log"
        launcher = Path(sys.prefix) / "bin" / "radixlm-serve"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(launcher), f"--model-repository={repo}", f"--http-port={self.http}",
                 f"--grpc-port={self.grpc}", f"--metrics-port={self.metrics}"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "RADIXLM_ADMIN_TOKEN": self.token})
        deadline = time.monotonic() + 600
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: see {self.log}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/{MODEL}/ready",
                                        timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stats(self) -> dict:
        body = {"parameters": {"debug": "stats", "radixlm-admin-token": self.token}}
        r = requests.post(f"http://127.0.0.1:{self.http}/v2/models/{MODEL}/generate",
                          json=body, timeout=60)
        return json.loads(r.json()["stats"])

    def requests_by_reason(self) -> dict[str, int]:
        text = requests.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=30).text
        counts = dict.fromkeys(REASONS, 0)
        for reason, value in re.findall(
                r'^radixlm_requests_total\{[^}]*finish_reason="(\w+)"[^}]*\} (\S+)$', text, re.M):
            counts[reason] += int(float(value))
        return counts

    def stop(self) -> float:
        started = time.monotonic()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        return time.monotonic() - started


def at_rest(server: Server, timeout_s: float = 120.0) -> dict:
    """The server's stats once nothing runs (time-limited requests end within 10 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        busy = stats["num_running"] + stats["num_waiting"] + stats["num_pending_requests"]
        if busy == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def expected_by_reason(results) -> dict[str, int]:
    """What the engine's request counter must have counted, from the client's side."""
    counts = dict.fromkeys(REASONS, 0)
    for r in results:
        if r.spec.fate == "cancel":
            counts["abort"] += 1
        elif r.spec.fate == "finish" and r.outcome == "final":
            counts[r.detail if r.detail in REASONS else "stop"] += 1
    return counts


def summarize(results, seconds: float, stats: dict, metrics: dict, expected: dict) -> dict:
    outcome = collections.Counter(f"{r.spec.fate}:{r.outcome}" for r in results)
    lost = [r for r in results if (r.spec.fate == "finish" and r.outcome != "final")
            or (r.spec.fate == "malformed" and r.outcome != "error")
            or (r.spec.fate == "cancel" and r.outcome not in ("left", "error"))]
    hangs = [r for r in results if r.outcome == "hang"]
    leaked = {k: stats[k] for k in ("num_running", "num_waiting", "num_pending_requests",
                                    "kv_tokens_in_use_by_requests")}
    seconds_finished = sorted(r.seconds for r in results if r.spec.fate == "finish")
    return {
        "requests": len(results), "seconds": round(seconds, 1),
        "requests_per_s": round(len(results) / seconds, 2),
        "by_transport": dict(collections.Counter(r.spec.transport for r in results)),
        "by_constraint": dict(collections.Counter(r.spec.constraint for r in results
                                                  if r.spec.fate == "finish")),
        "outcomes": dict(sorted(outcome.items())),
        "lost": len(lost), "hangs": len(hangs),
        "lost_examples": [f"{r.spec.transport}/{r.spec.fate}/{r.spec.constraint}: "
                          f"{r.outcome} {r.detail[:160]}" for r in lost[:10]],
        "malformed_answers": {f"{r.spec.params} {r.spec.prompt!r}": r.detail[:200]
                              for r in results if r.spec.fate == "malformed"},
        "leaked": leaked, "integrity_ok": stats["integrity_ok"],
        "metrics_requests_total": metrics, "client_expected": expected,
        "metrics_match": metrics == expected,
        "latency_s": {"p50": round(seconds_finished[len(seconds_finished) // 2], 3),
                      "p99": round(seconds_finished[int(len(seconds_finished) * 0.99)], 3)},
    }


def served_model() -> str:
    """The default model's build recipe (tools/build_default_model.py writes it)."""
    try:
        marker = json.loads((REPO / "models" / "default" / "radixlm_build.json").read_text())
        return str(marker["recipe"])
    except (OSError, ValueError, KeyError):
        return "unknown build"


def write(out: Path, summary: dict, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
               "model": f"models/default ({served_model()}, CPU)", "workers": args.workers,
               **summary}
    (out / "soak.json").write_text(json.dumps(summary, separators=(",", ":")) + "\n")
    ok = summary["lost"] == 0 and summary["hangs"] == 0 and summary["metrics_match"] \
        and not any(summary["leaked"].values()) and summary["integrity_ok"]
    o = summary["outcomes"]
    lines = [
        "# Soak", "",
        f"`benchmarks/soak.py --requests {summary['requests']} --workers {args.workers}` on "
        f"{summary['machine']}, {summary['model']}: {summary['seconds']} s "
        f"({summary['requests_per_s']} requests/s). Raw figures: `soak.json`.", "",
        "| requests | lost | hangs | leaked KV slots | metrics = client counts | SIGTERM exit |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {summary['requests']} | {summary['lost']} | {summary['hangs']} | "
        f"{summary['leaked']['kv_tokens_in_use_by_requests']} | "
        f"{'yes' if summary['metrics_match'] else 'NO'} "
        f"({summary['metrics_requests_total']}) | {summary['sigterm_exit_s']} s |", "",
        f"Finished: {o.get('finish:final', 0)}; cancelled by their client leaving: "
        f"{sum(v for k, v in o.items() if k.startswith('cancel:'))}; malformed, each "
        f"refused with an error: {o.get('malformed:error', 0)}. "
        f"Latency of finished requests: p50 {summary['latency_s']['p50']} s, "
        f"p99 {summary['latency_s']['p99']} s.",
        "" if ok else "**A check failed**: see `soak.json`.",
    ]
    (out / "soak.md").write_text("\n".join(lines).rstrip() + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="radixlm-soak-"))
    server = Server(workdir)
    try:
        specs = plan(args.requests, args.seed)
        run_all(plan(8, args.seed + 1), f"127.0.0.1:{server.http}", f"127.0.0.1:{server.grpc}",
                4)  # warm-up: grammar compilers, connections
        at_rest(server)
        time.sleep(2.0)  # metrics are published a moment after the fact
        before = server.requests_by_reason()
        started = time.monotonic()
        step = max(args.requests // 20, 1)
        results = run_all(specs, f"127.0.0.1:{server.http}", f"127.0.0.1:{server.grpc}",
                          args.workers, progress=lambda n: n % step == 0 and print(
                              f"soak: {n}/{args.requests} in {time.monotonic() - started:.0f} s",
                              flush=True))
        seconds = time.monotonic() - started
        stats = at_rest(server)
        time.sleep(2.0)  # metrics are published a moment after the fact
        after = server.requests_by_reason()
        metrics = {k: after[k] - before[k] for k in REASONS}
        summary = summarize(results, seconds, stats, metrics, expected_by_reason(results))
        summary["sigterm_exit_s"] = round(server.stop(), 2)
    finally:
        server.stop()
    write(args.out, summary, args)
    print(json.dumps(summary, indent=1))
    good = summary["lost"] == 0 and summary["hangs"] == 0 and summary["metrics_match"] \
        and not any(summary["leaked"].values()) and summary["integrity_ok"]
    print(f"soak: the server's log is {server.log}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
