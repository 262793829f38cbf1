"""Published runs: the small results files the benchmark report is made from.

    python benchmarks/gpu/publish.py benchmarks/gpu/results/RUN.jsonl [--name NAME]

The suite appends every measurement with all its detail to raw JSON-lines files (git-ignored,
``benchmarks/gpu/results/``). Publishing one run (one session of the suite on one machine
instance, whose host speed the host-bound rows depend on) keeps the latest line of each
item, and of its metrics only what the report shows, in
``docs/benchmarks/runs/<NAME>.json``; ``report.py`` reads those files. NAME defaults to the
date and time of the run's first line (``2026-12-02-0526``).
"""
from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS_DIR = REPO / "docs" / "benchmarks" / "runs"

# The fields of a result line the report reads, and of its metrics: a name mapped to None
# keeps the value, to a tuple keeps those keys of a dict value, to a dict applies itself to
# every value of a dict (the TTFT parts: the p50 of each).
# run_id: one run_all invocation (one device call, one machine instance); the report's
# ratios pair only lines of one run_id
RECORD_FIELDS = ("key", "ts", "run_id", "git", "system", "model", "config", "mode", "workload",
                 "rate", "status", "error")
PERCENTILES = ("p50", "p90", "p99")
SHOWN_METRICS = {
    # throughput and latency (offline, online, prefix, json)
    "output_tok_per_s": None, "req_per_s": None, "n_requests": None, "n_completed": None,
    "ttft_ms": PERCENTILES, "tpot_ms": PERCENTILES, "e2e_ms": PERCENTILES,
    "ttft_parts_ms": {"*": ("p50",)}, "responses_per_request": ("p50",),
    # shared prefixes
    "description": None, "cache_hit_rate": None, "best_hit_rate": None, "hit_rate_vs_best": None,
    # decode bandwidth and scheduler share (hbm)
    "batch": None, "step_ms": None, "decode_tok_per_s": None, "weight_bytes_read": None,
    "kv_bytes_read": None, "achieved_TBps": None, "copy_bw_TBps": None, "hbm_fraction": None,
    "bound_tok_per_s_weights_all": None, "sched_ms_decode_mean": None, "sched_ms_per_call": None,
    "sched_fraction_of_step": None, "sched_decode_calls": None,
    # structured output
    "valid_fraction": None, "mean_output_tokens": None, "finish_reasons": None,
    # checks and start-up
    "identical": None, "asserted": None, "tok_per_s_graph": None, "tok_per_s_eager": None,
    "ok": None, "integrity_ok": None, "text": None, "init_s": None, "load_s": None,
    "ready_s": None, "warmup_s": None, "kv_pool_tokens": None, "gpu": None,
    "vllm_version": None,
}


def _keep(value, spec):
    if spec is None or not isinstance(value, dict):
        return value
    if isinstance(spec, dict):
        return {k: _keep(v, spec["*"]) for k, v in value.items()}
    return {k: value[k] for k in spec if k in value}


def shown_metrics(metrics: dict) -> dict:
    return {k: _keep(v, SHOWN_METRICS[k]) for k, v in metrics.items() if k in SHOWN_METRICS}


def shown_record(rec: dict) -> dict:
    out = {k: rec.get(k) for k in RECORD_FIELDS}
    if out["status"] == "ok" or not out["error"]:
        del out["error"]
    else:
        out["error"] = out["error"].splitlines()[0][:200]
    out["metrics"] = shown_metrics(rec.get("metrics") or {})
    return out


def read_raw(path: str | Path) -> list[dict]:
    """The JSON lines of a raw results file (a torn last line of a killed run is skipped)."""
    recs = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("key"):
            recs.append(rec)
    return recs


def latest_per_item(recs: list[dict]) -> list[dict]:
    """The latest ``ok`` line of each item, else its latest line."""
    best: dict[str, dict] = {}
    for rec in sorted(recs, key=lambda r: r.get("ts", "")):
        old = best.get(rec["key"])
        if old is None or rec.get("status") == "ok" or old.get("status") != "ok":
            best[rec["key"]] = rec
    return list(best.values())


def run_name(recs: list[dict]) -> str:
    first = min(r["ts"] for r in recs)  # 2026-12-02T05:26:08
    return f"{first[:10]}-{first[11:13]}{first[14:16]}"


def write_run(path: Path, name: str, recs: list[dict]) -> None:
    """One result a line, so a new run reads well in a diff."""
    gpus = sorted({r["metrics"]["gpu"] for r in recs if r["metrics"].get("gpu")})
    recs = sorted(recs, key=lambda r: (r.get("ts") or "", r["key"]))
    head = json.dumps({"name": name, "device": ", ".join(gpus) or None})[:-1]
    lines = ",\n".join(json.dumps(r, sort_keys=False) for r in recs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head}, "results": [\n{lines}\n]}}\n')


def load_run(path: str | Path) -> tuple[str, list[dict]]:
    """(run name, result lines) of a published run, or of a raw results file (its stem)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return path.stem, read_raw(path)
    run = json.loads(path.read_text())
    return run["name"], run["results"]


def load_runs(patterns: list[str], include_quick: bool = False) -> list[dict]:
    """Every result line of the matching files, each tagged with its run (``_run``)."""
    recs = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern, recursive=True)):
            name, lines = load_run(path)
            recs += [dict(r, _run=name) for r in lines
                     if include_quick or not r.get("quick")]
    return recs


def publish(raw_files: list[str], name: str | None = None,
            runs_dir: Path = RUNS_DIR) -> Path:
    recs = [r for f in raw_files for r in read_raw(f) if not r.get("quick")]
    if not recs:
        raise SystemExit(f"publish: no results in {raw_files}")
    name = name or run_name(recs)
    path = runs_dir / f"{name}.json"
    write_run(path, name, [shown_record(r) for r in latest_per_item(recs)])
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", nargs="+", help="raw results of one run (JSON lines)")
    ap.add_argument("--name", help="run name (default: date and time of its first line)")
    ap.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    args = ap.parse_args(argv)
    path = publish(args.raw, args.name, args.runs_dir)
    print(f"publish: {path} ({path.stat().st_size:,} bytes); now run benchmarks/gpu/report.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
