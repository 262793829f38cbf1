"""bench_triton's warm-up and modes: the offline rows (with the time to first token split
along the request timelines the server traces) and the online Poisson rows."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402
from triton_client import run_requests  # noqa: E402


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
