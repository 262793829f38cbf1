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
import ast
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402

MODEL = "llm"
# The wire type of the prompt's token ids: the llm model declares input_ids TYPE_INT64
# (backend/wire.py), and Triton rejects a request of any other type before the model
# sees it; tests/test_bench_triton_wire.py checks the two agree.
INPUT_IDS_DATATYPE = "INT64"


def input_ids_array(prompt: list[int]):
    """The prompt as the ``input_ids`` tensor's data (numpy of INPUT_IDS_DATATYPE)."""
    import numpy as np

    return np.asarray(prompt, dtype=np.int64)


# What a streamed response says (backend/wire_outputs.py): finish_reason is the string
# "None" while the request runs, and num_output_tokens and output_ids count this
# response's tokens only. The final response is the one with a real finish reason.
NOT_FINISHED = "None"


def tally_response(rec: dict, as_numpy, t: float) -> bool:
    """Add one response (``as_numpy(name)`` reads a tensor) received at ``t`` to the
    request's record; True when it was the request's last."""
    ids = as_numpy("output_ids")
    k = 0 if ids is None else int(ids.size)
    if k:
        rec["n_out"] += k
        if rec["first"] is None:
            rec["first"] = t
    cached = as_numpy("num_cached_tokens")
    if cached is not None and cached.size:
        rec["cached"] = int(cached.reshape(-1)[0])
    fr = as_numpy("finish_reason")
    reason = fr.reshape(-1)[0] if fr is not None and fr.size else b""
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    if not reason or reason == NOT_FINISHED:
        return False
    rec["end"] = t
    rec["finish_reason"] = reason
    return True


# ----------------------------------------------------------------------------- server
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


# ----------------------------------------------------------------------------- client
def _client_worker(url, items, t0, n_out, timeout_s, id_prefix):
    """One process: run its requests (index, arrival, prompt) over one aio channel."""
    return asyncio.run(_client_async(url, items, t0, n_out, timeout_s, id_prefix))


async def _client_async(url, items, t0, n_out, timeout_s, id_prefix):
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    started = time.time()
    await client.is_server_live()  # the channel connects on its first call
    connect_ms = (time.time() - started) * 1e3
    wanted = [grpcclient.InferRequestedOutput(n) for n in
              ("output_ids", "finish_reason", "num_cached_tokens")]

    async def one(idx, arrival, prompt):
        rec = {"idx": idx, "arrival": arrival, "first": None, "end": None, "n_out": 0,
               "n_in": len(prompt), "cached": 0, "origin": t0, "connect_ms": connect_ms}
        delay = t0 + arrival - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        inp = grpcclient.InferInput("input_ids", [len(prompt)], INPUT_IDS_DATATYPE)
        inp.set_data_from_numpy(input_ids_array(prompt))
        params = {"stream": True, "max_tokens": int(n_out), "temperature": 0.0,
                  "ignore_eos": True, "exclude_input_in_output": True}

        async def requests():
            yield {"model_name": MODEL, "inputs": [inp], "outputs": wanted,
                   "request_id": f"{id_prefix}{idx}", "parameters": params}

        call = None
        try:
            rec["sent"] = time.time() - t0  # how late the client itself was
            call = client.stream_infer(requests(), stream_timeout=timeout_s)
            async for result, error in call:
                t = time.time() - t0
                if error is not None:
                    rec["error"] = str(error)[:300]
                    break
                if tally_response(rec, result.as_numpy, t):
                    break
            if rec["end"] is None and "error" not in rec:
                rec["error"] = "stream ended without a final response"
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if call is not None:
                try:
                    call.cancel()
                except Exception:  # noqa: BLE001
                    pass
        return rec

    try:
        return await asyncio.gather(*(one(i, a, p) for i, a, p in items))
    finally:
        await client.close()


def run_requests(url, arrivals, prompts, n_out, procs, timeout_s, id_prefix=""):
    """Spread requests round-robin over client processes sharing one start time. Request
    ids are ``id_prefix`` + index (a prefix per run keeps timelines of one run, which a
    stub may report in a later run's stats with several instances, from joining another)."""
    import tritonclient.grpc.aio  # noqa: F401 - imported once here, not in every forked worker
    items = [(i, a, p) for i, (a, p) in enumerate(zip(arrivals, prompts))]
    procs = max(1, min(procs, len(items)))
    shares = [items[k::procs] for k in range(procs)]
    t0 = time.time() + 0.3 + 0.05 * procs  # let the workers start
    with ProcessPoolExecutor(max_workers=procs, mp_context=get_context("fork")) as pool:
        futs = [pool.submit(_client_worker, url, s, t0, n_out, timeout_s, id_prefix)
                for s in shares]
        out = []
        for f in futs:
            out += f.result()
    out.sort(key=lambda r: r["idx"])
    for r in out:
        r.pop("idx", None)
    return out


# ----------------------------------------------------------------------------- modes
def warmup(server, args):
    shapes = [(1, 8, 4), (4, 8, 4)] if args.quick else [(1, 32, 8), (32, 32, 8), (128, 32, 8), (64, 256, 8)]
    t = time.perf_counter()
    for b, n_in, n_out in shapes:
        run_requests(server.grpc_url, [0.0] * b, C.random_prompts(b, n_in, C.hash_seed("warm", b, n_in)),
                     n_out, args.client_procs, 120)
    server.stats()  # drains the warm-up's request timelines
    return time.perf_counter() - t


# a request's first token, client send to client receive, in consecutive parts
TTFT_PARTS = (("client_to_intake", "sent", "intake"), ("to_engine", "intake", "received"),
              ("engine", "received", "made"),
              ("to_stub", "made", "routed"), ("stub_send", "routed", "first_sent"),
              ("to_client", "first_sent", "first"))


def timeline_parts(reqs: list[dict], traces: list[dict], id_prefix: str = "") -> dict:
    """Join client records (request id = id_prefix + index) with the server's timelines
    (with several instances, those of the stub that answered the stats): percentiles
    (``common.pcts``) of each part of the time to first token, of the final response's way to the client,
    and of the responses per request. Empty when no request has a complete timeline."""
    by_id = {t.get("id"): t for t in traces}
    parts: dict[str, list[float]] = {name: [] for name, _, _ in TTFT_PARTS}
    tail, responses = [], []
    for i, r in enumerate(reqs):
        t = by_id.get(f"{id_prefix}{i}")
        if t is None or r.get("first") is None or r.get("end") is None:
            continue
        when = dict(t, sent=r["origin"] + r["sent"], first=r["origin"] + r["first"])
        if not all(isinstance(when.get(k), float) for _, a, b in TTFT_PARTS for k in (a, b)):
            continue
        for name, a, b in TTFT_PARTS:
            parts[name].append((when[b] - when[a]) * 1e3)
        if isinstance(t.get("final_sent"), float):
            tail.append((r["origin"] + r["end"] - t["final_sent"]) * 1e3)
        responses.append(float(t.get("responses", 0)))
    if not responses:
        return {}
    out = {"ttft_parts_ms": {name: C.pcts(v) for name, v in parts.items()},
           "responses_per_request": C.pcts(responses)}
    if tail:
        out["final_to_client_ms"] = C.pcts(tail)
    return out


def engine_loop_per_step(before: dict, after: dict) -> dict:
    """The engine process's loop between two stats answers: ms per step in ``step()`` and
    in sending its outputs, and the steps (empty without the engine process's timings)."""
    a, b = before.get("engine_loop") or {}, after.get("engine_loop") or {}
    steps = b.get("steps", 0) - a.get("steps", 0)
    if steps <= 0:
        return {}
    return {"steps": steps,
            "step_ms": round(1e3 * (b["step_s"] - a["step_s"]) / steps, 4),
            "send_ms": round(1e3 * (b["send_s"] - a["send_s"]) / steps, 4)}


def mode_offline(server, rec, args, budget):
    rows = C.QUICK_OFFLINE_ROWS if args.quick else C.OFFLINE_ROWS
    for b, n_in, n_out in rows:
        name = C.offline_name(b, n_in, n_out)
        if rec.is_done("offline", name):
            continue
        if not budget.allows(10.0):
            rec.write("offline", name, status="skipped", error="time budget")
            continue
        try:
            runs = []
            before = server.stats() or {}
            for rep in range(max(1, args.reps)):
                prompts = C.offline_prompts(name, b, n_in, rep)
                t = time.perf_counter()
                run_id = f"{name}-{rep}-"
                reqs = run_requests(server.grpc_url, [0.0] * b, prompts, n_out, args.client_procs,
                                    max(60.0, budget.left()), run_id)
                wall = time.perf_counter() - t
                runs.append(C.summarize(reqs))
                lags = sorted((r["sent"] - r["arrival"]) * 1e3 for r in reqs if "sent" in r)
                if lags:
                    runs[-1]["client_send_lag_ms"] = {"p50": round(lags[len(lags) // 2], 3),
                                                      "max": round(lags[-1], 3)}
                connects = C.pcts([r["connect_ms"] for r in reqs if "connect_ms" in r])
                if connects:
                    runs[-1]["client_connect_ms"] = connects
                after = server.stats() or {}
                runs[-1].update(timeline_parts(reqs, after.get("trace") or [], run_id))
                per_step = engine_loop_per_step(before, after)
                if per_step:
                    runs[-1]["engine_loop_ms_per_step"] = per_step
                before = after
                if wall > 6.0 or not budget.allows(wall * 2 + 10.0):
                    break
            runs.sort(key=lambda m: m["output_tok_per_s"] or 0)
            m = dict(runs[len(runs) // 2])
            m["reps_output_tok_per_s"] = [r["output_tok_per_s"] for r in runs]
            m["reps_engine_step_ms"] = [r.get("engine_loop_ms_per_step", {}).get("step_ms")
                                        for r in runs]
            m.update(batch=b, n_in=n_in, n_out=n_out, client_procs=args.client_procs)
            rec.write("offline", name, m, status="ok" if m["n_completed"] == b else "truncated")
            if m.get("ttft_parts_ms"):
                log("  ttft parts p50 (ms): " + ", ".join(
                    f"{k}={v['p50']}" for k, v in m["ttft_parts_ms"].items())
                    + f"; responses/request p50={m['responses_per_request']['p50']}")
        except Exception as exc:  # noqa: BLE001
            rec.write("offline", name, status="error", error=C.error_text(exc))


def mode_online(server, rec, args, budget, label):
    for shape, rate, n_in, n_out, n, arrivals, prompts in C.online_items(rec, args, budget, label, 10.0):
        need = arrivals[-1] + 3.0
        try:
            timeout = min(arrivals[-1] * 3 + 30.0, max(budget.left() - 5.0, need + 5.0))
            t = time.perf_counter()
            reqs = run_requests(server.grpc_url, arrivals, prompts, n_out, args.client_procs, timeout)
            m = C.summarize(reqs)
            m.update(n_in=n_in, n_out=n_out, offered_rate=rate, client_procs=args.client_procs,
                     arrival_window_s=round(arrivals[-1], 3), wall_s=round(time.perf_counter() - t, 3))
            rec.write("online", shape, m, rate=rate,
                      status="ok" if m["n_completed"] == n else "truncated")
        except Exception as exc:  # noqa: BLE001
            rec.write("online", shape, rate=rate, status="error", error=C.error_text(exc))



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
