"""bench_engine's ``offline``, ``prefix`` and ``online`` modes: the anchor rows submitted at
once, the shared-prefix workloads (untimed pass, then timed ones), Poisson arrivals."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402
from engine_driver import drive, greedy, reset_cache, sync  # noqa: E402


def idle(seconds: float, spin: bool) -> None:
    """Wait: asleep, or spinning on this thread (the host CPU stays busy, the device idle)."""
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def mode_offline(ctx):
    eng, rec, args, budget, SP = ctx["eng"], ctx["rec"], ctx["args"], ctx["budget"], ctx["SP"]
    rows = C.QUICK_OFFLINE_ROWS if args.quick else C.OFFLINE_ROWS
    for b, n_in, n_out in rows:
        name = C.offline_name(b, n_in, n_out)
        if rec.is_done("offline", name):
            log(f"offline {name}: done earlier, skipped")
            continue
        if not budget.allows(ctx["min_item_s"]):
            rec.write("offline", name, status="skipped", error="time budget")
            continue
        try:
            runs = []
            for rep in range(max(1, args.reps)):
                prompts = C.offline_prompts(name, b, n_in, rep)
                reset_cache(eng)
                sync(ctx["torch"], args.device)
                if args.rep_gap_s:  # idle first, as a served burst arrives after a pause
                    idle(args.rep_gap_s, args.rep_gap_spin)
                reqs, wall = drive(eng, [0.0] * b, prompts, greedy(SP, n_out))
                m = C.summarize(reqs)
                runs.append(m)
                # repeat short rows (median of 3); one run of a long one is enough
                if wall > 5.0 or not budget.allows(wall * 2 + ctx["min_item_s"]):
                    break
            runs.sort(key=lambda m: m["output_tok_per_s"] or 0)
            m = dict(runs[len(runs) // 2])
            m["reps_output_tok_per_s"] = [r["output_tok_per_s"] for r in runs]
            m.update(batch=b, n_in=n_in, n_out=n_out, rep_gap_s=args.rep_gap_s,
                     rep_gap_spin=args.rep_gap_spin)
            rec.write("offline", name, m, status="ok" if m["n_completed"] == b else "truncated")
        except Exception as exc:  # noqa: BLE001
            rec.write("offline", name, status="error", error=C.error_text(exc))


def prefix_workloads(args) -> dict:
    """name -> a function making the workload afresh (a workload keeps per-run state).

    Each shape twice: 64-token answers (chat-like: decode is most of the work) and
    short answers (MMLU/HellaSwag-like few-shot scoring, short chat replies, short
    reasoning steps: the prompt is most of the work, the regime prefix reuse is for)."""
    from workloads import few_shot, multi_turn, tree_of_thought
    v = C.VOCAB_HI
    if args.quick:
        return {"few-shot": lambda: few_shot(v, num_questions=8, shots_tokens=64, question_tokens=8,
                                             new_tokens=4),
                "multi-turn": lambda: multi_turn(v, num_sessions=3, turns=3, system_tokens=32,
                                                 user_tokens=8, new_tokens=4),
                "tree-of-thought": lambda: tree_of_thought(v, branching=2, depth=2, root_tokens=32,
                                                           step_tokens=8, new_tokens=4)}
    out = {}
    for new, suffix in ((64, ""), (8, "-short")):
        out["few-shot" + suffix] = lambda new=new: few_shot(
            v, num_questions=64 if new == 64 else 128, shots_tokens=1024, question_tokens=32,
            new_tokens=new)
        out["multi-turn" + suffix] = lambda new=new: multi_turn(
            v, num_sessions=32, turns=4, system_tokens=512, user_tokens=64, new_tokens=new)
        out["tree-of-thought" + suffix] = lambda new=new: tree_of_thought(
            v, branching=3, depth=3, root_tokens=1024, step_tokens=32, new_tokens=new)
    return out


def selected_prefix_workloads(args) -> dict:
    """prefix_workloads narrowed to ``--prefix-workloads`` (comma list; empty: all)."""
    workloads = prefix_workloads(args)
    wanted = [w for w in (args.prefix_workloads or "").split(",") if w]
    unknown = [w for w in wanted if w not in workloads]
    if unknown:
        raise ValueError(f"unknown prefix workload(s) {unknown}; known: {sorted(workloads)}")
    return {k: v for k, v in workloads.items() if not wanted or k in wanted}


def run_rounds(eng, workload, SP):
    """Run a workload's rounds (each submitted at once); returns metrics."""
    from workloads import BestHitTracker
    tracker = BestHitTracker()
    prev, i = None, 0
    all_reqs, best, t_total, rounds = [], 0, 0.0, 0
    while (reqs := workload.next_round(prev, i)) is not None:
        prompts = [r.prompt for r in reqs]
        best += tracker.round(prompts)
        params = [greedy(SP, r.max_new_tokens) for r in reqs]
        recs, wall = drive(eng, [0.0] * len(reqs), prompts, params, keep_tokens=True)
        for r, o in zip(reqs, recs):
            tracker.finished(r.prompt, o.get("tokens", []))
            o["arrival"] += t_total
            o["first"] = None if o["first"] is None else o["first"] + t_total
            o["end"] = None if o["end"] is None else o["end"] + t_total
        all_reqs += recs
        t_total += wall
        prev, i = [o.get("tokens", []) for o in recs], i + 1
        rounds += 1
    m = C.summarize(all_reqs, duration_s=t_total)
    prompt_tokens = sum(r["n_in"] for r in all_reqs)
    cached = sum(r.get("cached", 0) for r in all_reqs)
    m.update(rounds=rounds, description=workload.description,
             cache_hit_rate=round(cached / prompt_tokens, 4) if prompt_tokens else None,
             best_hit_rate=round(best / prompt_tokens, 4) if prompt_tokens else None,
             hit_rate_vs_best=round(cached / best, 4) if best else None)
    return m


def mode_prefix(ctx):
    eng, rec, args, budget, SP = ctx["eng"], ctx["rec"], ctx["args"], ctx["budget"], ctx["SP"]
    for name, make in selected_prefix_workloads(args).items():
        if rec.is_done("prefix", name):
            continue
        if not budget.allows(ctx["min_item_s"]):
            rec.write("prefix", name, status="skipped", error="time budget")
            continue
        try:
            # an untimed pass first (allocator growth for these shapes), then up to --reps
            # (3) measured ones, the median reported: a 1B-shape run lasts 0.1-0.5 s and one
            # run alone varied by up to 40%. Every pass starts from an empty cache
            reset_cache(eng)
            run_rounds(eng, make(), SP)
            runs = []
            for _ in range(max(1, args.reps)):
                reset_cache(eng)
                sync(ctx["torch"], args.device)
                runs.append(run_rounds(eng, make(), SP))
                if runs[-1]["duration_s"] > 5.0 or not budget.allows(2 * runs[-1]["duration_s"] + 5):
                    break
            runs.sort(key=lambda r: r["output_tok_per_s"] or 0)
            m = dict(runs[len(runs) // 2])
            m["reps_output_tok_per_s"] = [r["output_tok_per_s"] for r in runs]
            rec.write("prefix", name, m, status="ok" if m["n_completed"] == m["n_requests"] else "truncated")
        except Exception as exc:  # noqa: BLE001
            rec.write("prefix", name, status="error", error=C.error_text(exc))
    try:
        eng.check_integrity()
        rec.write("integrity", "after_prefix", {"ok": True})
    except Exception as exc:  # noqa: BLE001
        rec.write("integrity", "after_prefix", {"ok": False}, status="error", error=C.error_text(exc))


def mode_online(ctx):
    eng, rec, args, budget, SP = ctx["eng"], ctx["rec"], ctx["args"], ctx["budget"], ctx["SP"]
    wanted = args.online_shapes.split(",") if args.online_shapes else None
    for shape, rate, n_in, n_out, n, arrivals, prompts in C.online_items(
            rec, args, budget, ctx["label"], ctx["min_item_s"], wanted):
        need = arrivals[-1] + 3.0
        try:
            reset_cache(eng)
            sync(ctx["torch"], args.device)
            # drain allowance: the arrival window plus 2x it, within what is left
            deadline = min(arrivals[-1] * 3 + 20.0, max(budget.left() - ctx["min_item_s"], need))
            reqs, wall = drive(eng, arrivals, prompts, greedy(SP, n_out), deadline_s=deadline)
            m = C.summarize(reqs)
            m.update(n_in=n_in, n_out=n_out, offered_rate=rate,
                     arrival_window_s=round(arrivals[-1], 3), wall_s=round(wall, 3))
            rec.write("online", shape, m, rate=rate,
                      status="ok" if m["n_completed"] == n else "truncated")
        except Exception as exc:  # noqa: BLE001
            rec.write("online", shape, rate=rate, status="error", error=C.error_text(exc))
