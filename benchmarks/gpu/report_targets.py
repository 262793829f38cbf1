"""The report's targets table: each target, what the published runs reached, met or not."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from report_db import (ANCHORS, BATCH1_TARGET, PREFIX_WORKLOADS, ROW_ORDER,  # noqa: E402
                       TRITON_CONFIGS, _rate, _yes, table)


def targets_section(db):
    rows = []
    m1 = db.get("engine", "llama-1b", "default", "hbm", "decode_b1_in512")
    if m1 and m1.get("status") == "ok":
        f = m1["metrics"]["hbm_fraction"]
        rows.append(["Decode at batch 1, 1B shape: >= 60% of measured HBM bandwidth",
                     f"{100 * f:.0f}%", _yes(f >= 0.60)])
    else:
        rows.append(["Decode at batch 1, 1B shape: >= 60% of measured HBM bandwidth", "not measured", "—"])
    for model in ("llama-1b", "llama-8b"):
        common = [r for r in db.rates(model, "in32_out128")
                  if db.metric("engine", model, "default", "online", "in32_out128", rate=r)
                  and db.metric("hf", model, None, "online", "in32_out128", rate=r)]
        if common:
            r = max(common)
            e = db.get("engine", model, "default", "online", "in32_out128", r)["metrics"]
            h = db.get("hf", model, None, "online", "in32_out128", r)["metrics"]
            x = e["output_tok_per_s"] / h["output_tok_per_s"]
            p_e, p_h = e["e2e_ms"]["p90"], h["e2e_ms"]["p90"]
            rows.append([f"32/128, {model}: >= 10x transformers throughput at a lower p90 (at {r:g} req/s)",
                         f"{x:.1f}x; p90 E2E {p_e:,.0f} vs {p_h:,.0f} ms", _yes(x >= 10 and p_e < p_h)])
        for w in ("b32_in32_out128", "b128_in32_out128"):
            o, h = db.metric("engine", model, "default", "offline", w), db.metric("hf", model, None, "offline", w)
            if o and h:
                rows.append([f"offline {w}, {model}: >= 10x transformers (this run)", f"{o / h:.1f}x", _yes(o / h >= 10)])
        for w in PREFIX_WORKLOADS:
            on, off, note = db.paired(("engine", model, "default", "prefix", w, None),
                                      ("engine", model, "cache-off", "prefix", w, None))
            if on and off:
                rows.append([f"{w}, {model}: >= 3x throughput of cache off", f"{on / off:.2f}x ({note})",
                             _yes(on / off >= 3)])
            hr = db.get("engine", model, "default", "prefix", w)
            if hr and hr.get("status") == "ok" and hr["metrics"].get("hit_rate_vs_best") is not None:
                v = hr["metrics"]["hit_rate_vs_best"]
                rows.append([f"{w}, {model}: hit rate >= 95% of best", f"{100 * v:.1f}%", _yes(v >= 0.95)])
        for config, how in TRITON_CONFIGS:
            rows += triton_target_rows(db, model, config, how)
        hb = db.get("engine", model, "default", "hbm", "decode_b64_in512")
        if hb and hb.get("status") == "ok" and hb["metrics"].get("sched_fraction_of_step") is not None:
            v = hb["metrics"]["sched_fraction_of_step"]
            rows.append([f"Scheduler CPU per decode step at batch 64, overlap on, {model}: < 5% of the step",
                         f"{100 * v:.1f}%", _yes(v < 0.05)])
        for w in ROW_ORDER + ["few-shot"]:
            anchors = ANCHORS.get(model, {})
            if w not in anchors:
                continue
            ours = (db.metric("engine", model, "default", "prefix", "few-shot") if w == "few-shot"
                    else db.metric("engine", model, "default", "offline", w))
            if ours:
                rows.append([f"{w}, {model}: ahead of vLLM 0.26 ({anchors[w][1]:,})", f"{ours:,.0f} ({100 * ours / anchors[w][1]:.0f}%)",
                             _yes(ours > anchors[w][1])])
        if model in BATCH1_TARGET:
            ours = db.metric("engine", model, "default", "offline", "b1_in32_out128")
            if ours:
                rows.append([f"batch 1 32/128, {model}: >= {BATCH1_TARGET[model][1]:,} tok/s",
                             f"{ours:,.0f}", _yes(ours >= BATCH1_TARGET[model][1])])
    return "## Targets\n\n" + table(["target", "measured", "met"], rows) + "\n"


def triton_target_rows(db, model, config, how):
    """Within 10% of in-process through Triton: the offline rows and the highest rate of
    each online shape, the two sides from one run where one has both."""
    rows = []
    for w in ROW_ORDER:
        t, e, note = db.paired(("triton", model, config, "offline", w, None),
                               ("engine", model, "default", "offline", w, None))
        if t and e:
            rows.append([f"Triton gRPC, {how}, {w}, {model}: within 10% of in-process",
                         f"{100 * t / e:.0f}% ({note})", _yes(t >= 0.9 * e)])
    for shape in C.ONLINE_SHAPES:
        rs = [r for r in db.rates(model, shape) if db.metric("triton", model, config, "online", shape, rate=r)
              and db.metric("engine", model, "default", "online", shape, rate=r)]
        if rs:
            r = max(rs)
            t, e, note = db.paired(("triton", model, config, "online", shape, _rate(r)),
                                   ("engine", model, "default", "online", shape, _rate(r)))
            rows.append([f"Triton gRPC, {how}, online {shape} at {r:g} req/s, {model}: within 10%",
                         f"{100 * t / e:.0f}% ({note})", _yes(t >= 0.9 * e)])
    return rows
