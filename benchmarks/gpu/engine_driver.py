"""bench_engine's step driver: requests fed to an engine at their arrival offsets between
``step()`` calls, the engine in a child process behind the same calls, and the small helpers
every mode shares (greedy settings, cache reset, device sync)."""
from __future__ import annotations

import itertools
import time


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
