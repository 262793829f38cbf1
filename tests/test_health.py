"""Health: when the engine loop thread dies, pending and later requests fail with the
reason, the model says it is not ready, and (served) tritonserver shuts down so that its
readiness fails and the process exits for the orchestrator to restart it. Also the
metrics hooks of the loop; and a SIGTERM to tritonserver alone (the Kubernetes case) with
a stream in flight. SIGTERM to the process group: test_server_contract.py."""
from __future__ import annotations

import json
import queue
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend import wire
from backend.serving import EngineLoop
from conftest import ADMIN_PARAMETERS, SERVED_MODEL, _stop, start_server, tritonserver_pid
from loop_helpers import RecordingSink, ScriptedEngine, generate


def started(engine=None, **kwargs) -> EngineLoop:
    loop = EngineLoop(engine or ScriptedEngine(), idle_wait_s=0.005, cancel_poll_s=0.0,
                      **kwargs)
    loop.start()
    return loop


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


# ---- the loop thread dying ---------------------------------------------------------------

def test_a_dead_loop_fails_pending_requests_refuses_new_ones_and_says_why_once():
    deaths = []
    loop = started(on_death=deaths.append)
    pending, stats = RecordingSink(), RecordingSink()
    loop.submit(generate(max_new_tokens=100_000), pending)
    wait_until(lambda: len(pending.responses) >= 2)
    loop.inject_fault("boom")
    assert pending.closed.wait(5)
    assert pending.errors == [("the engine loop died (RuntimeError: boom)", False)]
    wait_until(lambda: deaths)
    assert deaths == ["RuntimeError: boom"] and loop.failure == "RuntimeError: boom"
    late = RecordingSink()
    loop.submit(generate(), late)
    loop.submit(wire.StatsJob(), stats)
    assert late.errors == stats.errors == [
        ("the engine is not running (RuntimeError: boom); the model is unavailable", False)]
    started_stop = time.monotonic()
    loop.stop(timeout_s=5)
    assert time.monotonic() - started_stop < 1 and deaths == ["RuntimeError: boom"]


def test_an_exception_outside_a_step_kills_the_loop_but_a_failing_step_does_not():
    class FlakyEngine(ScriptedEngine):
        broken = False

        def next_outputs(self, timeout_s):
            if self.broken:  # not a step's error: the handle itself failed
                raise ValueError("scheduler state corrupt")
            return super().next_outputs(timeout_s)

    engine = FlakyEngine()
    deaths = []
    loop = started(engine, on_death=deaths.append)
    try:
        first = RecordingSink()
        engine.fail_next_step = True
        loop.submit(generate(max_new_tokens=3), first)
        assert first.closed.wait(5) and first.errors == [("engine error: kernel exploded", False)]
        assert loop.failure is None and not deaths  # a step error fails its batch only
        engine.broken = True
        wait_until(lambda: deaths)
        assert deaths == ["ValueError: scheduler state corrupt"]
    finally:
        loop.stop(timeout_s=5)


# ---- metrics hooks ----------------------------------------------------------------------

class RecordingMetrics:
    def __init__(self) -> None:
        self.finished = []
        self.samples = 0
        self.lock = threading.Lock()

    def observe_outputs(self, outputs, made_at=None):
        with self.lock:
            self.finished += [o for o in outputs if o.finished]

    def observe_request(self, n):
        pass

    def sample(self, engine):
        engine.stats()
        self.samples += 1

    def before_final(self):
        pass


def test_the_loop_hands_finished_outputs_and_stats_samples_to_the_metrics():
    metrics = RecordingMetrics()
    loop = started(metrics=metrics)
    try:
        sinks = [RecordingSink() for _ in range(3)]
        for i, sink in enumerate(sinks):
            loop.submit(generate(max_new_tokens=i + 1), sink)
        assert all(s.closed.wait(5) for s in sinks)
        wait_until(lambda: len(metrics.finished) == 3)
        assert sorted(o.num_output_tokens for o in metrics.finished) == [1, 2, 3]
        assert {o.finish_reason for o in metrics.finished} == {"length"}
        samples = metrics.samples
        wait_until(lambda: metrics.samples > samples)  # sampled while idle, too
    finally:
        loop.stop(timeout_s=5)


def test_a_failing_metrics_recorder_does_not_disturb_serving():
    class Broken:
        def observe_outputs(self, outputs, made_at=None):
            raise RuntimeError("IPC failed")

        def observe_request(self, n):
            raise RuntimeError("IPC failed")

        def sample(self, engine):
            raise RuntimeError("IPC failed")

        def before_final(self):
            raise RuntimeError("IPC failed")

    loop = started(metrics=Broken())
    try:
        sink = RecordingSink()
        loop.submit(generate(max_new_tokens=4), sink)
        assert sink.closed.wait(5) and not sink.errors
        assert "".join(sink.texts()) == "1 2 3 4 " and loop.failure is None
    finally:
        loop.stop(timeout_s=5)


# ---- served --------------------------------------------------------------------------------

def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _start_long_stream(client) -> queue.Queue:
    """A greedy stream of up to 3000 tokens that is still running when the test acts;
    its responses and errors arrive on the returned queue."""
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result=None, error=None: events.put((result, error)))

    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    params = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}
    client.async_stream_infer(SERVED_MODEL, [
        tensor("text_input", np.array([b"Tell me a long story."], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps(params).encode()],
                                               dtype=np.object_), "BYTES"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
        tensor("return_num_output_tokens", np.array([True]), "BOOL")],
        request_id="in-flight")
    return events


@pytest.mark.server
@pytest.mark.slow
def test_when_the_engine_loop_dies_the_server_stops_being_ready_and_exits(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("RADIXLM_FAULT_INJECTION", "1")
    server = start_server(tmp_path / "server.log",
                          ("--model-control-mode=explicit", f"--load-model={SERVED_MODEL}"))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        events = _start_long_stream(client)
        assert events.get(timeout=60)[1] is None  # streaming
        ready = f"http://{server.http_url}/v2/health/ready"
        assert _ready(ready)
        fault = urllib.request.Request(
            f"http://{server.http_url}/v2/models/{SERVED_MODEL}/generate",
            data=json.dumps({"text_input": "x", "parameters": {"debug": "fail_engine_loop",
                                                               **ADMIN_PARAMETERS}}).encode())
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(fault, timeout=30)
        assert "fault injected" in answer.value.read().decode()
        died = time.monotonic()
        while True:  # the in-flight stream ends with the reason
            result, error = events.get(timeout=30)
            if error is not None:
                break
        assert "the engine loop died (RuntimeError: fault injected by a debug request)" \
            in str(error)
        client.stop_stream(cancel_requests=True)  # its request has ended: close without waiting
        wait_until(lambda: not _ready(ready), timeout_s=10)
        server.process.wait(timeout=30)
        assert time.monotonic() - died < 30
        log = server.log_path.read_text()
        assert "radixlm: the engine loop died: RuntimeError" in log
        assert ("radixlm-serve: the stub of llm (llm_0_0, pid " in log and "asks to stop the "
                "server: the engine is not running (RuntimeError: fault injected" in log)
        assert server.process.returncode == 1  # a failure stopped it: the orchestrator sees it
        # Triton unloads the model, or, when that outlasts the stop's bound on a loaded
        # machine, the supervisor ends it and says so: either way the stop is bounded
        assert (f"successfully unloaded '{SERVED_MODEL}'" in log
                or "s after the stop began" in log), log[-2000:]
    finally:
        client.close()
        _stop(server.process)


@pytest.mark.server
@pytest.mark.slow
def test_sigterm_to_tritonserver_alone_ends_in_flight_streams_and_exits(tmp_path):
    """A SIGTERM to tritonserver alone (not its process group, not radixlm-serve): its
    Python stubs get nothing. The backend notices the shutdown all the same (Triton's HTTP
    endpoint closes), ends the stream with a final "abort" response, and the server exits;
    radixlm-serve notices too (the same endpoint) and bounds the exit."""
    import os
    import signal

    server = start_server(tmp_path / "server.log",
                          ("--model-control-mode=explicit", f"--load-model={SERVED_MODEL}"))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        events = _start_long_stream(client)
        assert events.get(timeout=60)[1] is None
        signalled = time.monotonic()
        os.kill(tritonserver_pid(server), signal.SIGTERM)  # not its group, not radixlm-serve
        generated = 0
        while True:
            result, error = events.get(timeout=10)
            assert error is None, error
            generated += int(result.as_numpy("num_output_tokens")[0])  # this response's
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                break
        assert result.as_numpy("finish_reason")[0] == b"abort"
        assert generated < 3000
        assert time.monotonic() - signalled < 5
        # an open stream keeps Triton from unloading the model; the request has its final
        # response, so close at once (waiting for the RPC to end can outlive the server)
        client.stop_stream(cancel_requests=True)
        server.process.wait(timeout=30)
        log = server.log_path.read_text()
        assert "radixlm-serve: tritonserver is stopping; stopping tritonserver" in log
        assert "radixlm: engine loop stopped" in log
        assert f"successfully unloaded '{SERVED_MODEL}'" in log
        port = server.http_url.rsplit(":", 1)[1]  # read from tritonserver's own flags
        assert (f"server shutdown is read from http://127.0.0.1:{port}/v2/models/{SERVED_MODEL}"
                "/versions/1/ready") in log
    finally:
        client.close()
        _stop(server.process)
