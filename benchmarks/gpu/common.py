"""Shared pieces of the GPU benchmark suite: workloads, arrivals, metrics, JSON-lines output.

Every benchmark script appends one JSON object per measured item (a line) to a results
file. A line names the item by ``key`` = system / model / config / mode / workload / rate,
so a rerun can skip what is already measured (``--done``) and ``report.py`` keeps the
latest line per key. No torch import here: the gRPC client process does not need it.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (str(REPO), str(REPO / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

T_START = time.monotonic()

# ----------------------------------------------------------------------------- workloads
# (batch, input tokens, output tokens): the rows of the speed-anchor table
OFFLINE_ROWS = [(1, 32, 128), (32, 32, 128), (128, 32, 128), (32, 256, 32)]
QUICK_OFFLINE_ROWS = [(1, 8, 8), (4, 8, 8), (8, 8, 8), (4, 32, 4)]
# online request streams (the DJL table's two shapes)
ONLINE_SHAPES = {"in32_out128": (32, 128), "in256_out32": (256, 32)}
# request rates (req/s) per model shape, chosen to span light load to overload of the
# engine on an H200 (capacity ~ offline batch-128 tok/s / output length)
RATES = {
    "llama-1b": {"in32_out128": [4, 16, 64, 256, 1024], "in256_out32": [8, 32, 128, 512, 2048]},
    "llama-8b": {"in32_out128": [2, 8, 32, 128, 512], "in256_out32": [4, 16, 64, 256, 1024]},
    "default": {"in32_out128": [8, 64, 512], "in256_out32": [16, 128, 1024]},
}
QUICK_RATES = {"in32_out128": [2.0], "in256_out32": [4.0]}
QUICK_ONLINE_SHAPES = {"in32_out128": (8, 8), "in256_out32": (32, 4)}
VOCAB_HI = 32000  # prompts are random ids below this (every shape's vocab is larger: Phi-3's 32064)
VOCAB_LO = 100


def offline_name(batch: int, n_in: int, n_out: int) -> str:
    return f"b{batch}_in{n_in}_out{n_out}"


def random_prompts(n: int, length: int, seed: int, hi: int = VOCAB_HI) -> list[list[int]]:
    """Deterministic random token-id prompts (identical for every system)."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LO, hi) for _ in range(length)] for _ in range(n)]


def offline_rows(quick: bool) -> list[tuple[str, int, int, int]]:
    """The offline rows as (name, batch, input tokens, output tokens)."""
    return [(offline_name(*row), *row) for row in (QUICK_OFFLINE_ROWS if quick else OFFLINE_ROWS)]


def offline_prompts(name: str, batch: int, n_in: int, rep: int) -> list[list[int]]:
    """The prompts of measured run ``rep`` of an offline row: every system gets these
    (a fresh set per run, so no run finds the previous one's prompts cached)."""
    return random_prompts(batch, n_in, hash_seed("offline", name, rep))


def median_run(runs: list[dict]) -> dict:
    """The run of median output tok/s (the upper middle of an even count), with every
    run's tok/s under ``reps_output_tok_per_s`` (ascending)."""
    runs = sorted(runs, key=lambda m: m["output_tok_per_s"] or 0)
    m = dict(runs[len(runs) // 2])
    m["reps_output_tok_per_s"] = [r["output_tok_per_s"] for r in runs]
    return m


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of ``rate`` req/s; the first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def online_count(rate: float, window_s: float, max_n: int, min_n: int) -> int:
    """Requests for one rate: enough to fill ``window_s`` of arrivals, within bounds."""
    return int(max(min_n, min(max_n, math.ceil(rate * window_s))))


def online_schedule(shape: str, rate: float, n: int, n_in: int) -> tuple[list[float], list[list[int]]]:
    seed = hash_seed(shape, rate)
    return poisson_arrivals(n, rate, seed), random_prompts(n, n_in, seed + 1)


def error_text(exc: BaseException, tail_lines: int = 8) -> str:
    """An exception for a results line: type, message and the end of the traceback."""
    return f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc().splitlines(True)[-tail_lines:])


def online_items(rec, args, budget, label: str, reserve_s: float, shapes_wanted=None):
    """The online (shape, rate) items still to measure, as (shape, rate, n_in, n_out, n,
    arrivals, prompts); one that would not fit the budget is recorded as skipped."""
    shapes = QUICK_ONLINE_SHAPES if args.quick else ONLINE_SHAPES
    for shape, (n_in, n_out) in shapes.items():
        if shapes_wanted is not None and shape not in shapes_wanted:
            continue
        rates = QUICK_RATES[shape] if args.quick else RATES.get(label, RATES["llama-8b"])[shape]
        for rate in rates:
            if args.online_rates and rate not in args.online_rates:
                continue
            if rec.is_done("online", shape, rate):
                continue
            n = online_count(rate, args.online_window_s, args.online_max_requests,
                             8 if args.quick else args.online_min_requests)
            arrivals, prompts = online_schedule(shape, rate, n, n_in)
            if not budget.allows(arrivals[-1] + 3.0 + reserve_s):
                rec.write("online", shape, rate=rate, status="skipped", error="time budget",
                          metrics={"n_requests": n})
                continue
            yield shape, rate, n_in, n_out, n, arrivals, prompts


def hash_seed(*parts) -> int:
    s = "|".join(str(p) for p in parts)
    h = 1469598103934665603
    for ch in s.encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 61)
    return h % (1 << 31)


# ----------------------------------------------------------------------------- metrics
def pcts(values: list[float], scale: float = 1.0) -> dict | None:
    """p50/p90/p99/mean/max of ``values`` (times ``scale``), or None when empty."""
    vals = sorted(v * scale for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None

    def q(p):  # linear interpolation, like numpy's default
        k = (len(vals) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)

    return {"p50": round(q(0.5), 3), "p90": round(q(0.9), 3), "p99": round(q(0.99), 3),
            "mean": round(sum(vals) / len(vals), 3), "max": round(vals[-1], 3), "n": len(vals)}


def summarize(reqs: list[dict], duration_s: float | None = None) -> dict:
    """Metrics of one run from per-request records.

    Each record: ``arrival`` (s), ``first`` (s, first output token seen), ``end`` (s),
    ``n_out`` (output tokens), ``n_in``; optional ``cached``, ``error``. Times share one
    origin. TPOT is (end - first) / (n_out - 1): the time per output token after the first.
    """
    done = [r for r in reqs if r.get("end") is not None and not r.get("error")]
    out_tokens = sum(r["n_out"] for r in done)
    if duration_s is None:
        if done:
            duration_s = max(r["end"] for r in done) - min(r["arrival"] for r in reqs)
        else:
            duration_s = float("nan")
    ttft = [r["first"] - r["arrival"] for r in done if r.get("first") is not None]
    tpot = [(r["end"] - r["first"]) / (r["n_out"] - 1) for r in done
            if r.get("first") is not None and r["n_out"] > 1]
    e2e = [r["end"] - r["arrival"] for r in done]
    prompt_tokens = sum(r.get("n_in", 0) for r in done)
    m = {
        "n_requests": len(reqs), "n_completed": len(done),
        "n_errors": sum(1 for r in reqs if r.get("error")),
        "duration_s": round(duration_s, 4),
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "output_tok_per_s": round(out_tokens / duration_s, 2) if duration_s and duration_s > 0 else None,
        "total_tok_per_s": round((out_tokens + prompt_tokens) / duration_s, 2)
        if duration_s and duration_s > 0 else None,
        "req_per_s": round(len(done) / duration_s, 3) if duration_s and duration_s > 0 else None,
        "ttft_ms": pcts(ttft, 1e3), "tpot_ms": pcts(tpot, 1e3), "e2e_ms": pcts(e2e, 1e3),
    }
    if any("cached" in r for r in done):
        m["cached_tokens"] = sum(r.get("cached", 0) for r in done)
    errors = [r["error"] for r in reqs if r.get("error")]
    if errors:
        m["first_error"] = str(errors[0])[:500]
    return m


# ----------------------------------------------------------------------------- budget
class Budget:
    """Wall-clock budget of one script; items ask before starting."""

    def __init__(self, seconds: float) -> None:
        self.total = seconds
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.total - self.elapsed()

    def allows(self, need_s: float) -> bool:
        return self.left() >= need_s


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- output
def git_rev() -> str | None:
    """The commit, with "-dirty" when tracked files differ from it (a device machine's
    copy of a working tree may carry an older commit than the code it runs)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              cwd=REPO, text=True, capture_output=True,
                              timeout=5).stdout.strip() or None
    except Exception:
        return None


def item_key(system: str, model: str, config: str, mode: str, workload: str, rate) -> str:
    r = "" if rate is None else (f"{rate:g}" if isinstance(rate, (int, float)) else str(rate))
    return "/".join([system, model, config, mode, workload, r])


def load_done(paths: list[str] | None) -> set[str]:
    """Keys measured with status ok in earlier results files (for resuming)."""
    done: set[str] = set()
    for p in paths or []:
        if not os.path.exists(p):
            continue
        with open(p) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("status") == "ok" and rec.get("key"):
                    done.add(rec["key"])
    return done


class Recorder:
    """Appends one JSON line per item (flushed at once: a killed run keeps its lines)."""

    def __init__(self, path: str, system: str, model: str, config: str,
                 flags: dict | None = None, done: set[str] | None = None,
                 extra: dict | None = None) -> None:
        self.path = path
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.system, self.model, self.config = system, model, config
        self.flags = flags or {}
        self.done = done or set()
        self.extra = extra or {}
        self.run_id = os.environ.get("BENCH_RUN_ID") or _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.base = {"host": socket.gethostname(), "git": git_rev(),
                     "phase": os.environ.get("BENCH_PHASE")}

    def key(self, mode: str, workload: str, rate=None) -> str:
        return item_key(self.system, self.model, self.config, mode, workload, rate)

    def is_done(self, mode: str, workload: str, rate=None) -> bool:
        return self.key(mode, workload, rate) in self.done

    def write(self, mode: str, workload: str, metrics: dict | None = None, *, rate=None,
              status: str = "ok", error: str | None = None, **fields) -> dict:
        rec = {
            "key": self.key(mode, workload, rate),
            "ts": _dt.datetime.now().isoformat(timespec="seconds"),
            "run_id": self.run_id, "system": self.system, "model": self.model,
            "config": self.config, "flags": self.flags, "mode": mode, "workload": workload,
            "rate": rate, "status": status, "error": error, "metrics": metrics or {},
            **self.base, **self.extra, **fields,
        }
        line = json.dumps(rec, default=_jsonable)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        brief = _brief(metrics or {})
        log(f"result {rec['key']} [{status}] {brief}{(' ' + error[:200]) if error else ''}")
        return rec


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _brief(m: dict) -> str:
    parts = []
    for k in ("output_tok_per_s", "n_completed", "cache_hit_rate", "hit_rate_vs_best",
              "hbm_fraction", "copy_bw_TBps", "valid_fraction", "step_ms"):
        if m.get(k) is not None:
            parts.append(f"{k}={m[k]}")
    for k in ("ttft_ms", "tpot_ms"):
        if isinstance(m.get(k), dict):
            parts.append(f"{k}.p50={m[k]['p50']}/p90={m[k]['p90']}")
    return " ".join(parts)


def model_label(model_dir: str) -> str:
    info = Path(model_dir) / "radixlm_shape.json"
    if info.exists():
        try:
            return json.loads(info.read_text())["shape"]
        except Exception:
            pass
    return Path(model_dir).name


def add_common_args(ap) -> None:
    ap.add_argument("--model", required=True, help="model folder (config.json + tokenizer)")
    ap.add_argument("--name", default=None, help="model label in results (default: shape name)")
    ap.add_argument("--out", default=os.environ.get("BENCH_RESULTS",
                                                    str(REPO / "benchmarks/gpu/results/local.jsonl")))
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="wall-clock budget: items that would not fit are recorded as skipped")
    ap.add_argument("--done", nargs="*", default=None,
                    help="results files whose ok items are skipped (resume)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU dry run)")
    ap.add_argument("--reps", type=int, default=3,
                    help="measured runs of each short offline/prefix row (the median is "
                         "reported); host-bound 1B rows vary by tens of percent per run")
    ap.add_argument("--online-window-s", type=float, default=10.0,
                    help="arrival window per rate: requests = rate x window (bounded)")
    ap.add_argument("--online-max-requests", type=int, default=300)
    ap.add_argument("--online-min-requests", type=int, default=24)
    ap.add_argument("--online-rates", type=lambda text: [float(r) for r in text.split(",") if r],
                    default=os.environ.get("BENCH_ONLINE_RATES") or None,
                    help="only these of the shape's rates (req/s, comma-separated; env "
                         "BENCH_ONLINE_RATES)")
