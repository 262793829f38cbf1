"""The stub's own Python cost per request taken in and per response sent, without Triton.

    python tools/bench_stub_io.py [--requests 128] [--repeat 20] [--profile]

Triton hands the stub one request per ``execute`` call and each response leaves through
a sender thread, so over a burst of N requests both costs add up serially. This runs the
real code paths (``TritonPythonModel.execute`` with ``wire.RequestParser`` and
``EngineLoop.submit`` in front of an ``EngineProcess``'s submission queue, then the
writer's encoding of the queued messages; ``Router.deliver_delta`` building each
request's streamed response and ``TritonResponseSink.send``) over stand-ins for
``triton_python_backend_utils`` whose calls cost nothing. What it prints is therefore
our code's share only: on the server the stub's C++ calls (a request's tensors, a
response's shared-memory blocks, the send's round trip) come on top. The requests are
bench_triton.py's: 32 ``input_ids``, ``stream``, ``max_tokens``, ``temperature``,
``ignore_eos``, ``exclude_input_in_output`` as parameters, asking for ``output_ids``,
``finish_reason`` and ``num_cached_tokens``. ``--profile``: cProfile of both, by own time.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _fake_pb_utils() -> types.ModuleType:
    """The parts of ``triton_python_backend_utils`` the stub code calls, doing nothing."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        __slots__ = ("_name", "_array")

        def __init__(self, name, array):
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    class TritonError:
        CANCELLED, INVALID_ARG = 1, 2

        def __init__(self, message, code=2):
            self.message, self.code = message, code

    pb.Tensor, pb.InferenceResponse, pb.TritonError = Tensor, InferenceResponse, TritonError
    pb.TritonModelException = RuntimeError
    pb.Logger = types.SimpleNamespace(log_info=print, log_warn=print, log_error=print)
    return pb


class FakeSender:
    __slots__ = ("sent",)

    def __init__(self):
        self.sent = 0

    def send(self, response, flags=0):
        self.sent += 1


class FakeRequest:
    """What bench_triton.py's client sends, as the stub sees it."""

    def __init__(self, pb, idx: int, prompt_len: int, max_tokens: int):
        ids = np.arange(100 + idx, 100 + idx + prompt_len, dtype=np.int64)
        self._inputs = [pb.Tensor("input_ids", ids)]
        self._parameters = json.dumps({"stream": True, "max_tokens": max_tokens,
                                       "temperature": 0.0, "ignore_eos": True,
                                       "exclude_input_in_output": True})
        self._id = f"bench-{idx}"
        self._sender = FakeSender()

    def inputs(self):
        return list(self._inputs)

    def parameters(self):
        return self._parameters

    def request_id(self):
        return self._id

    def timeout(self):
        return 0

    def get_response_sender(self):
        return self._sender

    def requested_output_names(self):
        return ["output_ids", "finish_reason", "num_cached_tokens"]

    def is_cancelled(self):
        return False


def _engine_process_queue():
    """An ``EngineProcess`` whose writer never runs: submissions stay in its queue."""
    from backend.engine_process import EngineProcess

    engine = EngineProcess.__new__(EngineProcess)
    engine._dead = None
    engine._outq = collections.deque()
    engine._out_ready = threading.Event()
    return engine


def _model(engine):
    from backend import wire
    from backend.diagnostics import IpcCounts
    from backend.model import TritonPythonModel
    from backend.serving import EngineLoop
    from backend.core.limits import RequestLimits

    model = TritonPythonModel.__new__(TritonPythonModel)
    model.ipc = IpcCounts()
    model.parser = wire.RequestParser(RequestLimits())
    model.request_timeout_s = 0.0
    model.logger = sys.modules["triton_python_backend_utils"].Logger
    model.loop = EngineLoop(engine, ipc_counts=model.ipc)  # its threads never start
    return model


def intake(model, requests) -> tuple[float, float]:
    """Seconds to take in every request (one execute call each, as Triton calls it), and
    to encode what they queued as the writer thread would (one frame; it holds the GIL)."""
    from backend import engine_protocol as proto

    started = time.perf_counter()
    for request in requests:
        model.execute([request])
    executed = time.perf_counter()
    queued = model.loop.engine._outq
    proto.encode(list(queued))
    encoded = time.perf_counter()
    queued.clear()
    return executed - started, encoded - executed


def responses(model, tokens_per_request: int = 1) -> tuple[float, int]:
    """Seconds to build and send one streamed response per pending request (their first
    token: what stub_send times), and how many were sent."""
    from backend.core.outputs import StepOutput
    from backend.outbox import Delta

    pending = model.loop._pending.items()
    deltas = []
    for rid, tracked in pending:
        out = StepOutput(request_id=rid, new_token_ids=list(range(7, 7 + tokens_per_request)),
                         new_text="", num_prompt_tokens=32, num_cached_tokens=0,
                         context_token_ids=[5, 6])
        deltas.append(Delta(tracked, out, False))
    deliver = model.loop._router.deliver_delta
    started = time.perf_counter()
    for delta in deltas:
        deliver(delta)
    return time.perf_counter() - started, len(deltas)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=50, help="rounds of --requests")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    pb = sys.modules.setdefault("triton_python_backend_utils", _fake_pb_utils())

    execute_us, encode_us, send_us = [], [], []
    profiler = cProfile.Profile() if args.profile else None
    for rep in range(args.repeat + 1):
        model = _model(_engine_process_queue())
        requests = [FakeRequest(pb, i, args.prompt_len, 128) for i in range(args.requests)]
        if profiler is not None and rep:
            profiler.enable()
        executed, encoded = intake(model, requests)
        sent_s, sent = responses(model)
        if profiler is not None:
            profiler.disable()
        if rep:  # the first round warms caches and imports
            execute_us.append(executed / args.requests * 1e6)
            encode_us.append(encoded / args.requests * 1e6)
            send_us.append(sent_s / sent * 1e6)
    # the least of the rounds: the machine's other work only ever adds to a round
    print(json.dumps({"requests": args.requests, "rounds": args.repeat,
                      "execute_us_per_request": round(min(execute_us), 2),
                      "encode_us_per_request": round(min(encode_us), 2),
                      "send_us_per_response": round(min(send_us), 2),
                      "median_execute_us": round(float(np.median(execute_us)), 2),
                      "median_send_us": round(float(np.median(send_us)), 2)}))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
