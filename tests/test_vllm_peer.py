"""benchmarks/gpu/vllm_peer.py without vLLM: its configurations, and that vLLM is given the
very prompts our engine is given (offline rows, shared-prefix workload, warm-up), with the
suite's budget and resume rules. Stand-ins take the places of vllm.LLM and our Engine."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
C = importlib.import_module("common")
bench_engine = importlib.import_module("bench_engine")
vllm_peer = importlib.import_module("vllm_peer")


# ----------------------------------------------------------------------------- configs
def test_a_configuration_names_its_options_in_one_canonical_order():
    cfg = vllm_peer.parse_config("async+fp8")
    assert cfg.name == "fp8+async"
    assert cfg.llm_kwargs == {"quantization": "fp8", "async_scheduling": True}
    assert cfg.precision == "fp8"


def test_default_and_async_compute_in_bf16_and_kv_fp8_is_its_own_precision():
    assert vllm_peer.parse_config("default") == vllm_peer.PeerConfig("default", {}, "default")
    assert vllm_peer.parse_config("async").precision == "default"
    both = vllm_peer.parse_config("kv-fp8+fp8")
    assert (both.name, both.precision) == ("fp8+kv-fp8", "fp8+kv-fp8")
    assert both.llm_kwargs == {"quantization": "fp8", "kv_cache_dtype": "fp8"}


@pytest.mark.parametrize("text", ["int4", "default+async", "async+async", "", "fp8+bf16"])
def test_unknown_repeated_or_mixed_with_default_options_are_refused(text):
    with pytest.raises(ValueError, match="options are"):
        vllm_peer.parse_config(text)


# ----------------------------------------------------------------------------- stand-ins
class FakeLLM:
    """vllm.LLM's generate / reset_prefix_cache: n_out tokens per prompt; records calls."""

    def __init__(self, short_by: int = 0):
        self.calls: list[tuple[list[list[int]], list[int]]] = []
        self.resets = 0
        self.short_by = short_by

    def generate(self, prompts, params, use_tqdm=True):
        assert use_tqdm is False
        ids = [p["prompt_token_ids"] for p in prompts]
        self.calls.append((ids, [sp.max_tokens for sp in params]))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(sp.max_tokens - self.short_by)))],
                                num_cached_tokens=0) for sp in params]

    def reset_prefix_cache(self):
        self.resets += 1


def FakeSamplingParams(**kw):  # noqa: N802 - stands in for a class
    assert kw["min_tokens"] == kw["max_tokens"] and kw["ignore_eos"] and kw["temperature"] == 0.0
    return SimpleNamespace(**kw)


class FakeEngine:
    """Our Engine's add_request / step / has_work: every request finishes in one step."""

    def __init__(self):
        self.prompts: list[list[int]] = []
        self.n_outs: list[int] = []
        self.open: dict[str, int] = {}

    def add_request(self, prompt, params, stream=False):
        rid = f"r{len(self.prompts)}"
        self.prompts.append(list(prompt))
        self.n_outs.append(params.max_new_tokens)
        self.open[rid] = params.max_new_tokens
        return rid

    def has_work(self):
        return bool(self.open)

    def step(self):
        outs = [SimpleNamespace(request_id=rid, new_token_ids=list(range(n)), new_text="",
                                finished=True, num_output_tokens=n, num_cached_tokens=0,
                                finish_reason="length", error=None) for rid, n in self.open.items()]
        self.open.clear()
        return outs

    def check_integrity(self):
        pass


def args_for(**kw):
    base = dict(quick=False, reps=3, rep_gap_s=0.0, rep_gap_spin=False, device="cpu",
                prefix_workloads="few-shot", modes="offline,prefix")
    return SimpleNamespace(**{**base, **kw})


def recorder(tmp_path, system, done=None):
    return C.Recorder(str(tmp_path / "r.jsonl"), system, "llama-1b", "default", {}, done)


def flat(calls):
    return ([p for prompts, _ in calls for p in prompts], [n for _, ns in calls for n in ns])


def ours(mode, tmp_path, args):
    eng = FakeEngine()
    ctx = {"eng": eng, "rec": recorder(tmp_path, "engine"), "args": args, "budget": C.Budget(600),
           "SP": SimpleNamespace, "torch": None, "min_item_s": 0.0, "label": "llama-1b"}
    bench_engine.MODES[mode](ctx)
    return eng


def theirs(mode, tmp_path, args, llm=None):
    llm = llm or FakeLLM()
    runner = vllm_peer.VllmRunner(llm, FakeSamplingParams)
    rec = recorder(tmp_path, "vllm")
    vllm_peer.MODES[mode](runner, rec, args, C.Budget(600), 0.0)
    return llm, rec


def lines(tmp_path):
    return [json.loads(ln) for ln in (tmp_path / "r.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- workloads
def test_vllm_gets_the_prompts_and_lengths_our_engine_gets_on_the_offline_rows(tmp_path):
    args = args_for()
    eng = ours("offline", tmp_path / "ours", args)
    llm, _ = theirs("offline", tmp_path / "theirs", args)
    prompts, n_outs = flat(llm.calls)
    assert prompts == eng.prompts and n_outs == eng.n_outs
    # three runs of each anchor row (1 + 32 + 128 + 32 prompts), a fresh prompt set per run
    assert len(prompts) == 3 * (1 + 32 + 128 + 32)
    assert [len(ids) for ids, _ in llm.calls] == [1, 1, 1, 32, 32, 32, 128, 128, 128, 32, 32, 32]
    assert llm.calls[0][0] == C.random_prompts(1, 32, C.hash_seed("offline", "b1_in32_out128", 0))
    assert llm.calls[0][0] != llm.calls[1][0]
    assert llm.resets == len(llm.calls)  # every run from an empty prefix cache


def test_vllm_gets_the_few_shot_workload_our_engine_gets_untimed_pass_included(tmp_path):
    args = args_for()
    eng = ours("prefix", tmp_path / "ours", args)
    llm, _ = theirs("prefix", tmp_path / "theirs", args)
    prompts, n_outs = flat(llm.calls)
    assert prompts == eng.prompts and n_outs == eng.n_outs
    assert len(llm.calls) == 4 and all(len(ids) == 64 for ids, _ in llm.calls)
    assert all(len(p) == 1024 + 32 for p in prompts) and set(n_outs) == {64}
    assert len({tuple(p[:1024]) for p in prompts}) == 1  # one shared 1,024-token prefix


def test_the_warm_up_is_our_engines_warm_up(tmp_path):
    llm = FakeLLM()
    vllm_peer.warm_up(vllm_peer.VllmRunner(llm, FakeSamplingParams), quick=False)
    eng = FakeEngine()
    bench_engine.warmup(eng, SimpleNamespace, args_for(), None)
    assert flat(llm.calls) == (eng.prompts, eng.n_outs)
    assert llm.resets == 1


# ----------------------------------------------------------------------------- records
def test_rows_are_recorded_as_ours_are_with_system_vllm_and_the_median_run(tmp_path):
    _, rec = theirs("offline", tmp_path, args_for())
    got = {r["workload"]: r for r in lines(tmp_path)}
    assert list(got) == ["b1_in32_out128", "b32_in32_out128", "b128_in32_out128", "b32_in256_out32"]
    row = got["b128_in32_out128"]
    assert (row["key"], row["system"], row["status"]) == (
        "vllm/llama-1b/default/offline/b128_in32_out128/", "vllm", "ok")
    m = row["metrics"]
    assert (m["n_completed"], m["output_tokens"], m["batch"], m["n_in"], m["n_out"]) == (128, 128 * 128, 128, 32, 128)
    assert len(m["reps_output_tok_per_s"]) == 3
    assert m["output_tok_per_s"] == sorted(m["reps_output_tok_per_s"])[1]


def test_a_row_with_fewer_tokens_than_asked_is_truncated_not_ok(tmp_path):
    theirs("offline", tmp_path, args_for(quick=True), llm=FakeLLM(short_by=1))
    statuses = {r["workload"]: r["status"] for r in lines(tmp_path)}
    assert set(statuses.values()) == {"truncated"}


def test_rows_past_the_budget_are_recorded_as_skipped(tmp_path):
    runner = vllm_peer.VllmRunner(FakeLLM(), FakeSamplingParams)
    vllm_peer.measure_offline(runner, recorder(tmp_path, "vllm"), args_for(quick=True),
                              C.Budget(5.0), min_item_s=10.0)
    assert {(r["status"], r["error"]) for r in lines(tmp_path)} == {("skipped", "time budget")}


def test_vllm_is_not_started_when_every_item_was_measured_or_the_budget_cannot_hold_a_start(tmp_path):
    out = tmp_path / "r.jsonl"
    model = tmp_path / "llama-1b"
    model.mkdir()
    done = tmp_path / "done.jsonl"
    keys = [f"vllm/llama-1b/async/offline/{w}/" for w, *_ in C.offline_rows(True)]
    done.write_text("".join(json.dumps({"key": k, "status": "ok"}) + "\n" for k in keys))
    common = ["--model", str(model), "--config", "async", "--quick", "--out", str(out)]
    # all done: nothing to do, nothing written (vLLM, absent here, is never imported)
    assert vllm_peer.main(common + ["--modes", "offline", "--done", str(done)]) == 0
    assert not out.exists()
    # a budget below a start: every pending item skipped, with the reason
    assert vllm_peer.main(common + ["--budget-s", "30"]) == 0
    got = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["workload"] for r in got] == [w for w, *_ in C.offline_rows(True)] + ["few-shot"]
    assert {r["status"] for r in got} == {"skipped"} and "start" in got[0]["error"]
