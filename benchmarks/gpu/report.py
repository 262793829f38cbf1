"""Results -> docs/benchmarks/{README.md, results.json, *.png}.

    python benchmarks/gpu/report.py [--results 'benchmarks/gpu/results/*.jsonl' ...]
        [--out-dir docs/benchmarks] [--include-quick]

Reads the JSON lines the benchmark scripts append, keeps one line per item (the latest
``ok`` one, else the latest), and writes: results.json (those lines, grouped), README.md
(tables: anchor rows with the transformers / vLLM anchors, online streams, shared
prefix, decode HBM bandwidth, JSON decoding, the issue-7 targets, what was not measured)
and PNG plots. Anchors are the speed anchors (measured on the same H200 model, 2026-11-30).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

# speed anchors: output tok/s, random bf16 weights, all requests submitted at once
ANCHORS = {
    "llama-1b": {"b1_in32_out128": (14.6, 575), "b32_in32_out128": (624, 12979),
                 "b128_in32_out128": (2354, 35889), "b32_in256_out32": (492, 9933),
                 "few-shot": (None, 19542), "few-shot (cache off)": (None, 9005)},
    "llama-8b": {"b1_in32_out128": (12.4, 201), "b32_in32_out128": (489, 5393),
                 "b128_in32_out128": (2129, 16522), "b32_in256_out32": (403, 2749),
                 "few-shot": (None, 7377), "few-shot (cache off)": (None, 2000)},
}
BOUND_ANCHOR = {"llama-1b": 1712, "llama-8b": 263}  # anchor batch-1 bound, tok/s
BATCH1_TARGET = {"llama-1b": (0.60, 1027), "llama-8b": (0.85, 224)}
MODEL_ORDER = ["llama-1b", "llama-8b", "default", "tiny-llama"]
PREFIX_WORKLOADS = ("few-shot", "multi-turn", "tree-of-thought",
                    "few-shot-short", "multi-turn-short", "tree-of-thought-short")
# bench_triton configurations: one model instance, and two sharing one engine process
TRITON_CONFIGS = (("default", "1 instance"), ("instances-2", "2 instances"))
ROW_ORDER = ["b1_in32_out128", "b32_in32_out128", "b128_in32_out128", "b32_in256_out32"]
SYSTEM_STYLE = {  # label, color
    ("engine", "default"): ("ours (in-process)", "tab:blue"),
    ("triton", "default"): ("ours via Triton gRPC", "tab:orange"),
    ("triton", "instances-2"): ("ours via Triton gRPC, 2 instances", "tab:brown"),
    ("engine", "overlap-off"): ("ours, overlap off", "tab:purple"),
    ("engine", "cache-off"): ("ours, radix cache off", "tab:gray"),
    ("hf", None): ("transformers static batches", "tab:red"),
}


# ----------------------------------------------------------------------------- loading
def load(patterns, include_quick=False):
    recs = []
    for pat in patterns:
        for path in sorted(glob.glob(pat, recursive=True)):
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if rec.get("quick") and not include_quick:
                        continue
                    rec["_file"] = path
                    recs.append(rec)
    load.all_ok = [r for r in recs if r.get("status") == "ok" and r.get("key")]
    best: dict[str, dict] = {}
    for rec in sorted(recs, key=lambda r: r.get("ts", "")):
        k = rec.get("key")
        if not k:
            continue
        old = best.get(k)
        if old is None or rec.get("status") == "ok" or old.get("status") != "ok":
            best[k] = rec
    return list(best.values())


def _ident(r):
    return (r["system"], r["model"], r["config"], r["mode"], r["workload"], _rate(r.get("rate")))


class DB:
    def __init__(self, recs, all_ok=()):
        self.recs = recs
        self.idx = {}
        for r in recs:
            self.idx[_ident(r)] = r
        # every ok line, not only the latest per item: ratios pair lines of one run
        self.by_ident: dict[tuple, list[dict]] = defaultdict(list)
        for r in sorted(all_ok, key=lambda r: r.get("ts", "")):
            self.by_ident[_ident(r)].append(r)

    def paired(self, a, b, field="output_tok_per_s"):
        """(value of a, value of b, note) from the latest results file (one file per
        device call, i.e. one machine instance) that has both items: each call may get
        another instance, whose host CPU moves the host-bound rows by tens of percent.
        Else the latest of each, noted so."""
        in_file = {r.get("_file"): r for r in self.by_ident.get(b, [])}
        for ra in reversed(self.by_ident.get(a, [])):
            rb = in_file.get(ra.get("_file"))
            va = ra.get("metrics", {}).get(field)
            vb = rb.get("metrics", {}).get(field) if rb else None
            if va and vb:
                return va, vb, f"same call: {Path(ra['_file']).stem}"
        va = self.metric(*a[:5], field=field, rate=a[5])
        vb = self.metric(*b[:5], field=field, rate=b[5])
        return va, vb, "different runs"

    def ratios_by_file(self, a, b, since_ts="", field="output_tok_per_s"):
        """[(results file stem, a / b)] for every results file holding both items (lines of
        ``a`` from ``since_ts`` on), oldest first."""
        in_file = {r.get("_file"): r for r in self.by_ident.get(b, [])}
        out = []
        for ra in self.by_ident.get(a, []):
            rb = in_file.get(ra.get("_file"))
            va = ra.get("metrics", {}).get(field)
            vb = rb.get("metrics", {}).get(field) if rb else None
            if va and vb and ra.get("ts", "") >= since_ts:
                out.append((Path(ra["_file"]).stem, va / vb))
        return out

    def get(self, system, model, config, mode, workload, rate=None):
        if config is None:  # any config of this system (hf has one)
            for (s, m, c, mo, w, ra), r in self.idx.items():
                if (s, m, mo, w, ra) == (system, model, mode, workload, _rate(rate)):
                    return r
            return None
        return self.idx.get((system, model, config, mode, workload, _rate(rate)))

    def metric(self, *key, field="output_tok_per_s", rate=None):
        r = self.get(*key, rate=rate)
        if r is None or r.get("status") not in ("ok", "truncated"):
            return None
        return r.get("metrics", {}).get(field)

    def models(self):
        ms = {r["model"] for r in self.recs}
        return [m for m in MODEL_ORDER if m in ms] + sorted(ms - set(MODEL_ORDER))

    def rates(self, model, workload):
        return sorted({_rate(r.get("rate")) for r in self.recs if r["model"] == model
                       and r["mode"] == "online" and r["workload"] == workload and r.get("rate") is not None})


def _rate(r):
    return None if r is None else float(r)


# ----------------------------------------------------------------------------- formatting
def fmt(v, nd=0, unit=""):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, (int, float)):
        if abs(v) >= 100 or nd == 0:
            return f"{v:,.0f}{unit}"
        return f"{v:,.{nd}f}{unit}"
    return str(v)


def ratio(a, b, pct=False):
    if a is None or b in (None, 0):
        return "—"
    return f"{100 * a / b:.0f}%" if pct else f"{a / b:.1f}x"


def pct3(d, nd=1):
    if not isinstance(d, dict):
        return "—"
    return f"{d['p50']:.{nd}f} / {d['p90']:.{nd}f} / {d['p99']:.{nd}f}"


# the first results of the current serving layer (streamed outputs merged as they queue,
# client channels opened before the start): Triton ratios since then are all listed
SERVING_CODE_SINCE = "2026-12-01T05:30"


def table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------- sections
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
    (bench_triton's request timelines), next to the in-process TTFT of the same call."""
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
                same = e if e and e.get("_file") == r.get("_file") else None
                e_ttft.append(fmt(same["metrics"]["ttft_ms"]["p50"], 1) if same else "—")
            rows.append([model, w, *e_ttft, fmt(m["ttft_ms"]["p50"], 1)]
                        + [fmt(parts[k]["p50"], 1) if k in parts else "—"
                           for k, _ in TTFT_PART_LABELS]
                        + [fmt(m.get("responses_per_request", {}).get("p50")),
                           Path(r["_file"]).stem])
    if not rows:
        return ""
    return ("## Through Triton: where the first token's time goes\n\n"
            "p50 over a run's requests, ms. Wall clocks of the client, the stub and the engine "
            "process on one host (`RADIXLM_TRACE_REQUESTS` timelines joined by request id); the "
            "parts add up to the Triton TTFT. In-process TTFT: the same call's engine row, all "
            "requests added at once, right after the previous run or after 1 s idle "
            "(`bench_engine.py --rep-gap-s 1`: a Triton run starts after ~1 s idle while its "
            "client processes start, and the first step after idle is slower). Responses/request: how many streamed responses carried "
            "the 128 or 32 tokens (the stub merges the tokens that queued while a send was in "
            "flight).\n\n"
            + table(["model", "workload", "in-process TTFT", "in-process TTFT after 1 s idle",
                     "Triton TTFT"]
                    + [label for _, label in TTFT_PART_LABELS] + ["responses/request", "call"],
                    rows) + "\n")


def _parse_row(w):
    import re
    m = re.match(r"b(\d+)_in(\d+)_out(\d+)", w)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (None, None, None)


def online_systems(db, model):
    out = [("engine", "default"), ("triton", "default"), ("triton", "instances-2"), ("hf", None),
           ("engine", "overlap-off")]
    return [s for s in out if any(r["model"] == model and r["mode"] == "online" and r["system"] == s[0]
                                  and (s[1] is None or r["config"] == s[1]) for r in db.recs)]


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


def _label(system, cfg):
    for (s, c), (lab, _) in SYSTEM_STYLE.items():
        if s == system and (c is None or c == cfg):
            return lab
    return f"{system} {cfg}"


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
            "after an untimed one (rows from calls before call 29: one run); "
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
    return "## Issue 7 targets: what this run reached\n\n" + table(["target", "measured", "met"], rows) + "\n"


def triton_target_rows(db, model, config, how):
    """Within 10% of in-process through Triton: the offline rows and the highest rate of
    each online shape, the two sides from one call where one has both."""
    rows = []
    for w in ROW_ORDER:
        t, e, note = db.paired(("triton", model, config, "offline", w, None),
                               ("engine", model, "default", "offline", w, None))
        if t and e:
            others = [f"{stem} {100 * r:.0f}%" for stem, r in db.ratios_by_file(
                ("triton", model, config, "offline", w, None),
                ("engine", model, "default", "offline", w, None), SERVING_CODE_SINCE)
                if stem not in note]
            also = f"; also {', '.join(others)}" if others else ""
            rows.append([f"Triton gRPC, {how}, {w}, {model}: within 10% of in-process",
                         f"{100 * t / e:.0f}% ({note}{also})", _yes(t >= 0.9 * e)])
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


def _yes(ok):
    return "yes" if ok else "**no**"


def not_measured_section(db):
    rows = [[r["key"], r["status"], (r.get("error") or "").splitlines()[0][:160] if r.get("error") else ""]
            for r in sorted(db.recs, key=lambda r: r["key"]) if r.get("status") not in ("ok",)]
    if not rows:
        return "## Not measured\n\nEverything planned was measured.\n"
    return "## Not measured or incomplete\n\n" + table(["item", "status", "reason"], rows) + "\n"


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


METHOD = """## Method

- Models: random bf16 weights (`load_format="dummy"`; transformers `from_config`) with the
  shapes of Llama-3.2-1B and Llama-3.1-8B (`benchmarks/gpu/shapes.py`), the Qwen2 tokenizer
  of `models/default`; prompts are random token ids, identical for every system (same seeds).
- One process per system and configuration; each script appends JSON lines
  (`benchmarks/gpu/results/*.jsonl`); this page is generated by `benchmarks/gpu/report.py`.
- In-process engine (`bench_engine.py`): requests are added between `Engine.step()` calls at
  their arrival times, token times are taken when `step()` returns them.
- Triton (`bench_triton.py`): tritonserver 2.51 (nvidia-pytriton 0.7.0) with the `radixlm`
  Python backend, KIND_GPU, the engine in a child process of the stub; tritonclient gRPC
  aio, one stream per request, `input_ids` INT32, streaming responses; 8 client processes,
  each with its channel open before the start time (results up to call 31 counted each
  process's connect in its requests' TTFT).
- transformers (`bench_hf.py`): `generate` (greedy, dynamic KV cache, default attention) on
  static batches. Online rows: a dynamic-batching server that runs up to 64 waiting requests
  as one static batch; per-batch durations and first-token times are measured with real
  `generate` calls at batch sizes 1, 4, 16, 64 and the offline ones (linearly interpolated
  between; the line lists which sizes were measured), and the
  queue is replayed on a virtual clock.
- Engine configurations: default (radix cache, overlap scheduling, CUDA graphs on), cache
  off (`enable_radix_cache=False`), overlap off (`enable_overlap=False`).
"""


# ----------------------------------------------------------------------------- plots
def plots(db, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib missing; no plots")
        return []
    made = []
    with_offline = [m for m in db.models() if any(r["model"] == m and r["mode"] == "offline" for r in db.recs)]
    models = [m for m in with_offline if m in ANCHORS] or with_offline

    # 1. offline throughput bars
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(7 * max(len(models), 1), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        have = sorted({r["workload"] for r in db.recs if r["model"] == model and r["mode"] == "offline"},
                      key=lambda w: tuple(x or 0 for x in _parse_row(w)))
        rows_ = ROW_ORDER if model in ANCHORS or not have else have
        series = [("transformers (anchor)", "lightcoral", lambda w: ANCHORS.get(model, {}).get(w, (None, None))[0]),
                  ("transformers (run)", "tab:red", lambda w: db.metric("hf", model, None, "offline", w)),
                  ("vLLM 0.26 (anchor)", "tab:green", lambda w: ANCHORS.get(model, {}).get(w, (None, None))[1]),
                  ("ours", "tab:blue", lambda w: db.metric("engine", model, "default", "offline", w)),
                  ("ours via Triton", "tab:orange", lambda w: db.metric("triton", model, "default", "offline", w)),
                  ("via Triton, 2 instances", "tab:brown",
                   lambda w: db.metric("triton", model, "instances-2", "offline", w)),
                  ("ours, overlap off", "tab:purple", lambda w: db.metric("engine", model, "overlap-off", "offline", w))]
        width = 0.8 / len(series)
        for j, (lab, col, fn) in enumerate(series):
            vals = [fn(w) or 0 for w in rows_]
            ax.bar([i + j * width for i in range(len(rows_))], vals, width, label=lab, color=col)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows_))])
        ax.set_xticklabels([w.replace("_", "\n") for w in rows_], fontsize=8)
        _log(ax, "y")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"offline throughput, {model}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    made.append(_save(fig, out_dir / "offline_throughput.png"))

    # 2. throughput vs rate; 3. latency percentiles vs rate
    online_models = [m for m in db.models() if db.rates(m, "in32_out128") or db.rates(m, "in256_out32")]
    if online_models:
        shapes = list(C.ONLINE_SHAPES)
        fig, axes = plt.subplots(len(online_models), len(shapes), figsize=(12, 4 * len(online_models)), squeeze=False)
        for i, model in enumerate(online_models):
            for j, shape in enumerate(shapes):
                ax = axes[i][j]
                for sysname, cfg in online_systems(db, model):
                    lab, col = SYSTEM_STYLE.get((sysname, cfg), (f"{sysname} {cfg}", None))
                    pts = [(r, db.metric(sysname, model, cfg, "online", shape, rate=r)) for r in db.rates(model, shape)]
                    pts = [(r, v) for r, v in pts if v]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=lab, color=col)
                _log(ax, "xy")
                ax.set_xlabel("offered request rate (req/s)")
                ax.set_ylabel("output tokens/s")
                ax.set_title(f"{model}, {shape}")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        made.append(_save(fig, out_dir / "throughput_vs_rate.png"))

        for metric, fname in (("ttft_ms", "ttft_vs_rate.png"), ("tpot_ms", "tpot_vs_rate.png")):
            fig, axes = plt.subplots(len(online_models), len(shapes), figsize=(12, 4 * len(online_models)), squeeze=False)
            for i, model in enumerate(online_models):
                for j, shape in enumerate(shapes):
                    ax = axes[i][j]
                    for sysname, cfg in online_systems(db, model):
                        lab, col = SYSTEM_STYLE.get((sysname, cfg), (f"{sysname} {cfg}", None))
                        for q, ls in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                            pts = []
                            for r in db.rates(model, shape):
                                d = db.metric(sysname, model, cfg, "online", shape, field=metric, rate=r)
                                if isinstance(d, dict):
                                    pts.append((r, d[q]))
                            if pts:
                                ax.plot(*zip(*pts), ls=ls, marker=".", color=col,
                                        label=f"{lab} {q}" if q == "p50" else None)
                    _log(ax, "xy")
                    ax.set_xlabel("offered request rate (req/s)")
                    ax.set_ylabel(f"{metric.replace('_ms', '').upper()} ms (p50 solid, p90 dashed, p99 dotted)")
                    ax.set_title(f"{model}, {shape}")
                    ax.grid(alpha=0.3)
                    ax.legend(fontsize=7)
            made.append(_save(fig, out_dir / fname))

    # 4. cache hit rate vs best
    pre = [(m, w) for m in db.models() for w in PREFIX_WORKLOADS
           if db.get("engine", m, "default", "prefix", w)]
    if pre:
        fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(pre)), 4.5))
        xs = range(len(pre))
        hit = [db.metric("engine", m, "default", "prefix", w, field="cache_hit_rate") or 0 for m, w in pre]
        best = [db.metric("engine", m, "default", "prefix", w, field="best_hit_rate") or 0 for m, w in pre]
        ax.bar([x - 0.2 for x in xs], hit, 0.4, label="radix cache hit rate", color="tab:blue")
        ax.bar([x + 0.2 for x in xs], best, 0.4, label="best possible", color="tab:gray")
        for x, h, b in zip(xs, hit, best):
            if b:
                ax.text(x, max(h, b) + 0.01, f"{100 * h / b:.0f}%", ha="center", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{m}\n{w}" for m, w in pre], fontsize=7)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("prompt tokens served from cache")
        ax.set_title("cache hit rate vs best possible (label: ratio)")
        ax.legend(fontsize=8)
        made.append(_save(fig, out_dir / "cache_hit_rate.png"))

    # 5. HBM fraction
    hb = [r for r in db.recs if r["mode"] == "hbm" and r.get("status") == "ok" and r["system"] == "engine"]
    if hb:
        hb.sort(key=lambda r: (MODEL_ORDER.index(r["model"]) if r["model"] in MODEL_ORDER else 9, r["config"],
                               r["metrics"]["batch"]))
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(hb)), 4.5))
        vals = [r["metrics"]["hbm_fraction"] for r in hb]
        cols = ["tab:blue" if r["config"] == "default" else "tab:purple" for r in hb]
        ax.bar(range(len(hb)), vals, color=cols)
        for x, v in enumerate(vals):
            ax.text(x, v + 0.01, f"{100 * v:.0f}%", ha="center", fontsize=8)
        ax.axhline(0.6, color="tab:red", ls="--", label="target: 60% at batch 1 (1B)")
        ax.set_xticks(range(len(hb)))
        ax.set_xticklabels([f"{r['model']}\n{r['config']}\nbatch {r['metrics']['batch']}" for r in hb], fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("bytes read per step / step time / copy bandwidth")
        ax.set_title("decode: fraction of measured HBM bandwidth")
        ax.legend(fontsize=8)
        made.append(_save(fig, out_dir / "hbm_fraction.png"))
    return made


def _log(ax, axes):
    """Log scale on the axes that hold positive data (an empty panel stays linear)."""
    has = bool(ax.lines) or any(p.get_height() > 0 for p in ax.patches)
    if has:
        if "x" in axes:
            ax.set_xscale("log")
        if "y" in axes:
            ax.set_yscale("log")


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path.name


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="*", default=[str(C.REPO / "benchmarks/gpu/results/*.jsonl")])
    ap.add_argument("--out-dir", default=str(C.REPO / "docs/benchmarks"))
    ap.add_argument("--include-quick", action="store_true", help="also CPU --quick dry-run lines")
    args = ap.parse_args(argv)
    recs = load(args.results, args.include_quick)
    if not recs:
        print(f"report: no results in {args.results}")
        return 1
    db = DB(recs, load.all_ok)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grouped = defaultdict(list)
    for r in sorted(recs, key=lambda r: r["key"]):
        grouped[r["model"]].append({k: v for k, v in r.items() if not k.startswith("_")})
    (out / "results.json").write_text(json.dumps(grouped, indent=1, default=str))
    figs = plots(db, out)
    runs = sorted({(r.get("run_id"), r.get("git"), r.get("phase")) for r in recs}, key=str)
    gpus = sorted({r["metrics"].get("gpu") for r in recs if r["mode"] == "startup" and r["metrics"].get("gpu")})
    bw = [r["metrics"]["copy_bw_TBps"] for r in recs if r["mode"] == "copy_bw" and r.get("status") == "ok"]
    head = ["# RadixLM benchmarks", "",
            "Generated by `benchmarks/gpu/report.py` from `benchmarks/gpu/results/*.jsonl`; the suite is "
            "`benchmarks/gpu/run_all.sh` (see `benchmarks/gpu/README.md`). Do not edit by hand.", "",
            f"- device: {', '.join(gpus) or 'unknown'}; device copy bandwidth measured: "
            f"{', '.join(f'{b:.2f}' for b in bw) or '—'} TB/s",
            f"- runs (id, git, phase): {', '.join(f'{a} {b} {c}' for a, b, c in runs)}",
            "- each device call may run on another machine instance, and host-bound rows (the 1B "
            "shape at batch >= 32) move by tens of percent between instances: the targets table "
            "takes both sides of a ratio from one results file (one call) where one has both, "
            "and says so; tables below show the latest line of each item",
            "- plots: " + ", ".join(f"[{f}]({f})" for f in figs), ""]
    if any(r.get("quick") for r in recs):
        head.insert(2, "**Includes CPU dry-run (--quick) lines: not performance numbers.**\n")
    body = [targets_section(db), offline_section(db), triton_parts_section(db),
            online_section(db), prefix_section(db),
            hbm_section(db), json_section(db), checks_section(db), not_measured_section(db), METHOD]
    for f in figs:
        body.append(f"![{f}]({f})\n")
    (out / "README.md").write_text("\n".join(head) + "\n" + "\n".join(b for b in body if b))
    print(f"report: {len(recs)} items -> {out}/README.md, results.json, {len(figs)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
