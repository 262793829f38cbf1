"""transformers ``generate`` with static batches: the baseline of the DJL table.

    python benchmarks/gpu/bench_hf.py --model /tmp/shapes/llama-1b --out results.jsonl \
        [--modes offline,online] [--max-batch 64] [--budget-s 150]
    python benchmarks/gpu/bench_hf.py --model /tmp/shapes/default --device cpu --quick

The model is built from its config with random weights, in bf16, directly on the GPU
(``AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)`` under ``torch.device``).
Greedy, exactly ``n_out`` new tokens (``min_new_tokens``), the default dynamic KV cache.
Prompts are the same random ids as the engine's (same seeds), all of one length, so no
padding is needed.

offline: each anchor row as one ``generate`` call; TTFT from a streamer (the time of
         the first generated token), TPOT = (end - first) / (n_out - 1).
online:  dynamic batching: requests arrive as in bench_engine's Poisson streams (same
         seeds and counts); whenever the model is idle it takes up to --max-batch waiting
         requests as one static batch and runs it to completion. A batch's duration and
         first-token time depend only on its size and the workload shape, so each size is
         measured with a real ``generate`` (lazily, at sizes 1, 4, 16, 64 and those measured
         offline, linearly interpolated in between), and the queue is replayed on a virtual clock
         with those measured times instead of sleeping between arrivals. Every request's
         TTFT/latency includes its wait for the batch in front of it.
Rows that do not fit the budget are recorded as skipped (with the estimate).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402


class FirstToken:
    """Streamer: ``put`` is called with the prompt, then with each step's new tokens."""

    def __init__(self):
        self.calls = 0
        self.t_first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.t_first = time.perf_counter()

    def end(self):
        pass


class HF:
    def __init__(self, model_dir, device, dtype_name):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.torch = torch
        self.device = device
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype_name]
        cfg = AutoConfig.from_pretrained(model_dir)
        t = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model = model.to(device=device, dtype=dtype).eval()
        self.model = model
        self.load_s = time.perf_counter() - t
        self.cfg = cfg
        self.attn = getattr(model.config, "_attn_implementation", None)

    def sync(self):
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def run(self, prompts, n_out):
        """One static batch; returns (seconds, first-token seconds, new tokens per row)."""
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        streamer = FirstToken()
        self.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_out,
                                      min_new_tokens=n_out, do_sample=False, num_beams=1,
                                      pad_token_id=0, streamer=streamer)
        self.sync()
        t1 = time.perf_counter()
        first = (streamer.t_first - t0) if streamer.t_first else (t1 - t0)
        return t1 - t0, first, int(out.shape[1] - ids.shape[1])


def offline_rows(hf, rec, args, budget, timings):
    rows = C.QUICK_OFFLINE_ROWS if args.quick else C.OFFLINE_ROWS
    per_tok = timings.get("_per_token_s_b1", 0.05)
    for b, n_in, n_out in rows:
        name = C.offline_name(b, n_in, n_out)
        if rec.is_done("offline", name):
            continue
        est = per_tok * n_out * (1.0 + b / 256) + 1.0  # HF is overhead-bound at these sizes
        if not budget.allows(est + 2.0):
            rec.write("offline", name, status="skipped", error=f"time budget (estimate {est:.0f}s)",
                      metrics={"estimate_s": round(est, 1)})
            continue
        try:
            prompts = C.random_prompts(b, n_in, C.hash_seed("offline", name, 0))
            dur, first, got = hf.run(prompts, n_out)
            shape = _shape_of(n_in, n_out)
            if shape:
                timings.setdefault(shape, {})[b] = (dur, first)
            reqs = [{"arrival": 0.0, "first": first, "end": dur, "n_out": got, "n_in": n_in}] * b
            m = C.summarize(reqs, duration_s=dur)
            m.update(batch=b, n_in=n_in, n_out=n_out, new_tokens_per_row=got)
            rec.write("offline", name, m, status="ok" if got == n_out else "truncated")
        except Exception as exc:  # noqa: BLE001
            rec.write("offline", name, status="error", error=C.error_text(exc))
            _free(hf)


def _shape_of(n_in, n_out):
    for name, (i, o) in {**C.ONLINE_SHAPES, **C.QUICK_ONLINE_SHAPES}.items():
        if (i, o) == (n_in, n_out):
            return name
    return None


class BatchTimes:
    """Duration and first-token time of a static batch of size b, measured lazily at grid
    sizes and linearly interpolated between them."""

    def __init__(self, hf, shape, n_in, n_out, max_batch, budget, known):
        self.hf, self.shape, self.n_in, self.n_out = hf, shape, n_in, n_out
        # HF's step time hardly grows with the batch at these sizes (overhead-bound), so a
        # coarse grid interpolates well; sizes measured offline are added to it
        self.grid = sorted({1, max_batch} | {4 ** k for k in range(0, 6) if 4 ** k <= max_batch}
                           | {b for b in known if b <= max_batch})
        self.budget = budget
        self.t = dict(known)  # size -> (duration, first)
        self.measured = set(self.t)
        self.interpolated = set()

    def _measure(self, b):
        if b in self.t:
            return True
        est = self._estimate(b)
        if est is not None and not self.budget.allows(est * 1.5 + 5.0):
            return False
        prompts = C.random_prompts(b, self.n_in, C.hash_seed("hf-batch", self.shape, b))
        dur, first, _ = self.hf.run(prompts, self.n_out)
        self.t[b] = (dur, first)
        self.measured.add(b)
        log(f"hf batch {self.shape} b={b}: {dur:.2f}s (first token {first * 1e3:.0f} ms)")
        return True

    def _estimate(self, b):
        if not self.t:
            return None
        near = min(self.t, key=lambda k: abs(k - b))
        return self.t[near][0] * max(1.0, b / max(near, 1)) ** 0.3

    def __call__(self, b):
        if b in self.t:
            return self.t[b]
        lo = max([g for g in self.grid if g <= b], default=self.grid[0])
        hi = min([g for g in self.grid if g >= b], default=self.grid[-1])
        for g in (lo, hi):
            self._measure(g)
        have = sorted(self.t)
        lo = max([g for g in have if g <= b], default=None)
        hi = min([g for g in have if g >= b], default=None)
        if lo is None or hi is None or lo == hi:
            k = lo if lo is not None else hi
            d, f = self.t[k]
            if k != b:
                self.interpolated.add(b)
            return d, f
        w = (b - lo) / (hi - lo)
        d = self.t[lo][0] * (1 - w) + self.t[hi][0] * w
        f = self.t[lo][1] * (1 - w) + self.t[hi][1] * w
        self.interpolated.add(b)
        return d, f


def simulate(arrivals, n_out, n_in, max_batch, times):
    """Replay a dynamic-batching server on a virtual clock; per-request records."""
    reqs = [None] * len(arrivals)
    v, idx, queue, batches = 0.0, 0, [], []
    n = len(arrivals)
    while idx < n or queue:
        if not queue:
            v = max(v, arrivals[idx])
        while idx < n and arrivals[idx] <= v:
            queue.append(idx)
            idx += 1
        batch, queue = queue[:max_batch], queue[max_batch:]
        d, f = times(len(batch))
        for j in batch:
            reqs[j] = {"arrival": arrivals[j], "first": v + f, "end": v + d, "n_out": n_out, "n_in": n_in}
        batches.append(len(batch))
        v += d
    return reqs, batches


def online_rows(hf, rec, args, budget, timings, label):
    shapes = C.QUICK_ONLINE_SHAPES if args.quick else C.ONLINE_SHAPES
    for shape, (n_in, n_out) in shapes.items():
        rates = C.QUICK_RATES[shape] if args.quick else C.RATES.get(label, C.RATES["llama-8b"])[shape]
        known = {b: v for b, v in timings.get(shape, {}).items() if b <= args.max_batch}
        times = BatchTimes(hf, shape, n_in, n_out, args.max_batch, budget, known)
        for rate in rates:
            if rec.is_done("online", shape, rate):
                continue
            n = C.online_count(rate, args.online_window_s, args.online_max_requests,
                               8 if args.quick else args.online_min_requests)
            arrivals, _ = C.online_schedule(shape, rate, n, n_in)
            try:
                reqs, batches = simulate(arrivals, n_out, n_in, args.max_batch, times)
                m = C.summarize(reqs)
                m.update(n_in=n_in, n_out=n_out, offered_rate=rate, max_batch=args.max_batch,
                         arrival_window_s=round(arrivals[-1], 3), n_batches=len(batches),
                         mean_batch=round(sum(batches) / len(batches), 2),
                         batch_sizes_measured=sorted(times.measured),
                         batch_sizes_interpolated=sorted(times.interpolated),
                         timing_method="per-batch times measured with generate; queue replayed "
                                       "on a virtual clock")
                rec.write("online", shape, m, rate=rate)
            except Exception as exc:  # noqa: BLE001
                rec.write("online", shape, rate=rate, status="error", error=C.error_text(exc))
                _free(hf)


def _free(hf):
    try:
        if hf.device.startswith("cuda"):
            hf.torch.cuda.empty_cache()
    except Exception:
        pass



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(ap)
    ap.add_argument("--modes", default="offline,online")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-batch", type=int, default=64, help="dynamic batching: largest batch")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_batch = min(args.max_batch, 4)
    budget = C.Budget(args.budget_s)
    label = args.name or C.model_label(args.model)
    on_cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    rec = C.Recorder(args.out, "hf", label, f"static-batch-B{args.max_batch}",
                     {"max_batch": args.max_batch, "dtype": dtype}, C.load_done(args.done),
                     extra={"quick": args.quick, "device": args.device})
    log(f"bench_hf: model={label} budget={args.budget_s}s")
    try:
        hf = HF(args.model, args.device, dtype)
        import transformers
        # warm-up (untimed) and a per-token estimate for budgeting
        hf.run(C.random_prompts(1, 8, 1), 4)
        d, _, _ = hf.run(C.random_prompts(1, 32, 2), 16)
        timings = {"_per_token_s_b1": d / 16}
        rec.write("startup", "hf", {"load_s": round(hf.load_s, 2), "attn_implementation": hf.attn,
                                    "transformers": transformers.__version__,
                                    "per_token_s_b1": round(d / 16, 5)})
        log(f"hf ready: load {hf.load_s:.1f}s, ~{d / 16 * 1e3:.1f} ms/token at batch 1")
    except Exception as exc:  # noqa: BLE001
        rec.write("startup", "hf", status="error", error=C.error_text(exc))
        return 1
    modes = args.modes.split(",")
    if "offline" in modes:
        offline_rows(hf, rec, args, budget, timings)
    if "online" in modes:
        online_rows(hf, rec, args, budget, timings, label)
    log(f"bench_hf done in {budget.elapsed():.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
