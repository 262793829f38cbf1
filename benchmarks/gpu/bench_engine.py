"""In-process engine benchmark: one engine configuration per process, JSON lines out.

    python benchmarks/gpu/bench_engine.py --model /tmp/shapes/llama-1b --out results.jsonl \
        [--modes offline,hbm,prefix,online,json] [--no-radix-cache] [--no-overlap] \
        [--no-cuda-graph] [--prefix-workloads few-shot] [--engine-arg quantization=fp8 \
        --config-name fp8] [--budget-s 200] [--done earlier.jsonl ...]
    python benchmarks/gpu/bench_engine.py --model models/default --device cpu --quick

Modes (each item appends one line to --out; an item that would not fit the budget is
recorded as ``skipped``, one that fails as ``error``, and the next item still runs):
  offline  batches submitted at once (the anchor rows); output tok/s, TTFT/TPOT
  hbm      device copy bandwidth, then steady decode at batch 1 and 64: bytes of weights
           and KV read per step / step time, as a fraction of the copy bandwidth; also the
           scheduler's CPU time per step (Scheduler.schedule, timed from outside)
  prefix   few-shot 64 x (1024 shared + 32)/64, multi-turn chat, tree-of-thought, each also
           with 8-token answers ("-short"); an untimed pass, then a timed one: tok/s,
           cache hit rate and its ratio to the best possible (workloads.BestHitTracker)
  online   Poisson arrivals at several rates for 32/128 and 256/32; TTFT, TPOT, latency
           p50/p90/p99, throughput
  json     JSON-schema-constrained decoding (jump-forward as configured): tok/s, validity
Requests are driven from this thread: arrivals due are added between ``step()`` calls, as
a server loop would pick them up; times are taken when ``step()`` hands tokens back.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402


# ----------------------------------------------------------------------------- driver
def drive(eng, arrivals, prompts, params, *, deadline_s=None, step_log=None,
          keep_tokens=False, keep_text=False, stall_s=30.0):
    """Feed requests at their arrival offsets, step the engine until all finish.

    ``params``: one SamplingParams for all or a list. Returns (records, wall seconds).
    Past ``deadline_s`` (offset) unsent requests are dropped and running ones aborted.
    """
    n = len(prompts)
    plist = params if isinstance(params, list) else [params] * n
    reqs = [{"arrival": a, "first": None, "end": None, "n_out": 0, "n_in": len(p), "cached": 0}
            for a, p in zip(arrivals, prompts)]
    by_rid: dict[str, dict] = {}
    t0 = time.perf_counter()
    i = open_ = 0
    aborted = False
    last_progress = t0
    while True:
        now = time.perf_counter() - t0
        while i < n and arrivals[i] <= now:
            r = reqs[i]
            try:
                # text every step only when it is read (as the server does for a client
                # that asks for output ids alone)
                rid = eng.add_request(prompts[i], plist[i], stream=keep_text)
            except ValueError as exc:
                r["error"] = f"rejected: {exc}"
                i += 1
                continue
            by_rid[rid] = r
            if keep_tokens:
                r["tokens"] = []
            if keep_text:
                r["text"] = ""
            i += 1
            open_ += 1
        if open_ == 0 and i >= n:
            break
        if deadline_s is not None and now > deadline_s and not aborted:
            aborted = True
            for rid, r in by_rid.items():
                if r["end"] is None:
                    eng.abort(rid)
            for j in range(i, n):
                reqs[j]["error"] = "not sent: past the deadline"
            i = n
        if eng.has_work():
            outs = eng.step()
            t = time.perf_counter() - t0
            ntok = 0
            for o in outs:
                r = by_rid.get(o.request_id)
                if r is None:
                    continue
                k = len(o.new_token_ids)
                if k:
                    ntok += k
                    if r["first"] is None:
                        r["first"] = t
                    if keep_tokens:
                        r["tokens"].extend(o.new_token_ids)
                if keep_text and o.new_text:
                    r["text"] += o.new_text
                if o.finished and r["end"] is None:
                    r["end"] = t
                    r["n_out"] = o.num_output_tokens
                    r["cached"] = o.num_cached_tokens
                    r["finish_reason"] = o.finish_reason
                    if o.finish_reason == "abort":
                        r["error"] = "aborted (deadline)" if aborted else "aborted"
                    if getattr(o, "error", None):
                        r["error"] = o.error
                    open_ -= 1
            if outs:
                last_progress = time.perf_counter()
            if step_log is not None:
                step_log.append((t, ntok))
        elif i < n:
            wait = arrivals[i] - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(min(wait, 0.02))
            last_progress = time.perf_counter()
        else:
            time.sleep(0.0005)
        if time.perf_counter() - last_progress > stall_s:
            for r in reqs:
                if r["end"] is None and not r.get("error"):
                    r["error"] = f"stalled: no output for {stall_s:.0f} s"
            break
    for r in reqs:
        r.pop("rid", None)
    return reqs, time.perf_counter() - t0


class ChildEngine:
    """The engine in a child process (``backend.engine_process``, as the Triton backend runs
    it on a GPU) behind the calls ``drive`` makes: the in-process rows without Triton, to
    tell the child's own cost from the stub's."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self._ids = itertools.count()
        self._open: dict[str, int] = {}  # request id -> samples not finished yet

    def add_request(self, prompt, params=None, request_id=None, stream=True):
        from backend.core import GenerateRequest, SamplingParams

        rid = request_id or f"r{next(self._ids)}"
        params = params or SamplingParams()
        self._open[rid] = params.n
        self.proc.submit(GenerateRequest(rid, prompt, params, stream))
        return rid

    def has_work(self):
        return bool(self._open)

    def step(self):
        outputs = self.proc.next_outputs(0.05).outputs
        for o in outputs:
            if o.finished and o.request_id in self._open:
                self._open[o.request_id] -= 1
                if self._open[o.request_id] <= 0 or o.error:
                    del self._open[o.request_id]
        return outputs

    def abort(self, rid):
        self.proc.abort(rid)

    def stats(self):
        return self.proc.stats()


def greedy(sp_cls, n_out, **kw):
    return sp_cls(max_new_tokens=n_out, temperature=0.0, ignore_eos=True, **kw)


def reset_cache(eng):
    try:
        eng.cache.reset()
    except Exception:
        pass


def sync(torch, device):
    if torch is not None and device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- modes
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


def copy_bandwidth(torch, device, nbytes):
    """Device-to-device copy: bytes read + written per second (torch copy_)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    iters = 10
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        sec = s.elapsed_time(e) / 1e3
    else:
        t = time.perf_counter()
        for _ in range(iters):
            b.copy_(a)
        sec = time.perf_counter() - t
    del a, b
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return 2 * nbytes * iters / sec


def weight_bytes(eng, batch):
    """(bytes of all parameters, bytes read by one decode step of ``batch`` requests).

    A step reads every weight once, except an untied input embedding, of which it reads
    only the ``batch`` rows it looks up (a tied one is read whole by the LM head)."""
    model = eng.runner.model
    total = 0
    embed = None
    for name, p in model.named_parameters():  # tied weights are listed once
        total += p.numel() * p.element_size()
        if "embed_tokens" in name and p.dim() == 2:
            embed = p
    read = total
    tied = bool(getattr(eng.hf_config, "tie_word_embeddings", False))
    if embed is not None and not tied:
        read = total - embed.numel() * embed.element_size() + batch * embed.shape[1] * embed.element_size()
    return total, read


def kv_bytes_per_token(eng):
    pool = eng.runner.kv_pool
    per = 0
    for buf in list(pool.k_buffer) + list(getattr(pool, "v_buffer", pool.k_buffer)):
        per += buf[0].numel() * buf.element_size()
    return per


class SchedTimer:
    """Times Scheduler.schedule (radix matching, admission, allocation) from outside.

    Each call is also recorded with what it scheduled, so decode steps (every item one
    token of a running request) can be told from the few admission steps, which match
    and allocate whole prompts and would otherwise dominate a mean over all calls."""

    def __init__(self, eng):
        self.sched = eng.scheduler
        self.orig = self.sched.schedule
        self.total = 0.0
        self.calls = 0
        self.decode_calls: dict[int, list[float]] = {}  # batch size -> seconds per call

        def timed(*a, **k):
            t = time.perf_counter()
            items = None
            try:
                plan = self.orig(*a, **k)
                items = plan.items
                return plan
            finally:
                dt = time.perf_counter() - t
                self.total += dt
                self.calls += 1
                if items and all(i.num_new == 1 and i.req.output_ids for i in items):
                    self.decode_calls.setdefault(len(items), []).append(dt)

        self.sched.schedule = timed

    def decode_stats(self, batch: int) -> dict:
        """schedule() seconds over the decode steps of ``batch`` requests."""
        ts = sorted(self.decode_calls.get(batch, []))
        if not ts:
            return {}
        return {"n": len(ts), "mean": statistics.fmean(ts), "p50": ts[len(ts) // 2],
                "p90": ts[min(len(ts) - 1, int(0.9 * len(ts)))], "max": ts[-1]}

    def close(self):
        try:
            del self.sched.schedule  # back to the class method
        except AttributeError:
            pass


def steady_decode(step_log, batch, n_in):
    """Median and mean step time over steps where every request got exactly one token,
    trimming the first and last 10%; also the mean context length over those steps."""
    idx = [i for i, (_, k) in enumerate(step_log) if k == batch]
    if len(idx) < 4:
        return None
    cut = max(1, len(idx) // 10)
    idx = idx[cut:-cut] if len(idx) > 2 * cut + 2 else idx
    deltas = [step_log[i][0] - step_log[i - 1][0] for i in idx if i > 0 and step_log[i - 1][1] == batch]
    if not deltas:
        return None
    # tokens generated per request before step i = number of token-bearing steps before it
    seen, ctx_at = 0, {}
    for i, (_, k) in enumerate(step_log):
        if k:
            seen += 1
        ctx_at[i] = n_in + seen
    mean_ctx = statistics.fmean(ctx_at[i] for i in idx)
    return {"step_s_median": statistics.median(deltas), "step_s_mean": statistics.fmean(deltas),
            "steps": len(deltas), "mean_ctx": mean_ctx}


def mode_hbm(ctx):
    eng, rec, args, budget, SP, torch = (ctx[k] for k in ("eng", "rec", "args", "budget", "SP", "torch"))
    bw = ctx.get("copy_bw")
    if bw is None:
        bw = copy_bandwidth(torch, args.device, (64 << 20) if args.quick else (2 << 30))
    rec.write("copy_bw", "d2d_copy", {"copy_bw_TBps": round(bw / 1e12, 4), "copy_bw_Bps": bw,
                                      "bytes": (64 << 20) if args.quick else (2 << 30)})
    n_in, n_out = (16, 48) if args.quick else (512, 160)
    kv_tok = kv_bytes_per_token(eng)
    for b in ((1, 8) if args.quick else (1, 64)):
        name = f"decode_b{b}_in{n_in}"
        if rec.is_done("hbm", name):
            continue
        if not budget.allows(ctx["min_item_s"]):
            rec.write("hbm", name, status="skipped", error="time budget")
            continue
        try:
            reset_cache(eng)
            prompts = C.random_prompts(b, n_in, C.hash_seed("hbm", b))
            step_log: list = []
            timer = SchedTimer(eng)
            try:
                sync(torch, args.device)
                reqs, wall = drive(eng, [0.0] * b, prompts, greedy(SP, n_out), step_log=step_log)
            finally:
                timer.close()
            st = steady_decode(step_log, b, n_in)
            if st is None:
                rec.write("hbm", name, status="error", error="no steady decode steps found",
                          metrics={"steps_logged": len(step_log)})
                continue
            dec = timer.decode_stats(b)
            w_all, w_read = weight_bytes(eng, b)
            kv = b * st["mean_ctx"] * kv_tok
            step_s = st["step_s_median"]
            achieved = (w_read + kv) / step_s
            m = {
                "batch": b, "n_in": n_in, "n_out": n_out, "step_ms": round(step_s * 1e3, 4),
                "step_ms_mean": round(st["step_s_mean"] * 1e3, 4), "steady_steps": st["steps"],
                "mean_ctx": round(st["mean_ctx"], 1), "weight_bytes_all": w_all,
                "weight_bytes_read": w_read, "kv_bytes_read": int(kv),
                "kv_bytes_per_token": kv_tok, "achieved_TBps": round(achieved / 1e12, 4),
                "copy_bw_TBps": round(bw / 1e12, 4), "hbm_fraction": round(achieved / bw, 4),
                "decode_tok_per_s": round(b / step_s, 1),
                # the bound: batch-1 tok/s if a step only streamed all weights
                "bound_tok_per_s_weights_all": round(bw / w_all, 1),
                # None when the engine does not call Scheduler.schedule through the instance.
                # Per call: the mean over every call, admission steps included
                "sched_ms_per_call": round(timer.total / timer.calls * 1e3, 4) if timer.calls else None,
                "sched_calls": timer.calls, "steps_logged": len(step_log),
                "sched_fraction_all_calls": round(timer.total / timer.calls / step_s, 4) if timer.calls else None,
                # per decode step (all b requests decoding): the target's measure
                "sched_decode_calls": dec.get("n", 0),
                **{f"sched_ms_decode_{k}": round(dec[k] * 1e3, 4) for k in ("mean", "p50", "p90", "max") if k in dec},
                "sched_fraction_of_step": round(dec["mean"] / step_s, 4) if dec else None,
                **{k: v for k, v in C.summarize(reqs).items() if k in ("ttft_ms", "tpot_ms", "output_tok_per_s")},
            }
            rec.write("hbm", name, m)
        except Exception as exc:  # noqa: BLE001
            rec.write("hbm", name, status="error", error=C.error_text(exc))


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


JSON_SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"}},
        "required": ["name", "age", "active"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "priority": {"enum": ["low", "normal", "high"]}},
        "required": ["id", "items", "priority"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "day": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["work", "home", "travel", "misc"]}},
        "confirmed": {"type": "boolean"}},
        "required": ["title", "day", "tags", "confirmed"], "additionalProperties": False},
}


def conforms(value, schema) -> bool:
    """Enough of JSON Schema for JSON_SCHEMAS (jsonschema is not on the GPU machine)."""
    if "enum" in schema:
        return value in schema["enum"]
    t = schema.get("type")
    if t == "object":
        if not isinstance(value, dict):
            return False
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(conforms(value[k], props[k]) for k in value if k in props)
    if t == "array":
        return isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30) \
            and all(conforms(v, schema.get("items", {})) for v in value)
    if t == "string":
        import re
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30) \
            and (("pattern" not in schema) or re.search(schema["pattern"], value) is not None)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool) \
            and schema.get("minimum", -1 << 62) <= value <= schema.get("maximum", 1 << 62)
    if t == "boolean":
        return isinstance(value, bool)
    return True


def mode_json(ctx):
    eng, rec, args, budget, SP = ctx["eng"], ctx["rec"], ctx["args"], ctx["budget"], ctx["SP"]
    name = "3schemas"
    if rec.is_done("json", name):
        return
    if not budget.allows(ctx["min_item_s"]):
        rec.write("json", name, status="skipped", error="time budget")
        return
    try:
        per = 2 if args.quick else 32
        n_out = 192
        names = list(JSON_SCHEMAS)
        texts = {k: json.dumps(v) for k, v in JSON_SCHEMAS.items()}
        # compile once, untimed (and warm the constrained path)
        t = time.perf_counter()
        warm = C.random_prompts(len(names), 16, C.hash_seed("json-warm"))
        drive(eng, [0.0] * len(names), warm,
              [SP(max_new_tokens=n_out, temperature=0.0, json_schema=texts[k]) for k in names])
        compile_and_warm_s = time.perf_counter() - t
        kinds = [names[i % len(names)] for i in range(per * len(names))]
        prompts = C.random_prompts(len(kinds), 32, C.hash_seed("json"))
        params = [SP(max_new_tokens=n_out, temperature=0.0, json_schema=texts[k]) for k in kinds]
        reset_cache(eng)
        reqs, wall = drive(eng, [0.0] * len(kinds), prompts, params, keep_text=True)
        m = C.summarize(reqs)
        valid, per_schema = 0, {}
        for k, r in zip(kinds, reqs):
            ok = False
            try:
                ok = conforms(json.loads(r.get("text", "")), JSON_SCHEMAS[k])
            except (ValueError, TypeError):
                ok = False
            valid += ok
            s = per_schema.setdefault(k, {"n": 0, "valid": 0, "out_tokens": 0})
            s["n"] += 1
            s["valid"] += ok
            s["out_tokens"] += r["n_out"]
        reasons: dict = {}
        for r in reqs:
            reasons[r.get("finish_reason")] = reasons.get(r.get("finish_reason"), 0) + 1
        m.update(valid_fraction=round(valid / len(reqs), 4), per_schema=per_schema,
                 finish_reasons=reasons, compile_and_warm_s=round(compile_and_warm_s, 3),
                 jump_forward=getattr(eng.config, "enable_jump_forward", None),
                 mean_output_tokens=round(m["output_tokens"] / max(m["n_completed"], 1), 2),
                 sample_text=(reqs[0].get("text") or "")[:200])
        rec.write("json", name, m, status="ok" if m["n_completed"] == len(reqs) else "truncated")
    except Exception as exc:  # noqa: BLE001
        rec.write("json", name, status="error", error=C.error_text(exc))


MODES = {"offline": mode_offline, "hbm": mode_hbm, "prefix": mode_prefix,
         "online": mode_online, "json": mode_json}



def config_name(args) -> str:
    if args.config_name:
        return args.config_name
    parts = [p for flag, p in ((args.no_radix_cache, "cache-off"), (args.no_overlap, "overlap-off"),
                               (args.no_cuda_graph, "no-graph"),
                               (args.engine_process, "engine-process")) if flag]
    return "+".join(parts) or "default"


def warmup_batches(quick: bool) -> list[tuple[list[list[int]], int]]:
    """The untimed warm-up, as (prompts, output tokens) batches submitted one after the
    other: the shapes the modes use, then prompts behind a cached 1,024-token prefix (prefix
    hits take the extend kernel's prefix path). vllm_peer.py warms vLLM with the same."""
    shapes = [(1, 8, 4), (4, 8, 4)] if quick else [(1, 32, 8), (32, 32, 8), (128, 32, 8),
                                                   (64, 256, 8), (8, 512, 8)]
    out = [(C.random_prompts(b, n_in, C.hash_seed("warm", b, n_in)), n_out) for b, n_in, n_out in shapes]
    shared = C.random_prompts(1, 64 if quick else 1024, C.hash_seed("warm-prefix"))[0]
    for j in range(2):
        tails = C.random_prompts(4, 8, C.hash_seed("warm-tail", j))
        out.append(([shared + tl for tl in tails], 4))
    return out


def warmup(eng, SP, args, torch):
    """Trigger kernel compilation for the shapes the modes use (untimed)."""
    t = time.perf_counter()
    for prompts, n_out in warmup_batches(args.quick):
        drive(eng, [0.0] * len(prompts), prompts, greedy(SP, n_out))
    reset_cache(eng)
    sync(torch, args.device)
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(ap)
    ap.add_argument("--modes", default="offline,hbm,prefix,online,json")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--no-radix-cache", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--rep-gap-s", type=float, default=0.0,
                    help="offline rows: idle this long before each run (bench_triton's runs "
                         "start after ~1 s of idle while the client processes start)")
    ap.add_argument("--rep-gap-spin", action="store_true",
                    help="spend --rep-gap-s spinning on the host instead of asleep")
    ap.add_argument("--config-name", default=None, help="label (default from the flags)")
    ap.add_argument("--prefix-workloads", default=None,
                    help="comma list of prefix workloads (default all: few-shot, multi-turn, "
                         "tree-of-thought and their -short forms)")
    ap.add_argument("--online-shapes", default=None,
                    help="comma list of online shapes (default all: in32_out128,in256_out32)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the engine in a child process, as the Triton backend runs it "
                         "(offline and online modes)")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="extra EngineConfig field, KEY=VALUE (repeatable)")
    args = ap.parse_args(argv)
    budget = C.Budget(args.budget_s)
    label = args.name or C.model_label(args.model)
    cfg_name = config_name(args)
    log(f"bench_engine: model={label} config={cfg_name} modes={args.modes} budget={args.budget_s}s")

    import torch
    from backend.core import Engine, EngineConfig, SamplingParams

    flags = {"radix_cache": not args.no_radix_cache, "overlap": not args.no_overlap,
             "cuda_graph": not args.no_cuda_graph}
    rec = C.Recorder(args.out, "engine", label, cfg_name, flags, C.load_done(args.done),
                     extra={"quick": args.quick, "device": args.device})
    modes = [m for m in args.modes.split(",") if m]
    on_cuda = args.device.startswith("cuda")
    ctx = {"rec": rec, "args": args, "budget": budget, "SP": SamplingParams, "torch": torch,
           "label": label, "min_item_s": 2.0 if args.quick else 8.0}

    copy_bw = None
    if "hbm" in modes and on_cuda:  # before the engine takes 85% of the memory
        copy_bw = copy_bandwidth(torch, args.device, 2 << 30)
        ctx["copy_bw"] = copy_bw
        log(f"device copy bandwidth {copy_bw / 1e12:.3f} TB/s")

    kw = dict(model_path=args.model, device=args.device,
              dtype=args.dtype or ("bfloat16" if on_cuda else "float32"), load_format="dummy",
              enable_radix_cache=not args.no_radix_cache, schedule_policy="lpm",
              max_total_tokens=None if on_cuda else 32768, max_running_requests=256,
              max_prefill_tokens=8192, enable_cuda_graph=not args.no_cuda_graph,
              enable_overlap=not args.no_overlap,
              attention_backend="auto", enable_jump_forward=True)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for item in args.engine_arg:
        k, _, v = item.partition("=")
        kw[k] = _parse_value(v)
    missing = [k for k in kw if k not in fields]
    if missing:
        log(f"warning: EngineConfig has no field(s) {missing}; ignored")
    kw = {k: v for k, v in kw.items() if k in fields}
    try:
        t = time.perf_counter()
        if args.engine_process:
            from backend.engine_process import EngineProcess

            modes = [m for m in modes if m in ("offline", "online")]
            eng = ChildEngine(EngineProcess(EngineConfig(**kw)))
            ctx["torch"] = torch = None  # CUDA lives in the child: no context here
        else:
            eng = Engine(EngineConfig(**kw))
        sync(torch, args.device)
        init_s = time.perf_counter() - t
        warm_s = warmup(eng, SamplingParams, args, torch)
        gc.collect()  # as the serving processes do: what is loaded stays out of the collector
        gc.freeze()
        pool_tokens = eng.stats()["kv_tokens_total"]
        st = {"init_s": round(init_s, 2), "warmup_s": round(warm_s, 2),
              "kv_pool_tokens": pool_tokens, "engine_config": kw}
        if torch is not None:
            st["torch"] = torch.__version__
        if on_cuda and torch is not None:
            st.update(gpu=torch.cuda.get_device_name(), mem_allocated_GiB=round(torch.cuda.memory_allocated() / 2**30, 2),
                      mem_reserved_GiB=round(torch.cuda.memory_reserved() / 2**30, 2))
        rec.write("startup", "engine", st)
        log(f"engine ready: init {init_s:.1f}s, warmup {warm_s:.1f}s, KV pool {pool_tokens} tokens")
    except Exception as exc:  # noqa: BLE001
        rec.write("startup", "engine", status="error", error=C.error_text(exc))
        return 1
    ctx["eng"] = eng
    for mode in modes:
        if mode not in MODES:
            log(f"unknown mode {mode}; known: {sorted(MODES)}")
            continue
        t = time.perf_counter()
        log(f"mode {mode}: start ({budget.left():.0f}s of budget left)")
        try:
            MODES[mode](ctx)
        except Exception as exc:  # noqa: BLE001
            rec.write(mode, "all", status="error", error=C.error_text(exc))
        log(f"mode {mode}: {time.perf_counter() - t:.1f}s")
        gc.collect()
    if isinstance(eng, ChildEngine):
        eng.proc.close()
    log(f"bench_engine done in {budget.elapsed():.1f}s")
    return 0


def _parse_value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


if __name__ == "__main__":
    sys.exit(main())
