"""bench_engine's ``hbm`` mode: device copy bandwidth, then steady decode at two batch sizes
(bytes of weights and KV read per step over the step time), with the scheduler's CPU time
per step timed from outside."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from engine_driver import drive, greedy, reset_cache, sync  # noqa: E402


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
