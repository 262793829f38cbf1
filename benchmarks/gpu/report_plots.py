"""The report's PNG plots (matplotlib; none when it is missing)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from report_db import (ANCHORS, MODEL_ORDER, PREFIX_WORKLOADS, ROW_ORDER,  # noqa: E402
                       SYSTEM_STYLE, _parse_row, online_systems)

# every plot plots() can draw, in its order
PLOT_FILES = ("offline_throughput.png", "throughput_vs_rate.png", "ttft_vs_rate.png",
              "tpot_vs_rate.png", "cache_hit_rate.png", "hbm_fraction.png")


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
