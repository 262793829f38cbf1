"""Published runs -> docs/benchmarks/{README.md, *.png}.

    python benchmarks/gpu/report.py [--results 'docs/benchmarks/runs/*.json' ...]
        [--out-dir docs/benchmarks] [--include-quick] [--no-plots]

Reads the published runs (``publish.py``; raw JSON-lines files work too, for a dry run),
keeps one result per item (the latest ``ok`` one, else the latest), and writes README.md
(tables: the targets, vLLM beside us in one run, anchor rows with the transformers / vLLM
anchors, the Triton TTFT
split, online streams, shared prefix, decode HBM bandwidth, JSON decoding, checks, what was
not measured) and PNG plots. Anchors are the speed anchors (measured on the same H200
model, 2026-11-30).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from publish import RUNS_DIR, latest_per_item, load_runs  # noqa: E402
from report_db import DB  # noqa: E402
from report_peer import peer_section  # noqa: E402
from report_plots import PLOT_FILES, plots  # noqa: E402
from report_tables import (checks_section, hbm_section, json_section,  # noqa: E402
                           not_measured_section, offline_section, online_section,
                           prefix_section, triton_parts_section)
from report_targets import targets_section  # noqa: E402

# speed anchors: output tok/s, random bf16 weights, all requests submitted at once

METHOD = """## Method

- Models: random bf16 weights (`load_format="dummy"`; transformers `from_config`) with the
  shapes of Llama-3.2-1B and Llama-3.1-8B (`benchmarks/gpu/shapes.py`), the Qwen2 tokenizer
  of `models/default`; prompts are random token ids, identical for every system (same seeds).
- One process per system and configuration; each script appends JSON lines to the raw
  results (`benchmarks/gpu/results/`, not kept in git); `benchmarks/gpu/publish.py` keeps
  what this page shows of a run in `runs/<run>.json`, and `benchmarks/gpu/report.py`
  writes this page from those files.
- In-process engine (`bench_engine.py`): requests are added between `Engine.step()` calls at
  their arrival times, token times are taken when `step()` returns them.
- Triton (`bench_triton.py`): tritonserver 2.51 (nvidia-pytriton 0.7.0) with the `radixlm`
  Python backend, KIND_GPU, the engine in a child process of the stub; tritonclient gRPC
  aio, one stream per request, `input_ids` INT64, streaming responses; 8 client processes,
  each with its channel open before the start time.
- vLLM (`vllm_peer.py`, the `peer` phase): vLLM 0.26.0's offline `LLM.generate` on token-id
  prompts (`load_format="dummy"`, no tokenizer, prefix caching on), one process per
  configuration; the same prompts, warm-up and number of runs as the in-process engine.
- transformers (`bench_hf.py`): `generate` (greedy, dynamic KV cache, default attention) on
  static batches. Online rows: a dynamic-batching server that runs up to 64 waiting requests
  as one static batch; per-batch durations and first-token times are measured with real
  `generate` calls at batch sizes 1, 4, 16, 64 and the offline ones (linearly interpolated
  between; the line lists which sizes were measured), and the
  queue is replayed on a virtual clock.
- Engine configurations: default (radix cache, overlap scheduling, CUDA graphs on), cache
  off (`enable_radix_cache=False`), overlap off (`enable_overlap=False`).
"""


REPRODUCE = """## Reproduce

On a machine with an NVIDIA GPU (`benchmarks/gpu/README.md` has the set-up and the options):

```bash
bash benchmarks/gpu/fetch_wheels.sh          # here, once: the wheels the GPU machine lacks
bash benchmarks/gpu/run_all.sh check engine baselines triton instances   # there
```

The suite writes raw JSON lines (`$OUT/results.jsonl`, else `benchmarks/gpu/results/local/`);
bring them back as `benchmarks/gpu/results/<run>.jsonl` (git-ignored), then publish the run
and regenerate this page:

```bash
.venv/bin/python benchmarks/gpu/publish.py benchmarks/gpu/results/<run>.jsonl   # -> runs/<date>-<time>.json
.venv/bin/python benchmarks/gpu/report.py                                        # -> README.md, *.png
```
"""


def run_gpus(lines) -> dict[str, str]:
    """The GPU of each run, from its startup lines (runs without one: absent)."""
    return {r["_run"]: r["metrics"]["gpu"] for r in lines
            if r["mode"] == "startup" and r.get("metrics", {}).get("gpu")}


def on_device(lines, device: str):
    """The lines of runs on ``device`` (a substring of the GPU name) or of unknown GPU."""
    gpus = run_gpus(lines)
    return [r for r in lines if device in gpus.get(r["_run"], device)]


def header(device, lines, figs):
    runs = sorted({r["_run"] for r in lines})
    gpus = run_gpus(lines)
    others = sorted({g for g in gpus.values() if device not in g})
    other_runs = sorted({run for run, g in gpus.items() if device not in g})
    head = ["# RadixLM benchmarks", "",
            "Generated by `benchmarks/gpu/report.py` from the published runs in `runs/`; do not "
            "edit by hand. The suite is `benchmarks/gpu/run_all.sh`.", "",
            f"- device: the tables show runs on an {device} (the anchors' GPU)"
            + (f"; the tables beside vLLM (each names its GPU) and ratios marked *same run* "
               f"may come from runs on {', '.join(others)} ({', '.join(other_runs)}): both "
               "sides of a ratio are always from one run"
               if others else ""),
            f"- runs (each one session of the suite on one machine): {', '.join(runs)}",
            "- a run may get another machine instance than the one before, and host-bound rows "
            "(the 1B shape at batch >= 32) move by tens of percent between instances: the "
            "targets table takes both sides of a ratio from one run where one has both, and "
            "says so; the tables show the latest result of each item",
            *(["- plots: " + ", ".join(f"[{f}]({f})" for f in figs)] if figs else []), ""]
    if any(r.get("quick") for r in lines):
        head.insert(2, "**Includes CPU dry-run (--quick) lines: not performance numbers.**\n")
    return "\n".join(head) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="*", default=[str(RUNS_DIR / "*.json")],
                    help="published runs (.json) or raw results (.jsonl, e.g. a dry run)")
    ap.add_argument("--out-dir", default=str(C.REPO / "docs/benchmarks"))
    ap.add_argument("--include-quick", action="store_true", help="also CPU --quick dry-run lines")
    ap.add_argument("--device", default="H200",
                    help="the GPU whose runs the tables show (a substring of its name)")
    ap.add_argument("--no-plots", action="store_true",
                    help="do not redraw the plots (the page links those in --out-dir)")
    args = ap.parse_args(argv)
    lines = load_runs(args.results, args.include_quick)
    if not lines:
        print(f"report: no results in {args.results}")
        return 1
    # absolute numbers only from the anchors' GPU; same-run ratios from any run
    recs = latest_per_item(on_device(lines, args.device))
    db = DB(recs, [r for r in lines if r.get("status") == "ok"])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.no_plots:
        figs = [f for f in PLOT_FILES if (out / f).is_file()]
    else:
        figs = plots(db, out)
    body = [REPRODUCE, targets_section(db), peer_section(lines), offline_section(db),
            triton_parts_section(db),
            online_section(db), prefix_section(db),
            hbm_section(db), json_section(db), checks_section(db), not_measured_section(db), METHOD]
    for f in figs:
        body.append(f"![{f}]({f})\n")
    (out / "README.md").write_text(header(args.device, lines, figs) + "\n" + "\n".join(b for b in body if b))
    print(f"report: {len(recs)} items -> {out}/README.md, {len(figs)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
