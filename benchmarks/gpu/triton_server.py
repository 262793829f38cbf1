"""bench_triton's server side: the temporary model repository (the repo's ``llm/config.pbtxt``
with the benchmark's engine settings) and tritonserver started through ``backend.launcher``,
asked for readiness and stats, and stopped with its process group."""
from __future__ import annotations

import ast
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402

MODEL = "llm"


def engine_fields() -> set[str]:
    """The model parameters config.pbtxt may set: EngineConfig's field names and the
    serving layer's own (backend/model_config.py), read from the source (no torch import
    here)."""
    names: set[str] = set()
    tree = ast.parse((C.REPO / "backend/core/config.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineConfig":
            names |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
    for node in ast.parse((C.REPO / "backend/model_config.py").read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) in ("SERVING_PARAMETERS",
                                                             "REPORT_CUSTOM_METRICS")):
            value = ast.literal_eval(node.value)
            names |= {value} if isinstance(value, str) else set(value)
    return names


def make_repository(root: Path, model_dir: str, device: str, dtype: str, extra: dict,
                    instances: int = 1) -> Path:
    src = (C.REPO / "model_repository/llm/config.pbtxt").read_text()
    settings = {
        "model_path": str(Path(model_dir).resolve()), "device": device, "dtype": dtype,
        "load_format": "dummy", "max_total_tokens": "none" if device == "cuda" else "32768",
        "max_running_requests": "256", "max_prefill_tokens": "8192", "schedule_policy": "lpm",
        "enable_radix_cache": "true", "enable_overlap": "true", "enable_cuda_graph": "true",
        "attention_backend": "auto",
    }
    settings.update({k: str(v) for k, v in extra.items()})
    known = engine_fields()
    dropped = [k for k in settings if known and k not in known]
    if dropped:
        log(f"warning: EngineConfig has no field(s) {dropped}; left out of config.pbtxt")
    settings = {k: v for k, v in settings.items() if not known or k in known}
    lines = []
    for line in src.splitlines():
        m = re.match(r'\s*parameters:\s*\{\s*key:\s*"([^"]+)"', line)
        if m and m.group(1) in settings:
            continue
        lines.append(line)
    text = "\n".join(lines)
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    text = re.sub(r"instance_group \[[^\]]*\]",
                  f"instance_group [ {{ count: {instances}, kind: {kind} }} ]", text)
    text += "\n" + "\n".join(
        f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in settings.items()) + "\n"
    d = root / MODEL
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(text)
    return root


def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Server:
    def __init__(self, python: str, repo: Path, log_path: Path, profile_dir: str | None = None):
        self.http, self.grpc, self.metrics = free_ports(3)
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if profile_dir:  # backend/serving.py profiles its engine loop thread into it
            env["RADIXLM_PROFILE_DIR"] = profile_dir
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("RADIXLM_TRACE_REQUESTS", "4096")  # request timelines in the stats
        # the repository index and debug stats are administrative: they need the token
        self.admin_token = env.setdefault("RADIXLM_ADMIN_TOKEN", secrets.token_hex(16))
        cmd = [python, "-m", "backend.launcher", f"--model-repository={repo}",
               f"--http-port={self.http}", f"--grpc-port={self.grpc}",
               f"--metrics-port={self.metrics}", "--exit-on-error=false", "--log-verbose=0",
               # unloading the model waits out the whole exit timeout (30 s by default)
               "--exit-timeout-secs=5"]
        log("server: " + " ".join(cmd))
        self.log_file = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=C.REPO, env=env, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    @property
    def grpc_url(self):
        return f"127.0.0.1:{self.grpc}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/{MODEL}/ready",
                                        timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def load_failure(self) -> str | None:
        """The reason Triton gives for a model it failed to load (it keeps running with
        --exit-on-error=false, so readiness alone would only time out)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}/v2/repository/index",
                                     data=b"{}", headers={"Content-Type": "application/json",
                                                          "radixlm-admin-token": self.admin_token})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                index = json.loads(r.read())
        except (OSError, ValueError):
            return None
        for entry in index:
            if entry.get("state") == "UNAVAILABLE" and entry.get("reason"):
                return f"{entry.get('name')}: {entry['reason']}"
        return None

    def wait_ready(self, timeout_s: float) -> float:
        t = time.monotonic()
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.proc.returncode}):\n{self.tail()}")
            failure = self.load_failure()
            if failure:
                raise RuntimeError(f"tritonserver failed to load {failure[:2000]}")
            if time.monotonic() - t > timeout_s:
                raise RuntimeError(f"tritonserver not ready after {timeout_s:.0f}s:\n{self.tail()}")
            time.sleep(0.5)
        return time.monotonic() - t

    def stats(self) -> dict | None:
        body = json.dumps({"parameters": {"debug": "stats",
                                          "radixlm-admin-token": self.admin_token}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}/v2/models/{MODEL}/generate",
                                     data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(json.loads(r.read())["stats"])
        except Exception as exc:  # noqa: BLE001
            return {"error": str(exc)}

    def tail(self, n=80) -> str:
        try:
            self.log_file.flush()
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        # a crashed tritonserver can leave its Python stubs (and their GPU memory) behind
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log_file.close()
