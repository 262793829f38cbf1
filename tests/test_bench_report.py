"""The benchmark report: raw results are published as small per-run files, and the page
docs/benchmarks/README.md is what report.py makes from the published runs."""
from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "gpu"


@pytest.fixture(scope="module")
def bench():
    """(publish, report) modules of benchmarks/gpu."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("publish"), importlib.import_module("report")
    finally:
        sys.path.remove(str(BENCH))


def line(ts, system, config, workload, tok_per_s, status="ok", **extra):
    key = f"{system}/llama-1b/{config}/offline/{workload}/"
    return {"key": key, "ts": ts, "run_id": "r", "system": system, "model": "llama-1b",
            "config": config, "flags": {}, "mode": "offline", "workload": workload,
            "rate": None, "status": status, "error": None if status == "ok" else "boom\nmore",
            "metrics": {"output_tok_per_s": tok_per_s, "duration_s": 1.0,
                        "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0, "mean": 1.5}},
            "host": "vm", "git": "abc1234", "phase": None, "quick": False, **extra}


def write_raw(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(rec) + "\n" for rec in lines) + '{"torn')
    return path


def test_publish_keeps_the_latest_ok_line_of_each_item_and_only_what_the_report_shows(
        bench, tmp_path):
    publish, _ = bench
    raw = write_raw(tmp_path / "raw.jsonl", [
        line("2026-12-02T05:26:08", "engine", "default", "b1_in32_out128", 900.0),
        line("2026-12-02T05:27:00", "engine", "default", "b1_in32_out128", 1000.0),
        line("2026-12-02T05:28:00", "engine", "default", "b1_in32_out128", None, status="error"),
        line("2026-12-02T05:29:00", "engine", "default", "b32_in32_out128", None, status="error"),
        line("2026-12-02T05:30:00", "engine", "default", "b128_in32_out128", 5.0, quick=True),
    ])
    path = publish.publish([str(raw)], runs_dir=tmp_path / "runs")
    assert path == tmp_path / "runs" / "2026-12-02-0526.json"  # date and time of the first line
    name, results = publish.load_run(path)
    assert name == "2026-12-02-0526"
    by_key = {r["key"]: r for r in results}
    assert set(by_key) == {"engine/llama-1b/default/offline/b1_in32_out128/",
                           "engine/llama-1b/default/offline/b32_in32_out128/"}  # no quick line
    kept = by_key["engine/llama-1b/default/offline/b1_in32_out128/"]
    assert kept["metrics"] == {"output_tok_per_s": 1000.0,
                               "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}}
    assert "error" not in kept and "host" not in kept and "flags" not in kept
    failed = by_key["engine/llama-1b/default/offline/b32_in32_out128/"]
    assert (failed["status"], failed["error"]) == ("error", "boom")


def test_a_ratio_pairs_two_results_of_one_run_and_the_tables_show_the_latest(bench, tmp_path):
    publish, report = bench
    runs = tmp_path / "runs"
    older = write_raw(tmp_path / "a.jsonl", [
        line("2026-12-01T08:00:00", "engine", "default", "b128_in32_out128", 60000.0),
        line("2026-12-01T08:05:00", "triton", "default", "b128_in32_out128", 45000.0)])
    newer = write_raw(tmp_path / "b.jsonl", [
        line("2026-12-02T09:00:00", "engine", "default", "b128_in32_out128", 64000.0)])
    publish.publish([str(older)], runs_dir=runs)
    publish.publish([str(newer)], runs_dir=runs)
    out = tmp_path / "page"
    assert report.main(["--results", str(runs / "*.json"), "--out-dir", str(out),
                        "--no-plots"]) == 0
    page = (out / "README.md").read_text()
    # 45,000 / 60,000 from the older run, not against the newer run's 64,000
    assert ("| Triton gRPC, 1 instance, b128_in32_out128, llama-1b: within 10% of in-process "
            "| 75% (same run: 2026-12-01-0800) | **no** |") in page
    (row,) = [r for r in page.splitlines() if r.startswith("| batch 128, 32/128 |")]
    assert "**64,000**" in row and "45,000" in row
    assert "machine): 2026-12-01-0800, 2026-12-02-0900" in page


def test_the_committed_page_is_what_the_published_runs_make(bench, tmp_path):
    """The tables from the published runs; the plots take seconds to draw, so the committed
    ones are linked as they are."""
    _, report = bench
    docs = ROOT / "docs" / "benchmarks"
    for png in docs.glob("*.png"):
        shutil.copy(png, tmp_path / png.name)
    assert report.main(["--out-dir", str(tmp_path), "--no-plots"]) == 0
    committed = (docs / "README.md").read_text()
    assert (tmp_path / "README.md").read_text() == committed, \
        "run benchmarks/gpu/report.py and commit docs/benchmarks/"
    assert "![offline_throughput.png](offline_throughput.png)" in committed


def markdown_rows(text: str, after: str) -> dict[str, list[str]]:
    """{first cell: other cells} of the first table after the line ``after``."""
    lines = text.splitlines()
    start = lines.index(after)
    rows = {}
    for ln in lines[start + 1:]:
        if ln.startswith("|"):
            cells = [c.strip().strip("*") for c in ln.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        elif rows:
            break
    return rows


def test_the_readme_performance_table_quotes_the_benchmark_page():
    readme = markdown_rows((ROOT / "README.md").read_text(), "## Performance")
    page = (ROOT / "docs" / "benchmarks" / "README.md").read_text()
    one_b, eight_b = (markdown_rows(page, f"### {m}") for m in ("llama-1b", "llama-8b"))
    # page columns: transformers anchor, this run, vLLM anchor, in-process, via Triton,
    # via Triton 2 instances, ...
    workloads = [w for w in readme if w.startswith("batch ")]
    assert len(workloads) == 4
    for w in workloads:
        p1, p8 = one_b[w], eight_b[w]
        assert readme[w] == [p1[3], p1[4], p1[5], p1[2], p8[3], p8[4], p8[2]], w


def test_tables_show_only_the_anchor_gpu_runs_while_ratios_pair_lines_of_any_one_run(bench):
    _, report = bench

    def startup(run, gpu):
        return {"_run": run, "mode": "startup", "metrics": {"gpu": gpu}}

    h200 = dict(line("2026-12-02T05:26:08", "engine", "default", "b1_in32_out128", 1000.0),
                _run="a")
    h100 = dict(line("2026-12-05T13:08:00", "engine", "default", "b1_in32_out128", 800.0),
                _run="b")
    unknown = dict(line("2026-12-01T00:00:00", "engine", "default", "b32_in32_out128", 9.0),
                   _run="c")
    lines = [startup("a", "NVIDIA H200"), h200, startup("b", "NVIDIA H100 80GB HBM3"), h100,
             unknown]
    assert report.run_gpus(lines) == {"a": "NVIDIA H200", "b": "NVIDIA H100 80GB HBM3"}
    shown = report.on_device(lines, "H200")
    assert h200 in shown and unknown in shown and h100 not in shown
    assert report.on_device(lines, "H100") == [lines[2], h100, unknown]
    head = report.header("H200", lines, [])
    assert "runs on NVIDIA H100 80GB HBM3 (b)" in head
