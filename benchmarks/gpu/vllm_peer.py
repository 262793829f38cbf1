"""vLLM beside our engine: the same offline and shared-prefix rows, one vLLM configuration
per process, JSON lines in the suite's schema with system "vllm".

    PYTHONPATH=/tmp/vsite:$PYTHONPATH python benchmarks/gpu/vllm_peer.py \\
        --model /tmp/shapes/llama-1b --config async [--modes offline,prefix] \\
        [--prefix-workloads few-shot] --out results.jsonl --budget-s 300 [--done ...]

Configurations, combined with '+' (``fp8+async``): ``default`` (vLLM's own settings),
``async`` (async_scheduling: the host prepares step N+1 while the GPU runs step N),
``fp8`` (quantization="fp8": weights quantized at load, dynamic activation scales),
``kv-fp8`` (kv_cache_dtype="fp8"). vLLM keeps its GPU memory after its engine object is
deleted, so one process measures one configuration (run_all.sh's ``peer`` phase).

The workloads are bench_engine's, from the same definitions: the offline rows with
``common.offline_prompts`` for each measured run, ``bench_engine.selected_prefix_workloads``
for the shared-prefix ones, and ``bench_engine.warmup_batches`` as the untimed warm-up.
Greedy, exactly n_out tokens (ignore_eos), the median of --reps runs; every run starts from
an empty prefix cache (``reset_prefix_cache``), as ours starts from an empty radix cache.
Random weights (``load_format="dummy"``: only config.json is read), no tokenizer.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402

# option -> the LLM(...) arguments it adds; a configuration's name lists its options in
# this order ("fp8+kv-fp8+async")
OPTIONS = {"fp8": {"quantization": "fp8"}, "kv-fp8": {"kv_cache_dtype": "fp8"},
           "async": {"async_scheduling": True}}
# options that change how vLLM schedules, not what it computes with
SCHEDULING_OPTIONS = frozenset({"async"})
LONG_RUN_S = 5.0  # one run of a row this long is enough (as bench_engine decides)


@dataclass(frozen=True)
class PeerConfig:
    name: str  # "default", or the options in OPTIONS order joined by '+'
    llm_kwargs: dict
    # the options that change the arithmetic, named as our rows of the same precision are
    # labelled (--config-name): "default" (bf16), "fp8", "kv-fp8", "fp8+kv-fp8"
    precision: str


def parse_config(text: str) -> PeerConfig:
    parts = [p for p in text.split("+") if p]
    if parts == ["default"]:
        return PeerConfig("default", {}, "default")
    unknown = [p for p in parts if p not in OPTIONS]
    if unknown or not parts or len(set(parts)) != len(parts):
        raise ValueError(f"vLLM configuration {text!r}: options are 'default' alone or "
                         f"distinct ones of {list(OPTIONS)} joined by '+'")
    ordered = [o for o in OPTIONS if o in parts]
    kwargs = {k: v for o in ordered for k, v in OPTIONS[o].items()}
    precision = "+".join(o for o in ordered if o not in SCHEDULING_OPTIONS) or "default"
    return PeerConfig("+".join(ordered), kwargs, precision)


# ----------------------------------------------------------------------------- vLLM calls
class Completion(NamedTuple):
    token_ids: list[int]
    cached_tokens: int | None  # prompt tokens vLLM found in its prefix cache


class VllmRunner:
    """The two calls the measurements make of a ``vllm.LLM`` (a stand-in in the tests)."""

    def __init__(self, llm, sampling_params_cls) -> None:
        self.llm = llm
        self.sampling_params_cls = sampling_params_cls
        self._params: dict[int, object] = {}

    def greedy(self, n_out: int):
        """Exactly n_out tokens: min = max, EOS ignored; token ids only (no tokenizer)."""
        if n_out not in self._params:
            self._params[n_out] = self.sampling_params_cls(
                max_tokens=n_out, min_tokens=n_out, ignore_eos=True, temperature=0.0,
                detokenize=False)
        return self._params[n_out]

    def generate(self, prompts: list[list[int]], n_outs: list[int]) -> list[Completion]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 [self.greedy(n) for n in n_outs], use_tqdm=False)
        # num_cached_tokens: a RequestOutput field of the V1 engine, None where absent
        return [Completion(list(o.outputs[0].token_ids), getattr(o, "num_cached_tokens", None))
                for o in outs]

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


def timed_records(runner: VllmRunner, prompts, n_outs, origin_s: float = 0.0):
    """Run one batch submitted at once: per-request records for common.summarize (all
    arriving at ``origin_s``, ending when generate returns) and the wall seconds."""
    t = time.perf_counter()
    outs = runner.generate(prompts, n_outs)
    wall = time.perf_counter() - t
    recs = []
    for p, n, o in zip(prompts, n_outs, outs):
        r = {"arrival": origin_s, "first": None, "end": origin_s + wall,
             "n_out": len(o.token_ids), "n_in": len(p), "tokens": o.token_ids}
        if o.cached_tokens is not None:
            r["cached"] = o.cached_tokens
        if len(o.token_ids) != n:
            r["error"] = f"returned {len(o.token_ids)} of {n} tokens"
        recs.append(r)
    return recs, wall


def warm_up(runner: VllmRunner, quick: bool) -> float:
    t = time.perf_counter()
    for prompts, n_out in warmup_batches(quick):
        runner.generate(prompts, [n_out] * len(prompts))
    runner.reset_prefix_cache()
    return time.perf_counter() - t


def warmup_batches(quick: bool):
    from bench_engine import warmup_batches as ours
    return ours(quick)


# ----------------------------------------------------------------------------- modes
def measure_offline(runner: VllmRunner, rec, args, budget, min_item_s: float) -> None:
    for name, b, n_in, n_out in C.offline_rows(args.quick):
        if rec.is_done("offline", name):
            continue
        if not budget.allows(min_item_s):
            rec.write("offline", name, status="skipped", error="time budget")
            continue
        try:
            runs = []
            for rep in range(max(1, args.reps)):
                runner.reset_prefix_cache()
                recs, wall = timed_records(runner, C.offline_prompts(name, b, n_in, rep), [n_out] * b)
                runs.append(C.summarize(recs, duration_s=wall))
                if wall > LONG_RUN_S or not budget.allows(wall * 2 + min_item_s):
                    break
            m = C.median_run(runs)
            m.update(batch=b, n_in=n_in, n_out=n_out)
            rec.write("offline", name, m, status="ok" if m["n_completed"] == b else "truncated")
        except Exception as exc:  # noqa: BLE001
            rec.write("offline", name, status="error", error=C.error_text(exc))


def run_rounds(runner: VllmRunner, workload) -> dict:
    """A shared-prefix workload's rounds, each submitted at once (a round may extend the
    previous round's answers: multi-turn chat); metrics over all of them."""
    prev, i, t_total, all_recs = None, 0, 0.0, []
    while (reqs := workload.next_round(prev, i)) is not None:
        recs, wall = timed_records(runner, [r.prompt for r in reqs],
                                   [r.max_new_tokens for r in reqs], origin_s=t_total)
        all_recs += recs
        t_total += wall
        prev, i = [r["tokens"] for r in recs], i + 1
    m = C.summarize(all_recs, duration_s=t_total)
    prompt_tokens = sum(r["n_in"] for r in all_recs)
    m.update(rounds=i, description=workload.description)
    if "cached_tokens" in m and prompt_tokens:
        m["cache_hit_rate"] = round(m["cached_tokens"] / prompt_tokens, 4)
    return m


def measure_prefix(runner: VllmRunner, rec, args, budget, min_item_s: float) -> None:
    from bench_engine import selected_prefix_workloads

    for name, make in selected_prefix_workloads(args).items():
        if rec.is_done("prefix", name):
            continue
        if not budget.allows(min_item_s):
            rec.write("prefix", name, status="skipped", error="time budget")
            continue
        try:
            runner.reset_prefix_cache()
            run_rounds(runner, make())  # untimed, as bench_engine's first pass
            runs = []
            for _ in range(max(1, args.reps)):
                runner.reset_prefix_cache()
                runs.append(run_rounds(runner, make()))
                if runs[-1]["duration_s"] > LONG_RUN_S or not budget.allows(2 * runs[-1]["duration_s"] + 5):
                    break
            m = C.median_run(runs)
            rec.write("prefix", name, m, status="ok" if m["n_completed"] == m["n_requests"] else "truncated")
        except Exception as exc:  # noqa: BLE001
            rec.write("prefix", name, status="error", error=C.error_text(exc))


MODES = {"offline": measure_offline, "prefix": measure_prefix}


def planned_items(args) -> list[tuple[str, str]]:
    """(mode, workload) of every item the modes would measure."""
    from bench_engine import selected_prefix_workloads

    items = []
    for mode in args.modes.split(","):
        if mode == "offline":
            items += [("offline", name) for name, *_ in C.offline_rows(args.quick)]
        elif mode == "prefix":
            items += [("prefix", name) for name in selected_prefix_workloads(args)]
        elif mode:
            raise ValueError(f"unknown mode {mode!r}; known: {sorted(MODES)}")
    return items


# ----------------------------------------------------------------------------- main
def start_llm(args, config: PeerConfig):
    """(vllm module, LLM): imported here so that the tests and a CPU dry run need no vLLM."""
    import vllm

    llm = vllm.LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
                   dtype=args.dtype, max_model_len=args.max_model_len,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   enable_prefix_caching=True, seed=0, **config.llm_kwargs)
    return vllm, llm


def startup_metrics(vllm, llm, init_s: float, warm_s: float, config: PeerConfig) -> dict:
    import torch

    m = {"init_s": round(init_s, 2), "warmup_s": round(warm_s, 2), "vllm_version": vllm.__version__,
         "torch": torch.__version__, "llm_kwargs": config.llm_kwargs}
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name()
    try:  # what vLLM made of the settings (diagnosis only: the path moves between releases)
        sched = llm.llm_engine.vllm_config.scheduler_config
        m["async_scheduling"] = sched.async_scheduling
        m["max_num_seqs"] = sched.max_num_seqs
    except AttributeError:
        pass
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(ap)
    ap.add_argument("--config", default="default",
                    help=f"'default' or options of {list(OPTIONS)} joined by '+'")
    ap.add_argument("--modes", default="offline,prefix")
    ap.add_argument("--prefix-workloads", default="few-shot",
                    help="comma list of bench_engine's prefix workloads (empty: all)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--start-s", type=float, default=90.0,
                    help="budget below which vLLM is not started (its start compiles for "
                         "1-3 minutes): every item is recorded as skipped")
    args = ap.parse_args(argv)
    budget = C.Budget(args.budget_s)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: unwind, stop vLLM
    config = parse_config(args.config)
    label = args.name or C.model_label(args.model)
    rec = C.Recorder(args.out, "vllm", label, config.name,
                     {"prefix_caching": True, "llm_kwargs": config.llm_kwargs},
                     C.load_done(args.done), extra={"quick": args.quick, "device": args.device})
    pending = [item for item in planned_items(args) if not rec.is_done(*item)]
    log(f"vllm_peer: model={label} config={config.name} items={len(pending)} budget={args.budget_s}s")
    if not pending:
        log("vllm_peer: every item measured already (--done); vLLM not started")
        return 0
    if not budget.allows(args.start_s):
        for mode, workload in pending:
            rec.write(mode, workload, status="skipped",
                      error=f"time budget: {budget.left():.0f}s left, vLLM's start needs ~{args.start_s:.0f}s")
        return 0
    try:
        t = time.perf_counter()
        vllm, llm = start_llm(args, config)
        init_s = time.perf_counter() - t
        from vllm import SamplingParams

        runner = VllmRunner(llm, SamplingParams)
        warm_s = warm_up(runner, args.quick)
        rec.write("startup", "vllm", startup_metrics(vllm, llm, init_s, warm_s, config))
        log(f"vLLM {vllm.__version__} ready: start {init_s:.1f}s, warm-up {warm_s:.1f}s")
    except ImportError as exc:
        rec.write("startup", "vllm", status="error",
                  error=f"vLLM is not importable ({exc}): bash benchmarks/gpu/peer.sh install, "
                        "then PYTHONPATH=/tmp/vsite:$PYTHONPATH")
        return 1
    except Exception as exc:  # noqa: BLE001
        rec.write("startup", "vllm", status="error", error=C.error_text(exc))
        return 1
    min_item_s = 2.0 if args.quick else 10.0
    for mode in dict.fromkeys(mode for mode, _ in pending):
        log(f"mode {mode}: start ({budget.left():.0f}s of budget left)")
        MODES[mode](runner, rec, args, budget, min_item_s)
    log(f"vllm_peer done in {budget.elapsed():.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
