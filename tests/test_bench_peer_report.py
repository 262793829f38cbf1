"""The report's table of vLLM beside us: every ratio from one run, vLLM's best configuration
per row, our rows of the same precision, dashes where a side is missing; and publish.py keeps
the run id the pairing rests on."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
report_peer = importlib.import_module("report_peer")
publish = importlib.import_module("publish")

B1, B128, FEW = "b1_in32_out128", "b128_in32_out128", "few-shot"


FEW_DESC = "64 questions after 1024 shared example tokens, 64-token answers"


def line(run, ts, system, config, workload, tok_per_s, status="ok", model="llama-1b"):
    mode = "prefix" if workload == FEW else "offline"
    metrics = {"output_tok_per_s": tok_per_s, **({"description": FEW_DESC} if mode == "prefix" else {})}
    return {"key": f"{system}/{model}/{config}/{mode}/{workload}/", "ts": ts, "run_id": run,
            "system": system, "model": model, "config": config, "mode": mode,
            "workload": workload, "rate": None, "status": status, "metrics": metrics}


def rows_of(table):
    return {r.label: r for r in table.rows}


def test_ratios_take_both_sides_from_the_latest_run_that_measured_vllm():
    lines = [
        line("r1", "2026-12-03T06:00:00", "vllm", "async", B128, 20000.0),
        line("r1", "2026-12-03T06:05:00", "engine", "default", B128, 50000.0),
        line("r1", "2026-12-03T06:07:00", "triton", "default", B128, 40000.0),
        # a later run of ours alone (another machine instance) is not paired with r1's vLLM
        line("r2", "2026-12-03T07:00:00", "engine", "default", B128, 70000.0),
    ]
    (t,) = report_peer.peer_tables(lines)
    assert (t.model, t.precision, t.run) == ("llama-1b", "default", "r1")
    row = rows_of(t)["batch 128, 32/128"]
    assert (row.vllm, row.vllm_config, row.ours, row.triton) == (20000.0, "async", 50000.0, 40000.0)
    page = report_peer.peer_section(lines)
    assert ("| batch 128, 32/128 | 20,000 | async | **50,000** | 2.50x | 40,000 | 2.00x | 80% |"
            in page)
    assert "70,000" not in page and "### llama-1b, bf16 (run r1)" in page


def test_a_newer_vllm_run_replaces_the_older_one_with_its_own_rows_only():
    lines = [
        line("r1", "2026-12-03T06:00:00", "vllm", "async", B1, 500.0),
        line("r1", "2026-12-03T06:05:00", "engine", "default", B1, 1000.0),
        line("r2", "2026-12-03T07:00:00", "vllm", "async", B1, 600.0),
    ]
    (t,) = report_peer.peer_tables(lines)
    row = rows_of(t)["batch 1, 32/128"]
    assert (t.run, row.vllm, row.ours) == ("r2", 600.0, None)  # r1's engine row is not borrowed
    assert "| batch 1, 32/128 | 600 | async | **—** | — | — | — | — |" in report_peer.peer_section(lines)


def test_vllm_best_is_the_faster_configuration_row_by_row():
    lines = [
        line("r1", "2026-12-03T06:00:00", "vllm", "default", B1, 480.0),
        line("r1", "2026-12-03T06:03:00", "vllm", "async", B1, 500.0),
        line("r1", "2026-12-03T06:00:01", "vllm", "default", FEW, 13000.0),
        line("r1", "2026-12-03T06:03:01", "vllm", "async", FEW, 12000.0),
        line("r1", "2026-12-03T06:04:00", "vllm", "async", B128, 9e9, status="error"),
    ]
    (t,) = report_peer.peer_tables(lines)
    rows = rows_of(t)
    assert (rows["batch 1, 32/128"].vllm, rows["batch 1, 32/128"].vllm_config) == (500.0, "async")
    few = rows[f"few-shot: {FEW_DESC}"]
    assert (few.vllm, few.vllm_config) == (13000.0, "default")
    assert "batch 128, 32/128" not in rows  # a failed line is no measurement
    assert list(rows) == ["batch 1, 32/128", f"few-shot: {FEW_DESC}"]  # in the anchor table's order


def test_each_precision_is_compared_with_our_rows_of_that_precision():
    lines = [
        line("r1", "2026-12-03T06:00:00", "vllm", "async", B1, 200.0, model="llama-8b"),
        line("r1", "2026-12-03T06:01:00", "engine", "default", B1, 240.0, model="llama-8b"),
        line("r3", "2026-12-03T08:00:00", "vllm", "fp8+async", B1, 300.0, model="llama-8b"),
        line("r3", "2026-12-03T08:01:00", "engine", "fp8", B1, 330.0, model="llama-8b"),
        line("r3", "2026-12-03T08:02:00", "engine", "default", B1, 999.0, model="llama-8b"),
    ]
    bf16, fp8 = report_peer.peer_tables(lines)
    assert (bf16.precision, bf16.run, rows_of(bf16)["batch 1, 32/128"].ours) == ("default", "r1", 240.0)
    row = rows_of(fp8)["batch 1, 32/128"]
    assert (fp8.precision, fp8.run, row.vllm, row.vllm_config, row.ours) == ("fp8", "r3", 300.0, "fp8+async", 330.0)
    page = report_peer.peer_section(lines)
    assert "### llama-8b, FP8 weights (run r3)" in page and "| 1.10x |" in page


def test_without_vllm_rows_there_is_no_section():
    assert report_peer.peer_section([line("r1", "2026-12-03T06:00:00", "engine", "default", B1, 1.0)]) == ""


def test_published_lines_keep_their_run_id_and_the_vllm_version(tmp_path):
    raw = tmp_path / "raw.jsonl"
    start = {**line("20261203-060000", "2026-12-03T06:00:00", "vllm", "async", B1, 1.0),
             "key": "vllm/llama-1b/async/startup/vllm/", "mode": "startup", "workload": "vllm",
             "metrics": {"init_s": 95.1, "vllm_version": "0.26.0", "gpu": "NVIDIA H200"}}
    row = line("20261203-060000", "2026-12-03T06:01:00", "vllm", "async", B1, 500.0)
    raw.write_text(json.dumps(start) + "\n" + json.dumps(row) + "\n")
    path = publish.publish([str(raw)], runs_dir=tmp_path / "runs")
    name, recs = publish.load_run(path)
    assert {r["run_id"] for r in recs} == {"20261203-060000"}
    (t,) = report_peer.peer_tables([dict(r, _run=name) for r in recs])
    assert (t.run, t.vllm_version, t.gpu) == ("20261203-060000", "0.26.0", "NVIDIA H200")
    # the heading names the GPU: runs on other GPUs than the rest of the page share it
    page = report_peer.peer_section([dict(r, _run=name) for r in recs])
    assert "### llama-1b, bf16 (run 20261203-060000, vLLM 0.26.0, NVIDIA H200)" in page


def test_lines_published_before_run_ids_pair_by_their_published_file():
    old = [dict(line(None, "2026-12-01T06:00:00", "vllm", "async", B1, 500.0), _run="2026-12-01-0600"),
           dict(line(None, "2026-12-01T06:01:00", "engine", "default", B1, 1000.0), _run="2026-12-01-0600"),
           dict(line(None, "2026-12-02T06:01:00", "engine", "default", B1, 2000.0), _run="2026-12-02-0600")]
    (t,) = report_peer.peer_tables(old)
    assert (t.run, rows_of(t)["batch 1, 32/128"].ours) == ("2026-12-01-0600", 1000.0)
