"""What the benchmark report knows: the speed anchors and targets, the items of the published
runs indexed for lookup (``DB``), and the formatting its tables share."""
from __future__ import annotations

import math
import re
from collections import defaultdict

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


def _ident(r):
    return (r["system"], r["model"], r["config"], r["mode"], r["workload"], _rate(r.get("rate")))


def _order(r):
    """Tables list items by system, model, configuration, mode, workload, rate."""
    model = MODEL_ORDER.index(r["model"]) if r["model"] in MODEL_ORDER else len(MODEL_ORDER)
    return (r["system"], model, r["model"], r["config"], r["mode"], r["workload"],
            _rate(r.get("rate")) or 0.0)


class DB:
    def __init__(self, recs, all_ok=()):
        self.recs = sorted(recs, key=_order)
        self.idx = {}
        for r in recs:
            self.idx[_ident(r)] = r
        # every ok line, not only the latest per item: ratios pair lines of one run
        self.by_ident: dict[tuple, list[dict]] = defaultdict(list)
        for r in sorted(all_ok, key=lambda r: r.get("ts", "")):
            self.by_ident[_ident(r)].append(r)

    def paired(self, a, b, field="output_tok_per_s"):
        """(value of a, value of b, note) from the latest run that has both items: each run
        may get another machine instance, whose host CPU moves the host-bound rows by tens
        of percent. Else the latest of each, noted so."""
        in_run = {r.get("_run"): r for r in self.by_ident.get(b, [])}
        for ra in reversed(self.by_ident.get(a, [])):
            rb = in_run.get(ra.get("_run"))
            va = ra.get("metrics", {}).get(field)
            vb = rb.get("metrics", {}).get(field) if rb else None
            if va and vb:
                return va, vb, f"same run: {ra['_run']}"
        va = self.metric(*a[:5], field=field, rate=a[5])
        vb = self.metric(*b[:5], field=field, rate=b[5])
        return va, vb, "different runs"

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


def table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _parse_row(w):
    m = re.match(r"b(\d+)_in(\d+)_out(\d+)", w)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (None, None, None)


def online_systems(db, model):
    out = [("engine", "default"), ("triton", "default"), ("triton", "instances-2"), ("hf", None),
           ("engine", "overlap-off")]
    return [s for s in out if any(r["model"] == model and r["mode"] == "online" and r["system"] == s[0]
                                  and (s[1] is None or r["config"] == s[1]) for r in db.recs)]


def _label(system, cfg):
    for (s, c), (lab, _) in SYSTEM_STYLE.items():
        if s == system and (c is None or c == cfg):
            return lab
    return f"{system} {cfg}"


def _yes(ok):
    return "yes" if ok else "**no**"
