"""Faults against a real tritonserver started by radixlm-serve: a stub killed mid-stream
(one instance, and one of two sharing an engine process), the engine process killed, a
client killed, SIGTERM with streams open, and another model failing to load in explicit
model-control mode. What must hold each time: no client hangs, readiness tells the truth,
the exit is bounded, and nothing is left behind (processes, runtime files, shared memory).
The supervisor's logic alone, around a stand-in server: test_supervisor.py."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import requests

from conftest import (ADMIN_HEADERS, MODEL_REPOSITORY, REPO, Stream, _stop,
                      ensure_default_model, grpc_inputs, server_stats, start_server,
                      tritonserver_pid)
from server_faults import (LONG, grpc_stream, http_generate_in_background, http_stream,
                           leftovers, ready, stub_pids, wait_for)
from test_engine_process import wait_gone

pytestmark = [pytest.mark.server, pytest.mark.slow]

EXIT_TIMEOUT = ("--exit-timeout-secs=2",)  # the supervisor's bound: 2 s + 3 s


def repository(tmp_path, extra_parameters: str = "", instances: int = 1, broken=False):
    """model_repository's llm (and, asked, a model whose load always fails)."""
    ensure_default_model()
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "llm", repo / "llm")
    config = repo / "llm" / "config.pbtxt"
    text = re.sub(r"instance_group \[[^\]]*\]",
                  f"instance_group [ {{ count: {instances}, kind: KIND_CPU }} ]",
                  config.read_text())
    config.write_text(text + extra_parameters)
    if broken:
        (repo / "broken" / "1").mkdir(parents=True)
        (repo / "broken" / "config.pbtxt").write_text(
            'name: "broken"\nbackend: "python"\nmax_batch_size: 0\n'
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
            'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
        (repo / "broken" / "1" / "model.py").write_text(
            "class TritonPythonModel:\n    def initialize(self, args):\n"
            "        raise RuntimeError('this model never loads')\n")
    return repo


def engine_pid(server) -> int:
    return int(re.search(r"the engine runs in process (\d+)",
                         server.log_path.read_text()).group(1))


def test_a_killed_stub_fails_its_clients_takes_readiness_down_and_the_server_exits(tmp_path):
    """kill -9 of the engine model's stub (what the OOM killer does to the largest
    process): every client it held gets an error within seconds, not a hang; readiness
    fails at once; the server exits with a failure; nothing is left behind."""
    server = start_server(tmp_path / "server.log", EXIT_TIMEOUT)
    try:
        triton = tritonserver_pid(server)
        first, first_end = grpc_stream(server, "a")
        second, second_end = grpc_stream(server, "b")
        http_end = http_stream(server)
        whole_end = http_generate_in_background(server, LONG)
        time.sleep(0.5)  # the non-streamed one is running too
        assert ready(server)
        killed = time.monotonic()
        os.kill(stub_pids(triton)["llm_0_0"], signal.SIGKILL)
        not_ready = wait_for(lambda: not ready(server), 5, "readiness to fail")
        endings = [first_end, second_end, http_end, whole_end]
        for ending in endings:
            assert ending.done.wait(15), "a client of the dead stub hangs"
            assert ending.kind == "error", ending.detail
        assert server.process.wait(20) == 1
        exited = time.monotonic()
        log = server.log_path.read_text()
        assert "radixlm-serve: the stub of llm (llm_0_0, pid" in log and "died" in log
        assert leftovers(server, triton) == []
        print(f"\nstub killed -> readiness false {not_ready - killed:.2f} s, last client "
              f"error {max(e.at for e in endings) - killed:.2f} s, server exit "
              f"{exited - killed:.2f} s")
        for s in (first, second):
            s.close(cancel=True)
    finally:
        _stop(server.process)


def test_one_of_two_instances_killed_stops_the_server_and_the_orphaned_engine_exits(tmp_path):
    """Two stubs share one engine process; the one that started it is killed, leaving the
    engine an orphan. The other stub's streams end with their final response or an
    error, the server exits with a failure, and the engine process exits too."""
    server = start_server(tmp_path / "server.log",
                          (f"--model-repository={repository(tmp_path, instances=2)}",
                           *EXIT_TIMEOUT))
    try:
        triton, engine = tritonserver_pid(server), engine_pid(server)
        streams = [grpc_stream(server, f"s{i}") for i in range(4)]
        starter = int(open(f"/proc/{engine}/stat").read().rsplit(")", 1)[1].split()[1])
        assert starter in stub_pids(triton).values()
        os.kill(starter, signal.SIGKILL)
        wait_for(lambda: not ready(server), 5, "readiness to fail")
        for _, ending in streams:
            assert ending.done.wait(15), "a client hangs"
            assert ending.kind == "error" or ending.detail == "abort", ending.detail
        assert server.process.wait(20) == 1
        wait_gone(engine, "the server", timeout_s=5)
        assert leftovers(server, triton) == []
        for s, _ in streams:
            s.close(cancel=True)
    finally:
        _stop(server.process)


def test_a_killed_engine_process_fails_every_stream_and_the_server_exits(tmp_path):
    repo = repository(tmp_path, '\nparameters: { key: "engine_process" value: '
                                '{ string_value: "true" } }\n')
    server = start_server(tmp_path / "server.log", (f"--model-repository={repo}", *EXIT_TIMEOUT))
    try:
        triton, engine = tritonserver_pid(server), engine_pid(server)
        s, grpc_end = grpc_stream(server)
        http_end = http_stream(server)
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        for ending in (grpc_end, http_end):
            assert ending.done.wait(10) and ending.kind == "error", ending.detail
            assert "the engine" in ending.detail and ending.at - killed < 5
        not_ready = wait_for(lambda: not ready(server), 5, "readiness to fail")
        assert server.process.wait(20) == 1
        exited = time.monotonic()
        assert "asks to stop the server: the engine is not running" in server.log_path.read_text()
        assert leftovers(server, triton) == []
        print(f"\nengine killed -> last client error "
              f"{max(grpc_end.at, http_end.at) - killed:.2f} s, readiness false "
              f"{not_ready - killed:.2f} s, server exit {exited - killed:.2f} s")
        s.close(cancel=True)
    finally:
        _stop(server.process)


def test_sigterm_with_streams_open_ends_each_with_abort_and_exits_within_its_bound(tmp_path):
    """SIGTERM to radixlm-serve alone (Kubernetes signals PID 1) while clients keep their
    streams open: each stream gets its final "abort" at once, and the server, which
    Triton 2.51 would keep up until the clients hang up, exits within exit timeout (2 s
    here) + the supervisor's 3 s margin + its stubs' time to go."""
    server = start_server(tmp_path / "server.log", EXIT_TIMEOUT)
    try:
        triton = tritonserver_pid(server)
        streams = [grpc_stream(server, f"s{i}") for i in range(3)]
        http_end = http_stream(server)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        not_ready = wait_for(lambda: not ready(server), 3, "readiness to fail")
        endings = [e for _, e in streams] + [http_end]
        for ending in endings:
            assert ending.done.wait(10) and (ending.kind, ending.detail) == ("final", "abort")
        assert max(e.at for e in endings) - signalled < 3
        assert server.process.wait(20) == 0  # a stop that was asked for
        took = time.monotonic() - signalled
        assert took < 2 + 3 + 3, took
        assert leftovers(server, triton) == []
        print(f"\nSIGTERM with 4 open streams: readiness false {not_ready - signalled:.2f} s, "
              f"last final abort {max(e.at for e in endings) - signalled:.2f} s, "
              f"exit {took:.2f} s")
        for s, _ in streams:
            s.close(cancel=True)
    finally:
        _stop(server.process)


# ---- explicit model control: another model fails to load; time limits ----------------

@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explicit")
    repo = repository(tmp, '\nparameters: { key: "request_timeout_s" value: '
                           '{ string_value: "3" } }\n', broken=True)
    server = start_server(tmp / "server.log", (f"--model-repository={repo}",
                                               "--model-control-mode=explicit",
                                               "--load-model=llm", *EXIT_TIMEOUT))
    yield server
    _stop(server.process)


def test_a_failed_load_of_another_model_leaves_our_requests_alone(explicit_server):
    server = explicit_server
    s, ending = grpc_stream(server, "running")
    load = requests.post(f"http://{server.http_url}/v2/repository/models/broken/load",
                         headers=ADMIN_HEADERS, timeout=60)
    assert load.status_code == 400 and "this model never loads" in load.json()["error"]
    assert not ready(server)  # the server's readiness counts every model (strict)
    assert ready(server, "/v2/models/llm/ready")
    time.sleep(1.0)  # several readiness polls of the engine loop
    assert not ending.done.is_set()  # still streaming: not aborted
    s.close(cancel=True)
    choices = {"choices": json.dumps(["yes", "no"]), "text_input": "Is it? "}
    scored = requests.post(f"http://{server.http_url}/v2/models/llm/generate", json=choices,
                           timeout=60)
    assert scored.status_code == 200 and len(json.loads(scored.json()["choice_scores"])) == 2


def test_a_non_streamed_request_whose_client_left_ends_at_its_time_limit(explicit_server):
    """Triton 2.51 does not tell a model that an HTTP client of generate disconnected:
    request_timeout_s (3 s here) bounds the work it keeps doing for nobody."""
    server = explicit_server
    gone = http_generate_in_background(server, LONG, timeout_s=1.0)  # the client gives up
    assert gone.done.wait(10) and "timed out" in gone.detail.lower()
    started = time.monotonic()
    wait_for(lambda: server_stats(server)["num_running"] == 0, 10, "the request to end")
    assert time.monotonic() - started < 4
    stats = server_stats(server)
    assert stats["kv_tokens_in_use_by_requests"] == 0 and stats["integrity_ok"] is True
    waiting = http_generate_in_background(server, LONG)  # a client that waits is told why
    assert waiting.done.wait(15)
    assert (waiting.kind, waiting.detail) == ("error", "request timed out (its limit: 3 s)")


def test_a_client_may_ask_for_a_shorter_time_limit(explicit_server):
    s = Stream(explicit_server)
    started = time.monotonic()
    s.client.async_stream_infer("llm", grpc_inputs("Tell me a long story.", LONG),
                                request_id="hurried", timeout=1_000_000)  # microseconds
    try:
        while True:
            result, error = s.events.get(timeout=10)
            if error is not None:
                break
        assert "request timed out (its limit: 1 s)" in str(error)
        assert time.monotonic() - started < 2.5
    finally:
        s.close(cancel=True)


# ---- a client killed mid-stream ----------------------------------------------------------

CLIENT = textwrap.dedent("""
    import json, sys, requests, queue
    sys.path.insert(0, "tests")
    from conftest import Stream, grpc_inputs, TritonServer
    server = TritonServer(sys.argv[1], sys.argv[2], "", "llm", None, None)
    params = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}
    s = Stream(server)
    s.send("g", grpc_inputs("Tell me a long story.", params))
    result, error = s.events.get(timeout=60)
    body = {"text_input": "Another long story.", "stream": True,
            "sampling_parameters": json.dumps(params)}
    r = requests.post(f"http://{sys.argv[1]}/v2/models/llm/generate_stream", json=body,
                      stream=True)
    line = next(line for line in r.iter_lines() if line)
    print(json.dumps({"grpc_error": None if error is None else str(error),
                      "http_status": r.status_code, "http_first": line.decode()}),
          flush=True)
    import time; time.sleep(600)
""")


def test_a_client_killed_mid_stream_has_its_requests_cancelled(triton_server):
    client = subprocess.Popen([sys.executable, "-c", CLIENT, triton_server.http_url,
                               triton_server.grpc_url], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        # Both streams must be live (a first token each, no error) before the kill.
        first = json.loads(client.stdout.readline())
        assert first["grpc_error"] is None, first
        assert first["http_status"] == 200, first
        event = json.loads(first["http_first"].removeprefix("data:"))
        assert "error" not in event and "text_output" in event, first
        wait_for(lambda: server_stats(triton_server)["num_pending_requests"] == 2, 10,
                 "both of the client's streams to be pending")
        client.kill()
        client.wait(10)
        started = time.monotonic()
        wait_for(lambda: server_stats(triton_server)["num_pending_requests"] == 0, 10,
                 "the killed client's requests to be cancelled")
        assert time.monotonic() - started < 5
        stats = server_stats(triton_server)
        assert stats["kv_tokens_in_use_by_requests"] == 0 and stats["num_waiting"] == 0
        assert stats["integrity_ok"] is True
    finally:
        client.kill()
