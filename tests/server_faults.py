"""Helpers of the fault tests against a real tritonserver (test_server_faults.py): clients
that record how their request ended, and what a server may leave behind."""
from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import requests

from backend.runtime_dir import default_location
from backend.supervisor import shm_prefix
from conftest import Stream, child_pids, grpc_inputs, response_dict

LONG = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}


@dataclass
class Ending:
    """How one client's request ended, and when (time.monotonic())."""

    kind: str = ""  # "final" (finish_reason in detail) or "error"
    detail: str = ""
    at: float = 0.0
    streamed: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def end(self, kind: str, detail: str) -> None:
        if not self.done.is_set():
            self.kind, self.detail, self.at = kind, detail, time.monotonic()
            self.done.set()


def grpc_stream(server, request_id: str = "long") -> tuple[Stream, Ending]:
    """A long greedy gRPC stream on a connection of its own, streaming when returned."""
    s, ending = Stream(server), Ending()

    def read() -> None:
        while True:
            try:
                result, error = s.events.get(timeout=120)
            except queue.Empty:
                return
            if error is not None:
                return ending.end("error", str(error))
            ending.streamed.set()
            item = response_dict(result)
            if item["final"]:
                return ending.end("final", item.get("finish_reason", ""))

    s.send(request_id, grpc_inputs("Tell me a long story.", LONG))
    threading.Thread(target=read, daemon=True).start()
    assert ending.streamed.wait(60)
    return s, ending


def http_stream(server) -> Ending:
    """A long greedy HTTP generate_stream, streaming when returned."""
    ending = Ending()

    def read() -> None:
        body = {"text_input": "Tell me a long story.", "stream": True,
                "return_finish_reason": True, "sampling_parameters": json.dumps(LONG)}
        try:
            with requests.post(f"http://{server.http_url}/v2/models/{server.model}"
                               "/generate_stream", json=body, stream=True, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        return ending.end("error", event["error"])
                    ending.streamed.set()
                    if event.get("finish_reason") not in (None, "", "None"):  # "None": running
                        return ending.end("final", event["finish_reason"])
            ending.end("error", "the stream ended without a final response")
        except requests.RequestException as exc:
            ending.end("error", repr(exc))

    threading.Thread(target=read, daemon=True).start()
    assert ending.streamed.wait(60)
    return ending


def http_generate_in_background(server, params: dict, timeout_s: float = 120) -> Ending:
    """A non-streamed HTTP generate, answered on another thread."""
    ending = Ending()

    def run() -> None:
        body = {"text_input": "Tell me a long story.", "sampling_parameters": json.dumps(params)}
        try:
            r = requests.post(f"http://{server.http_url}/v2/models/{server.model}/generate",
                              json=body, timeout=timeout_s)
            answer = r.json()
            if r.status_code == 200:
                ending.end("final", answer.get("finish_reason", ""))
            else:
                ending.end("error", answer.get("error", r.text))
        except requests.RequestException as exc:
            ending.end("error", repr(exc))

    threading.Thread(target=run, daemon=True).start()
    return ending


def ready(server, path: str = "/v2/health/ready") -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stub_pids(triton_pid: int) -> dict[str, int]:
    """tritonserver's Python stubs by model instance name (their 9th argument)."""
    found = {}
    for pid in child_pids(triton_pid):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if len(args) > 8 and b"triton_python_backend_stub" in args[0]:
            found[args[8].decode()] = pid
    return found


def session_processes(session: int) -> list[int]:
    """Processes (zombies aside) of the session the server was started in."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(int(entry))
    return found


def leftovers(server, triton_pid: int) -> list[str]:
    """What the ended server left: processes, runtime files, shared-memory regions."""
    supervisor = server.process.pid
    left = [f"process {p}" for p in session_processes(supervisor)]
    folder = default_location()
    if folder.is_dir():
        left += [f"{folder}/{n}" for n in os.listdir(folder)
                 if n.startswith((f"engine-{triton_pid}-", f"watch-{supervisor}."))]
    left += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm")
             if n.startswith(shm_prefix(supervisor))]
    return left


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Poll ``condition``; the time.monotonic() it held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic()
