"""The engine behind tritonserver, driven over gRPC streaming: same workloads as in-process.

    python benchmarks/gpu/bench_triton.py --model /tmp/shapes/llama-1b --out results.jsonl \
        --server-python /tmp/v/bin/python3 [--modes offline,online] [--budget-s 240]
    python benchmarks/gpu/bench_triton.py --model /tmp/shapes/default --device cpu --quick

Starts tritonserver through ``python -m backend.launcher`` (what ``radixlm-serve`` runs:
it assembles build/triton_backends/{python,radixlm} from the nvidia-pytriton pieces that
``pytriton`` resolves to in the server Python's environment) on a temporary model
repository whose ``llm/config.pbtxt`` is the repo's with: KIND_GPU (KIND_CPU on cpu),
device/dtype, ``load_format: dummy``, ``model_path`` = the shape folder, the KV pool sized
from free memory, and the engine flags of bench_engine's default configuration.

Client: tritonclient.grpc.aio, one bidirectional stream per request (``stream_infer``),
``input_ids`` INT64 (no tokenization) and the sampling settings as request parameters
(``stream``, ``max_tokens``, ``temperature``, ``ignore_eos``: no BYTES input tensor), only
the outputs the metrics need. Requests are spread over --client-procs processes so that
the client is not the bottleneck; all share one start time (wall clock). Each process
opens its channel (one health RPC) before that time, as a serving client keeps its
connection: the connect is recorded (``client_connect_ms``), not counted in TTFT. TTFT is
the time from a request's scheduled arrival to the first response carrying output ids.
The server traces every request (``RADIXLM_TRACE_REQUESTS``): offline rows split the
first token's time into ``ttft_parts_ms`` (client send -> stub intake -> the engine
process has the request -> its first output leaves the engine process -> routed by the
stub -> sent -> received by the client) and count the responses per request.
The server is stopped at the end (SIGTERM to its process group, then SIGKILL).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402
# The server, the clients and the modes live in triton_*.py (files of about 300 lines); the
# names below stay importable from here, where tools/, bench_openai_overhead.py and the
# tests look for them.
from triton_client import (INPUT_IDS_DATATYPE, NOT_FINISHED,  # noqa: E402,F401
                           input_ids_array, run_requests, tally_response)
from triton_modes import (engine_loop_per_step, mode_offline, mode_online,  # noqa: E402,F401
                          timeline_parts, warmup)
from triton_server import MODEL, Server, engine_fields, free_ports, make_repository  # noqa: E402,F401


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(ap)
    ap.add_argument("--modes", default="offline,online")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--server-python", default=os.environ.get("RADIXLM_SERVER_PYTHON", sys.executable),
                    help="Python whose environment has numpy<2, pytriton's server pieces and "
                         "backend.core (default: $RADIXLM_SERVER_PYTHON or this Python)")
    ap.add_argument("--server-timeout-s", type=float, default=420.0)
    ap.add_argument("--server-log", default=None, help="keep the server log here")
    ap.add_argument("--server-pidfile", default=None,
                    help="write the server's process group id here while it runs")
    ap.add_argument("--client-procs", type=int, default=8)
    ap.add_argument("--instances", type=int, default=1,
                    help="Triton instances of the model (stubs in front of one engine process)")
    ap.add_argument("--server-profile-dir", default=None,
                    help="profile the server's engine loop thread (cProfile text) into this folder")
    ap.add_argument("--config-name", default=None,
                    help="label of the configuration (default: default, or instances-N)")
    ap.add_argument("--engine-param", action="append", default=[],
                    help="extra config.pbtxt engine parameter KEY=VALUE (repeatable)")
    args = ap.parse_args(argv)
    budget = C.Budget(args.budget_s)
    # `timeout` sends SIGTERM: unwind through `finally` so that the server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    label = args.name or C.model_label(args.model)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if args.quick:
        args.client_procs = min(args.client_procs, 2)
    extra = dict(kv.split("=", 1) for kv in args.engine_param)
    rec = C.Recorder(args.out, "triton", label,
                     args.config_name or ("default" if args.instances == 1
                                          else f"instances-{args.instances}"),
                     {"radix_cache": True, "overlap": True, "cuda_graph": True, "stream": True,
                      "client_procs": args.client_procs, "instances": args.instances},
                     C.load_done(args.done),
                     extra={"quick": args.quick, "device": args.device})
    log(f"bench_triton: model={label} device={device} budget={args.budget_s}s "
        f"server python={args.server_python}")
    tmp = Path(tempfile.mkdtemp(prefix="radixlm-triton-"))
    log_path = Path(args.server_log) if args.server_log else tmp / "server.log"
    server = None
    started = False
    try:
        repo = make_repository(tmp / "repo", args.model, device, dtype, extra, args.instances)
        server = Server(args.server_python, repo, log_path, args.server_profile_dir)
        if args.server_pidfile:
            Path(args.server_pidfile).write_text(str(server.proc.pid))
        ready_s = server.wait_ready(min(args.server_timeout_s, max(budget.left() - 10.0, 30.0)))
        log(f"server ready in {ready_s:.1f}s")
        warm_s = warmup(server, args)
        rec.write("startup", "triton", {"ready_s": round(ready_s, 2), "warmup_s": round(warm_s, 2),
                                        "config_pbtxt": (repo / MODEL / "config.pbtxt").read_text()[-900:]})
        started = True
        modes = args.modes.split(",")
        if "offline" in modes:
            mode_offline(server, rec, args, budget)
        if "online" in modes:
            mode_online(server, rec, args, budget, label)
        st = server.stats()
        if st:
            log(f"server loop: {st.get('loop')}; engine steps {st.get('steps')}, "
                f"schedule {st.get('schedule_seconds')} s")
        rec.write("server_stats", "end", st, status="ok" if st and st.get("integrity_ok") else "error",
                  error=None if st and st.get("integrity_ok") else str(st)[:500])
    except Exception as exc:  # noqa: BLE001
        tail = server.tail() if server else ""
        rec.write("run" if started else "startup", "triton", status="error",
                  error=C.error_text(exc) + "\n--- server log tail ---\n" + tail[-4000:])
        return 1
    finally:
        if server is not None:
            server.stop()
            log("server stopped")
            if args.server_pidfile:
                Path(args.server_pidfile).unlink(missing_ok=True)
        if not args.server_log:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"bench_triton done in {budget.elapsed():.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
