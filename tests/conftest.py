"""Shared fixtures: the default model, a real tritonserver started through radixlm-serve,
and an in-process reference engine configured exactly like the served one."""
from __future__ import annotations

import json
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from interpreter_cases import InterpreterWorkers

REPO = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO / "model_repository"
DEFAULT_MODEL = REPO / "models" / "default"
SERVED_MODEL = "llm"
SERVER_START_TIMEOUT_S = 300
# The servers the tests start take their admin token from here (backend/admin_access.py):
# Triton's administrative APIs need it as a header, debug requests as a parameter (HTTP
# generate) or a header (gRPC).
ADMIN_TOKEN = secrets.token_hex(16)
ADMIN_HEADERS = {"radixlm-admin-token": ADMIN_TOKEN}
ADMIN_PARAMETERS = {"radixlm-admin-token": ADMIN_TOKEN}


INTERPRETER_WORKERS = pytest.StashKey[InterpreterWorkers]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the kernel modules' interpreter children (interpreter_cases.py) in the
    background, in the order the modules will run."""
    if session.config.option.collectonly:
        return
    files = dict.fromkeys(str(item.path) for item in session.items
                          if "interpreter_results" in item.fixturenames)
    workers = InterpreterWorkers(list(files))
    session.config.stash[INTERPRETER_WORKERS] = workers
    workers.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    workers = config.stash.get(INTERPRETER_WORKERS, None)
    if workers is not None:
        workers.stop()


@pytest.fixture(scope="module")
def interpreter_results(request) -> dict[str, str]:
    """A kernel module's case outcomes ("ok" or the traceback), by case id: what its
    interpreter child reported (see interpreter_cases.py)."""
    return request.config.stash[INTERPRETER_WORKERS].results(str(request.path))


def ensure_default_model() -> Path:
    """Build models/default unless it is up to date (the builder checks its recipe)."""
    subprocess.run([sys.executable, "-m", "tools.build_default_model",
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


def child_pids(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def tritonserver_pid(server: "TritonServer") -> int:
    """radixlm-serve runs tritonserver as its child (backend/supervisor.py)."""
    [pid] = child_pids(server.process.pid)
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"
    return pid


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


def start_server(log_path: Path, extra_args: tuple[str, ...] = (), env: dict | None = None,
                 wait_ready: bool = True) -> TritonServer:
    """Start tritonserver through the launcher on free ports; returns once the served
    model is ready. The caller stops it with ``_stop(server.process)``. ``env``: more
    environment variables for the server."""
    http, grpc, metrics = free_ports(3)
    launcher = Path(sys.prefix) / "bin" / "radixlm-serve"
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "backend.launcher"]
    command += [f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
                "--exit-on-error=false", *extra_args]
    log = open(log_path, "wb")
    # Its own session, so that stopping it reaches every process it started.
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, "RADIXLM_ADMIN_TOKEN": ADMIN_TOKEN,
                                    **(env or {})})
    log.close()
    server = TritonServer(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}",
                          SERVED_MODEL, log_path, process)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    if not wait_ready:
        return server
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
    from backend.model_config import engine_config_from_parameters

    ensure_default_model()
    search_dirs = [MODEL_REPOSITORY / SERVED_MODEL, MODEL_REPOSITORY, REPO]
    return Engine(engine_config_from_parameters(model_parameters(), search_dirs))


# ---- clients of the served model (shared by the server tests) --------------------------

# The optional outputs the server tests read (each is sent only when asked for)
RETURNED = ("finish_reason", "logprobs", "output_ids", "context_ids", "num_input_tokens",
            "num_output_tokens", "num_cached_tokens", "index")


def grpc_inputs(prompt: str, params: dict, stream: bool = True, **extra) -> list:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    tensors = [
        tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([stream]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_),
               "BYTES"),
        tensor("exclude_input_in_output", np.array([True]), "BOOL"),
        *(tensor(f"return_{name}", np.array([True]), "BOOL") for name in RETURNED),
    ]
    return tensors + [tensor(name, array, dtype) for name, (array, dtype) in extra.items()]


def response_dict(result) -> dict:
    response = result.get_response()
    out = {"id": response.id, "final": response.parameters["triton_final_response"].bool_param}
    names = {o.name for o in response.outputs}
    for name in ("text_output", "finish_reason", "logprobs"):
        if name in names:
            out[name] = result.as_numpy(name)[0].decode("utf-8")
    for name in ("output_ids", "context_ids"):
        if name in names:
            out[name] = [int(i) for i in result.as_numpy(name)]
    for name in ("num_input_tokens", "num_output_tokens", "num_cached_tokens", "index"):
        if name in names:
            out[name] = int(result.as_numpy(name)[0])
    if "index" in names and "num_output_tokens" in names:  # n > 1: one entry per sample
        ids, start, out["samples"] = out.get("output_ids", []), 0, {}
        for index, count in zip(result.as_numpy("index"), result.as_numpy("num_output_tokens")):
            out["samples"][int(index)] = ids[start:start + int(count)]
            start += int(count)
    return out


class Stream:
    """One gRPC bidirectional stream; responses are grouped by request id."""

    def __init__(self, server) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result=None, error=None:
                                 self.events.put((result, error)))
        self.model = server.model

    def send(self, request_id: str, inputs: list) -> None:
        self.client.async_stream_infer(self.model, inputs, request_id=request_id,
                                       enable_empty_final_response=True)

    def collect(self, request_ids, timeout_s: float = 120.0) -> dict[str, list[dict]]:
        pending, responses = set(request_ids), {rid: [] for rid in request_ids}
        deadline = time.monotonic() + timeout_s
        while pending:
            result, error = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert error is None, f"stream error: {error}"
            item = response_dict(result)
            responses[item["id"]].append(item)
            if item["final"]:
                pending.discard(item["id"])
        return responses

    def next_error(self, timeout_s: float = 60.0) -> str:
        result, error = self.events.get(timeout=timeout_s)
        assert error is not None, f"expected an error, got {response_dict(result)}"
        return str(error)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture
def stream(triton_server):
    s = Stream(triton_server)
    yield s
    s.close()


class Generated(dict):
    """HTTP generate's JSON; Triton writes one-element arrays as scalars, so list-valued
    outputs are read back as lists."""

    def __init__(self, response: requests.Response) -> None:
        super().__init__(response.json())
        self.status_code = response.status_code
        for name in ("output_ids", "context_ids"):
            if name in self and not isinstance(self[name], list):
                self[name] = [self[name]]


def http_generate(server, body: dict, timeout_s: float = 120.0,
                  headers: dict | None = None) -> Generated:
    return Generated(requests.post(
        f"http://{server.http_url}/v2/models/{server.model}/generate", json=body,
        timeout=timeout_s, headers=headers))


def generate_body(prompt: str, params: dict) -> dict:
    return {"text_input": prompt, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params),
            **{f"return_{name}": True for name in RETURNED}}


def server_stats(server) -> dict:
    response = http_generate(server, {"parameters": {"debug": "stats", **ADMIN_PARAMETERS}})
    assert response.status_code == 200, response
    return json.loads(response["stats"])


def sigterm_mid_stream(server, s: "Stream") -> dict:
    """Start a long greedy stream on ``s``, SIGTERM the server's process group once it has
    streamed, and return the stream's final response (it must end without an error)."""
    s.send("long", grpc_inputs("Tell me a story.", {"temperature": 0, "max_tokens": 3000,
                                                      "ignore_eos": True}))
    result, error = s.events.get(timeout=60)
    assert error is None, error
    os.killpg(server.process.pid, signal.SIGTERM)
    while True:
        result, error = s.events.get(timeout=30)
        assert error is None, error
        item = response_dict(result)
        if item["final"]:
            return item


def joined(pieces: list[dict]) -> tuple[str, list[int]]:
    return "".join(p["text_output"] for p in pieces), [i for p in pieces for i in p["output_ids"]]


# ---- built once for several test files (imported here only when a test asks) -----------

@pytest.fixture(scope="session")
def structured_engine():
    """The jump-forward engine of test_structured_outputs.py and
    test_structured_jump_forward.py (structured_cases.py)."""
    from structured_cases import _engine
    return _engine(enable_jump_forward=True)


@pytest.fixture(scope="session")
def structured_big_batch(structured_engine) -> dict:
    """structured_cases.run_big_batch on that engine: over a minute on CPU, so once."""
    from structured_cases import run_big_batch
    return run_big_batch(structured_engine)


@pytest.fixture(scope="session")
def chart_helm(tmp_path_factory):
    """helm on deploy/helm/radixlm (deploy_helpers.Helm), for the chart and image tests."""
    from deploy_helpers import find_helm
    return find_helm(tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="session")
def rendered_chart(chart_helm) -> dict[str, dict[str, dict]]:
    """The chart rendered for each of deploy_helpers.VARIANTS: {variant: {kind: object}}."""
    from deploy_helpers import render_variants
    return render_variants(chart_helm)
