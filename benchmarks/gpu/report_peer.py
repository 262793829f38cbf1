"""The report's peer table: vLLM beside our engine, both sides from one run.

A ratio divides two numbers of one run (one device call of ``run_all.sh peer``: one machine
instance), never numbers of two runs: the 1B rows of either side moved by up to 50% between
two instances of the same machine model. For each model shape and precision (bf16, fp8, ...)
the table takes the latest run that measured vLLM at that precision, vLLM's best
configuration in that run for each row (default, async scheduling, ...), and our rows of the
same run labelled with that precision's name (``default`` for bf16).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_db import MODEL_ORDER, ROW_ORDER, _parse_row, fmt, table  # noqa: E402
from vllm_peer import parse_config  # noqa: E402

from report_db import PREFIX_WORKLOADS  # noqa: E402
PRECISION_LABELS = {"default": "bf16", "fp8": "FP8 weights", "kv-fp8": "FP8 KV cache",
                    "fp8+kv-fp8": "FP8 weights and KV cache"}


def run_of(rec: dict) -> str:
    """The run a line belongs to: its run_id (one run_all invocation), else (published
    before run ids were kept) the published file it came from."""
    return rec.get("run_id") or rec.get("_run") or "?"


def precision_of(config: str) -> str | None:
    try:
        return parse_config(config).precision
    except ValueError:
        return None


@dataclass(frozen=True)
class PeerRow:
    label: str
    vllm: float | None
    vllm_config: str | None
    ours: float | None
    triton: float | None


@dataclass(frozen=True)
class PeerTable:
    model: str
    precision: str
    run: str
    vllm_version: str | None
    rows: list[PeerRow]
    gpu: str | None = None  # from the run's startup lines: runs on other GPUs share the page


def _tok_per_s(rec: dict | None) -> float | None:
    return (rec or {}).get("metrics", {}).get("output_tok_per_s")


def peer_tables(lines: list[dict]) -> list[PeerTable]:
    """One table per (model, precision) that has vLLM rows: its latest run with them."""
    ok = [r for r in lines if r.get("status") == "ok"]
    latest: dict[tuple, dict] = {}  # (run, system, model, config, mode, workload) -> line
    for r in sorted(ok, key=lambda r: r.get("ts") or ""):
        latest[(run_of(r), r["system"], r["model"], r["config"], r["mode"], r["workload"])] = r
    runs_ts: dict[tuple, str] = {}  # (model, precision, run) -> its last vLLM line's time
    for (run, system, model, config, mode, _), r in latest.items():
        if system == "vllm" and mode in ("offline", "prefix") and precision_of(config):
            key = (model, precision_of(config), run)
            runs_ts[key] = max(runs_ts.get(key, ""), r.get("ts") or "")
    chosen: dict[tuple, str] = {}
    for (model, precision, run), ts in sorted(runs_ts.items(), key=lambda kv: kv[1]):
        chosen[(model, precision)] = run  # the latest wins
    tables = []
    for (model, precision), run in sorted(chosen.items(), key=lambda kv: _model_order(kv[0])):
        ours_config = precision  # ours is labelled with the precision's name, bf16 "default"
        rows = []
        for mode, workload in _row_items(latest, run, model):
            cands = [(v, c) for (ru, s, mo, c, md, w), rec in latest.items()
                     if (ru, s, mo, md, w) == (run, "vllm", model, mode, workload)
                     and precision_of(c) == precision and (v := _tok_per_s(rec))]
            best, best_cfg = max(cands) if cands else (None, None)
            ours = _tok_per_s(latest.get((run, "engine", model, ours_config, mode, workload)))
            tri = _tok_per_s(latest.get((run, "triton", model, ours_config, mode, workload)))
            if best is None and ours is None and tri is None:
                continue
            rows.append(PeerRow(_row_label(latest, run, model, mode, workload), best, best_cfg,
                                ours, tri))
        version = next((rec["metrics"].get("vllm_version") for (ru, s, mo, c, md, w), rec
                        in latest.items() if (ru, s, mo, md) == (run, "vllm", model, "startup")
                        and rec["metrics"].get("vllm_version")), None)
        gpu = next((rec["metrics"].get("gpu") for (ru, s, mo, c, md, w), rec in latest.items()
                    if (ru, mo, md) == (run, model, "startup") and rec["metrics"].get("gpu")),
                   None)
        tables.append(PeerTable(model, precision, run, version, rows, gpu))
    return tables


def _row_items(latest: dict, run: str, model: str) -> list[tuple[str, str]]:
    """(mode, workload) of the rows, offline then prefix: the anchor table's first, then
    any other of the run (a dry run's small rows)."""
    out = []
    for mode, anchors in (("offline", ROW_ORDER), ("prefix", PREFIX_WORKLOADS)):
        have = {w for (ru, s, mo, c, md, w) in latest if (ru, mo, md) == (run, model, mode)}
        out += [(mode, w) for w in anchors if w in have]
        out += [(mode, w) for w in sorted(have - set(anchors),
                                          key=lambda w: (tuple(x or 0 for x in _parse_row(w)), w))]
    return out


def _row_label(latest: dict, run: str, model: str, mode: str, workload: str) -> str:
    if mode == "offline" and _parse_row(workload)[0] is not None:
        return "batch {}, {}/{}".format(*_parse_row(workload))
    desc = next((rec["metrics"].get("description") for (ru, s, mo, c, md, w), rec in latest.items()
                 if (ru, mo, md, w) == (run, model, mode, workload) and rec["metrics"].get("description")),
                None)
    return f"{workload}: {desc}" if desc else workload


def _model_order(key):
    model, precision = key
    return (MODEL_ORDER.index(model) if model in MODEL_ORDER else len(MODEL_ORDER), model,
            precision != "default", precision)


def times(a: float | None, b: float | None) -> str:
    """a / b as a factor with two decimals (the targets sit at 1.1x), or a dash."""
    return "—" if a is None or not b else f"{a / b:.2f}x"


def share(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{100 * a / b:.0f}%"


def peer_section(lines: list[dict]) -> str:
    tables = peer_tables(lines)
    if not tables:
        return ""
    parts = ["## Beside vLLM, in one run (output tokens/s)\n",
             "`run_all.sh peer`: vLLM (`vllm_peer.py`, one process per configuration) and our "
             "engine in-process and through tritonserver, one after the other in one device "
             "call, on the same rows: random weights, greedy, exactly n_out tokens, all "
             "requests at once, the median of three runs after a warm-up, each run from an "
             "empty prefix cache. *vLLM best*: the faster of its configurations measured in "
             "that run (the one named). Every ratio divides two numbers of the run named in "
             "the heading; none mixes runs.\n"]
    for t in tables:
        about = [f"run {t.run}"] + [f"vLLM {t.vllm_version}"] * bool(t.vllm_version) \
            + [t.gpu] * bool(t.gpu)
        parts.append(f"### {t.model}, {PRECISION_LABELS.get(t.precision, t.precision)} "
                     f"({', '.join(about)})\n")
        rows = [[r.label, fmt(r.vllm), r.vllm_config or "—", f"**{fmt(r.ours)}**",
                 times(r.ours, r.vllm), fmt(r.triton), times(r.triton, r.vllm),
                 share(r.triton, r.ours)] for r in t.rows]
        parts.append(table(["workload (in/out)", "vLLM best", "vLLM config", "ours in-process",
                            "in-process / vLLM", "ours via Triton", "Triton / vLLM",
                            "Triton / in-process"], rows))
        parts.append("")
    return "\n".join(parts)
