"""The report's tables, one function a section, each returning markdown ("" when it has no
rows)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from report_db import (ANCHORS, BATCH1_TARGET, BOUND_ANCHOR, PREFIX_WORKLOADS,  # noqa: E402
                       ROW_ORDER, _label, _parse_row, fmt, online_systems, pct3, ratio, table)


def offline_section(db):
    parts = ["## Offline throughput: the anchor rows (output tokens/s)\n",
             "All requests submitted at once; random bf16 weights of the named shape; greedy, "
             "exactly n_out tokens (ignore_eos). *anchor*: transformers and vLLM 0.26 measured on the same machine model ("
             "2026-11-30). Ours: median of up to 3 runs.\n"]
    for model in db.models():
        anchors = ANCHORS.get(model, {})
        rows = []
        extra = sorted({r["workload"] for r in db.recs if r["model"] == model and r["mode"] == "offline"}
                       - set(ROW_ORDER), key=lambda w: tuple(x or 0 for x in _parse_row(w)))
        for w in ROW_ORDER + extra + ["few-shot", "few-shot (cache off)"]:
            hf_a, vllm_a = anchors.get(w, (None, None))
            if w.startswith("few-shot"):
                cache_off = w.endswith("(cache off)")
                ours = db.metric("engine", model, "cache-off" if cache_off else "default", "prefix", "few-shot")
                tri = tri2 = None
                co = db.metric("engine", model, "cache-off", "prefix", "few-shot") if not cache_off else None
                oo = db.metric("engine", model, "overlap-off", "prefix", "few-shot")
                hf = None
                label = "64 x (1,024 shared + 32)/64" + (", cache off" if cache_off else ", radix cache on")
            else:
                ours = db.metric("engine", model, "default", "offline", w)
                tri = db.metric("triton", model, "default", "offline", w)
                tri2 = db.metric("triton", model, "instances-2", "offline", w)
                co = db.metric("engine", model, "cache-off", "offline", w)
                oo = db.metric("engine", model, "overlap-off", "offline", w)
                hf = db.metric("hf", model, None, "offline", w)
                b, i, o = _parse_row(w)
                label = f"batch {b}, {i}/{o}"
            if all(v is None for v in (ours, tri, tri2, co, oo, hf)) and (hf_a, vllm_a) == (None, None):
                continue
            rows.append([label, fmt(hf_a), fmt(hf), fmt(vllm_a), f"**{fmt(ours)}**", fmt(tri), fmt(tri2),
                         fmt(co), fmt(oo), ratio(ours, vllm_a, pct=True), ratio(ours, hf)])
        if rows:
            parts.append(f"### {model}\n")
            parts.append(table(["workload (in/out)", "transformers (anchor)", "transformers (this run)",
                                "vLLM 0.26 (anchor)", "ours in-process", "ours via Triton",
                                "via Triton, 2 instances", "ours, cache off", "ours, overlap off", "ours / vLLM",
                                "ours / transformers"], rows))
            b1 = db.metric("engine", model, "default", "offline", "b1_in32_out128")
            hb = db.get("engine", model, "default", "hbm", "decode_b1_in512")
            bound = hb["metrics"].get("bound_tok_per_s_weights_all") if hb and hb.get("status") == "ok" else None
            if model in BATCH1_TARGET:
                frac, tgt = BATCH1_TARGET[model]
                parts.append(f"\nBatch 1: {fmt(b1)} tok/s = {ratio(b1, bound or BOUND_ANCHOR[model], pct=True)} of "
                             f"the bound {fmt(bound or BOUND_ANCHOR[model])} tok/s (all weight bytes / copy "
                             f"bandwidth{' measured in this run' if bound else ', anchor'}); "
                             f"target {int(frac * 100)}% = {fmt(tgt)} tok/s.\n")
            parts.append("")
    return "\n".join(parts)


TTFT_PART_LABELS = (("client_to_intake", "client send -> stub intake"),
                    ("to_engine", "-> the engine process has it"),
                    ("engine", "-> first output leaves the engine process"),
                    ("to_stub", "-> routed by the stub"), ("stub_send", "-> sent by the stub"),
                    ("to_client", "-> received by the client"))


def triton_parts_section(db):
    """Where a streamed request's first token spends its time through tritonserver
    (bench_triton's request timelines), next to the in-process TTFT of the same run."""
    rows = []
    for model in db.models():
        for w in ROW_ORDER:
            r = db.get("triton", model, "default", "offline", w)
            m = r.get("metrics", {}) if r and r.get("status") == "ok" else {}
            parts = m.get("ttft_parts_ms")
            if not parts:
                continue
            e_ttft = []
            for config in ("default", "idle-1s"):
                e = db.get("engine", model, config, "offline", w)
                same = e if e and e.get("_run") == r.get("_run") else None
                e_ttft.append(fmt(same["metrics"]["ttft_ms"]["p50"], 1) if same else "—")
            rows.append([model, w, *e_ttft, fmt(m["ttft_ms"]["p50"], 1)]
                        + [fmt(parts[k]["p50"], 1) if k in parts else "—"
                           for k, _ in TTFT_PART_LABELS]
                        + [fmt(m.get("responses_per_request", {}).get("p50")),
                           r["_run"]])
    if not rows:
        return ""
    return ("## Through Triton: where the first token's time goes\n\n"
            "p50 over a run's requests, ms. Wall clocks of the client, the stub and the engine "
            "process on one host (`RADIXLM_TRACE_REQUESTS` timelines joined by request id); the "
            "parts add up to the Triton TTFT. In-process TTFT: the same run's engine row, all "
            "requests added at once, right after the previous run or after 1 s idle "
            "(`bench_engine.py --rep-gap-s 1`: a Triton run starts after ~1 s idle while its "
            "client processes start, and the first step after idle is slower). Responses/request: how many streamed responses carried "
            "the 128 or 32 tokens (the stub merges the tokens that queued while a send was in "
            "flight).\n\n"
            + table(["model", "workload", "in-process TTFT", "in-process TTFT after 1 s idle",
                     "Triton TTFT"]
                    + [label for _, label in TTFT_PART_LABELS] + ["responses/request", "run"],
                    rows) + "\n")


def online_section(db):
    parts = ["## Online request streams (Poisson arrivals; DJL-table shapes)\n",
             "Per rate: requests = rate x 10 s of arrivals (24 to 300). TTFT: arrival to first "
             "token; TPOT: time per output token after the first; E2E: arrival to last token "
             "(ms, p50 / p90 / p99). Throughput: output tokens / (last finish - first arrival). "
             "transformers: dynamic batching of static `generate` batches (up to 64; see "
             "Method).\n"]
    for model in db.models():
        for shape in C.ONLINE_SHAPES:
            rates = db.rates(model, shape)
            if not rates:
                continue
            rows = []
            for rate in rates:
                for sysname, cfg in online_systems(db, model):
                    r = db.get(sysname, model, cfg, "online", shape, rate)
                    if r is None:
                        continue
                    label = _label(sysname, cfg)
                    if r.get("status") not in ("ok", "truncated"):
                        rows.append([fmt(rate), label, r.get("status"), "", "", "", "", ""])
                        continue
                    m = r["metrics"]
                    rows.append([fmt(rate), label, fmt(m.get("output_tok_per_s")), fmt(m.get("req_per_s"), 1),
                                 pct3(m.get("ttft_ms")), pct3(m.get("tpot_ms"), 2), pct3(m.get("e2e_ms"), 0),
                                 f"{m.get('n_completed')}/{m.get('n_requests')}"])
            parts.append(f"### {model}, {shape.replace('in', '').replace('_out', '/')} tokens\n")
            parts.append(table(["req/s offered", "system", "output tok/s", "req/s done", "TTFT ms",
                                "TPOT ms", "E2E ms", "done"], rows))
            parts.append("")
    return "\n".join(parts)


def prefix_section(db):
    rows = []
    for model in db.models():
        for w in PREFIX_WORKLOADS:
            on = db.get("engine", model, "default", "prefix", w)
            off = db.get("engine", model, "cache-off", "prefix", w)
            if on is None and off is None:
                continue
            mo = on["metrics"] if on and on.get("status") == "ok" else {}
            mf = off["metrics"] if off and off.get("status") == "ok" else {}
            rows.append([model, w, mo.get("description", mf.get("description", "")),
                         fmt(mo.get("output_tok_per_s")), fmt(mf.get("output_tok_per_s")),
                         ratio(mo.get("output_tok_per_s"), mf.get("output_tok_per_s")),
                         fmt(mo.get("cache_hit_rate"), 3), fmt(mo.get("best_hit_rate"), 3),
                         ratio(mo.get("cache_hit_rate"), mo.get("best_hit_rate"), pct=True),
                         pct3((mo.get("ttft_ms"))), pct3(mf.get("ttft_ms"))])
    if not rows:
        return ""
    return ("## Shared-prefix workloads (radix cache on vs off)\n\n"
            "Cache hit rate: prompt tokens served from the cache / prompt tokens. Best: an "
            "infinite cache serving in the ideal order (benchmarks/workloads.py BestHitTracker). "
            "Each workload starts from an empty cache; rounds (turns, tree levels) are submitted "
            "one after the other, each all at once. A row is the median of up to three runs "
            "after an untimed one; "
            "a 1B-shape run lasts 0.1-0.5 s, and one run varied by up to 40% between "
            "processes on one machine.\n\n" +
            table(["model", "workload", "shape", "tok/s cache on", "tok/s cache off", "speed-up",
                   "hit rate", "best", "hit / best", "TTFT ms on", "TTFT ms off"], rows) + "\n")


def hbm_section(db):
    rows = []
    for model in db.models():
        for cfg in ("default", "overlap-off", "no-graph"):
            for r in db.recs:
                if (r["system"], r["model"], r["config"], r["mode"]) != ("engine", model, cfg, "hbm"):
                    continue
                m = r.get("metrics", {})
                if r.get("status") != "ok":
                    rows.append([model, cfg, r["workload"], r.get("status")] + [""] * 9)
                    continue
                rows.append([model, cfg, m["batch"], fmt(m["step_ms"], 3), fmt(m["decode_tok_per_s"]),
                             fmt(m["weight_bytes_read"] / 1e9, 2), fmt(m["kv_bytes_read"] / 1e9, 3),
                             fmt(m["achieved_TBps"], 2), fmt(m["copy_bw_TBps"], 2),
                             f"**{100 * m['hbm_fraction']:.0f}%**",
                             fmt(m.get("sched_ms_decode_mean"), 3), fmt(m.get("sched_ms_per_call"), 3),
                             "—" if m.get("sched_fraction_of_step") is None else
                             f"{100 * m['sched_fraction_of_step']:.1f}%"
                             + ("" if "sched_decode_calls" in m else " (all calls)")])
    if not rows:
        return ""
    return ("## Decode: achieved fraction of HBM bandwidth\n\n"
            "Steady decode (prompt 512 tokens, 160 new; steps in which every request got one "
            "token, first and last 10% dropped; median step). Bytes per step: every weight once "
            "(an untied input embedding only for the rows looked up) plus the KV of the mean "
            "context; divided by the step time and by the device-to-device copy bandwidth "
            "(bytes read + written per second, torch copy_ of 2 GiB) measured in the same "
            "process. Scheduler: CPU time in `Scheduler.schedule`, timed from outside the "
            "engine: the mean over the decode steps (every request decoding), and over all "
            "calls (the few admission steps, which match and allocate whole prompts, "
            "included); the share of the step is the decode-step mean's (older runs recorded "
            "only the all-calls mean: marked).\n\n" +
            table(["model", "config", "batch", "step ms", "tok/s", "weights GB/step", "KV GB/step",
                   "achieved TB/s", "copy TB/s", "HBM fraction", "schedule() ms per decode step",
                   "schedule() ms per call", "of step"], rows) + "\n")


def json_section(db):
    rows = []
    for r in db.recs:
        if r["mode"] != "json":
            continue
        m = r.get("metrics", {})
        if r.get("status") not in ("ok", "truncated"):
            rows.append([r["model"], r["config"], r.get("status"), "", "", "", "", ""])
            continue
        rows.append([r["model"], r["config"], m.get("n_requests"), f"{100 * m.get('valid_fraction', 0):.0f}%",
                     fmt(m.get("output_tok_per_s")), pct3(m.get("tpot_ms"), 2), fmt(m.get("mean_output_tokens"), 1),
                     json.dumps(m.get("finish_reasons"))])
    if not rows:
        return ""
    return ("## JSON-schema-constrained decoding (xgrammar, jump-forward on)\n\n"
            "Three bounded schemas (person, order, event; no free whitespace), requests "
            "submitted at once, greedy on random weights; valid = parses and conforms.\n\n" +
            table(["model", "config", "requests", "valid", "tok/s", "TPOT ms", "mean out tokens",
                   "finish reasons"], rows) + "\n")


def checks_section(db):
    rows = []
    for r in db.recs:
        if r["mode"] in ("check", "integrity", "server_stats"):
            m = r.get("metrics", {})
            detail = {k: m[k] for k in ("identical", "asserted", "tok_per_s_graph", "tok_per_s_eager",
                                        "ok", "integrity_ok", "text") if k in m}
            rows.append([r["system"], r["model"], r["config"], f"{r['mode']}/{r['workload']}", r["status"],
                         json.dumps(detail)[:160]])
    starts = []
    for r in db.recs:
        if r["mode"] == "startup" and r.get("status") == "ok":
            m = r["metrics"]
            starts.append([r["system"], r["model"], r["config"],
                           fmt(m.get("init_s", m.get("load_s", m.get("ready_s"))), 1),
                           fmt(m.get("warmup_s"), 1), fmt(m.get("kv_pool_tokens"))])
    out = ""
    if rows:
        out += "## Checks\n\n" + table(["system", "model", "config", "check", "status", "detail"], rows) + "\n\n"
    if starts:
        out += "## Start-up\n\n" + table(["system", "model", "config", "init / load / ready s", "warm-up s",
                                          "KV pool tokens"], starts) + "\n"
    return out


def not_measured_section(db):
    rows = [[r["key"], r["status"], (r.get("error") or "").splitlines()[0][:160] if r.get("error") else ""]
            for r in sorted(db.recs, key=lambda r: r["key"]) if r.get("status") not in ("ok",)]
    if not rows:
        return "## Not measured\n\nEverything planned was measured.\n"
    return "## Not measured or incomplete\n\n" + table(["item", "status", "reason"], rows) + "\n"
