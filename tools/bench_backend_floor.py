"""What Triton's Python backend costs per request and per response on its own: the floor
under the stub's burst costs (the other half of tools/bench_stub_io.py's story).

    python tools/bench_backend_floor.py [--requests 128] [--reps 5] [--dynamic-batching] [--out F]

Serves a model that does nothing (``floor``: decoupled, one instance, like ``llm``)
through the real tritonserver (``backend.launcher``) and sends it bursts of
``--requests`` requests of 32 token ids over one gRPC stream. Its ``execute`` only notes
the time and keeps each request's response sender; once the whole burst is in, a thread
sends every request its one final response, noting the time before each send. So a
burst splits into:

- intake: first to last ``execute`` (Triton making each request and handing it to the
  stub, one ``execute`` a request without dynamic batching);
- sends: first to last send (each response's shared-memory tensors and its round trip
  to the server).

Prints milliseconds per burst and microseconds per request; ``--out`` writes them as
JSON. ``--dynamic-batching`` sets ``max_batch_size: 256`` with a dynamic batcher (the
requests then carry a batch dimension), to see whether handing ``execute`` several
requests at once changes the intake.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

from bench_triton import free_ports  # noqa: E402

MODEL_PY = '''
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.burst = int(config["parameters"]["burst"]["string_value"])
        self.batched = config["max_batch_size"] > 0  # responses then carry a batch dimension
        self.pending = []
        self.lock = threading.Lock()

    def execute(self, requests):
        now = time.time()
        with self.lock:
            self.pending += [(r.get_response_sender(), now, len(requests)) for r in requests]
            if len(self.pending) >= self.burst:
                burst, self.pending = self.pending, []
                threading.Thread(target=self.send_all, args=(burst,)).start()
        return None

    def send_all(self, burst):
        for sender, intake, batch in burst:
            row = np.array([intake, time.time(), batch], dtype=np.float64)
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("t", row[None] if self.batched else row)]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def write_repository(root: Path, burst: int, batched: bool) -> None:
    folder = root / "floor"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(MODEL_PY)
    batching = "max_batch_size: 256\ndynamic_batching { }" if batched else "max_batch_size: 0"
    (folder / "config.pbtxt").write_text(f'''name: "floor"
backend: "python"
{batching}
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "t" data_type: TYPE_FP64 dims: [ 3 ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
parameters: {{ key: "burst" value: {{ string_value: "{burst}" }} }}
''')


def wait_ready(http: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/floor/ready",
                                        timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("tritonserver not ready")


def bursts(url: str, requests: int, reps: int, batched: bool) -> list[dict]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    shape = [1, 32] if batched else [32]
    out = []
    try:
        for rep in range(reps + 1):  # the first burst warms up and is not kept
            inputs = []
            for _ in range(requests):
                tensor = grpcclient.InferInput("input_ids", shape, "INT32")
                tensor.set_data_from_numpy(np.arange(32, dtype=np.int32).reshape(shape))
                inputs.append(tensor)
            for i, tensor in enumerate(inputs):
                client.async_stream_infer("floor", [tensor], request_id=f"{rep}-{i}")
            rows = []
            for _ in range(requests):
                result, error = answers.get(timeout=120)
                if error is not None:
                    raise RuntimeError(str(error))
                rows.append(result.as_numpy("t").reshape(-1))
            intake = sorted(r[0] for r in rows)
            sends = sorted(r[1] for r in rows)
            if rep:
                out.append({"intake_ms": 1e3 * (intake[-1] - intake[0]),
                            "sends_ms": 1e3 * (sends[-1] - sends[0]),
                            "largest_execute": int(max(r[2] for r in rows))})
            time.sleep(0.2)
    finally:
        client.stop_stream()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dynamic-batching", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="radixlm-floor-"))
    write_repository(root, args.requests, args.dynamic_batching)
    http, grpc, metrics = free_ports(3)
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.launcher", f"--model-repository={root}",
         f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
         "--log-verbose=0"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        wait_ready(http, proc)
        runs = bursts(f"127.0.0.1:{grpc}", args.requests, args.reps, args.dynamic_batching)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    n = args.requests
    for key in ("intake_ms", "sends_ms"):
        values = sorted(run[key] for run in runs)
        median = values[len(values) // 2]
        print(f"{key[:-3]:7s} of {n}: median {median:7.2f} ms ({1e3 * median / n:6.1f} us a "
              f"request), runs {', '.join(f'{v:.1f}' for v in values)}")
    print(f"largest execute call: {max(run['largest_execute'] for run in runs)} requests")
    if args.out:
        args.out.write_text(json.dumps({"requests": n, "dynamic_batching": args.dynamic_batching,
                                        "cpus": os.cpu_count(), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
