"""Tensor parallelism on CPU (gloo): sizes 2 and 4 give one rank's greedy tokens on every
architecture in the registry, with the radix cache on and a KV pool tight enough to
retract; a dead rank ends the engine, fails its requests and leaves no process behind."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from backend.core import SamplingParams
from backend.core.handle import EngineDied
from backend.core.models.registry import MODEL_REGISTRY
from backend.core.parallel.group import TensorParallel
from backend.core.parallel.protocol import RankProtocolError, RankStep, Stop, decode, encode
from backend.core.parallel.shards import HeadSplit, split_heads
from backend.core.forward_batch import BatchSpec
from backend.model_config import check_tensor_parallel_instance, engine_process_wanted
from backend.serving import EngineLoop
from engine_helpers import make_engine, random_prompts, run_staggered
from model_factory import ARCHS, build_tiny_model
from loop_helpers import RecordingSink, generate

NEW_TOKENS = 8
# 4 query heads and 2 KV heads (model_factory's shapes): size 2 splits the KV heads,
# size 4 replicates each on two ranks. Each variant adds what its architecture can get
# wrong when sharded.
VARIANTS = {
    "llama": dict(attention_bias=True, vocab_size=1202),  # o_proj bias; padded vocab blocks
    "qwen2": dict(),  # q/k/v biases
    "qwen3": dict(tie_word_embeddings=True),  # per-head q/k norms; the embedding as head
    "mistral": dict(sliding_window=7),
    "gemma3": dict(final_logit_softcapping=3.0, vocab_size=1201),
    "phi3": dict(tie_word_embeddings=False),  # checkpoints store qkv and gate/up fused
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes: it holds no memory and no device
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"rank processes left behind: {pids}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {arch: build_tiny_model(root / arch, arch=arch, **overrides)
            for arch, overrides in VARIANTS.items()}


def test_every_registered_architecture_is_covered():
    assert sorted(ARCHS[a] for a in VARIANTS) == sorted(MODEL_REGISTRY)


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_greedy_tokens_match_one_rank(models, arch):
    prompts = random_prompts(6, 1200, seed=3, min_len=4, max_len=30)
    prompts[3] = list(prompts[1])  # a whole-prompt radix hit
    prompts[5] = prompts[2][:6] + prompts[5]  # a partial one
    # room for about two requests: running decodes outgrow it and retract
    settings = dict(enable_radix_cache=True, max_prefill_tokens=16,
                    max_total_tokens=max(map(len, prompts)) + 2 * NEW_TOKENS)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = {}
    # size 4 with overlap scheduling: the next step's inputs are placeholders for tokens
    # the ranks get from rank 0's broadcast
    for size, overlap in ((1, False), (2, False), (4, True)):
        engine = make_engine(models[arch], tensor_parallel_size=size, enable_overlap=overlap,
                             **settings)
        try:
            got[size] = run_staggered(engine, prompts, params, every=2, check_each_step=False)
            engine.check_integrity()
            assert engine.stats()["num_retractions"] > 0, "the small pool was meant to retract"
            assert engine.stats()["cache_hit_tokens"] > 0, "the prompts were meant to hit"
        finally:
            engine.close()
    assert got[2] == got[1]
    assert got[4] == got[1]


def test_sampling_on_rank_0_draws_what_one_rank_draws(models):
    """Seeded temperature / top-p draws and their logprobs come from the gathered logits
    on rank 0, with rank 0's generators: the same as on one rank."""
    prompts = random_prompts(3, 1200, seed=4, min_len=5, max_len=20)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=5, n=2,
                            logprobs=2, ignore_eos=True)
    got = {}
    for size in (1, 2):
        engine = make_engine(models["qwen2"], tensor_parallel_size=size)
        try:
            got[size] = [[(s.token_ids, [lp.logprob for lp in s.logprobs]) for s in o.samples]
                         for o in engine.generate(prompts, params)]
        finally:
            engine.close()
    for one, two in zip(got[1], got[2]):
        assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]
        for (_, lp1), (_, lp2) in zip(one, two):
            assert lp2 == pytest.approx(lp1, abs=1e-4)


def test_heads_split_in_blocks_and_kv_heads_replicate_where_ranks_outnumber_them():
    splits = [split_heads(8, 2, TensorParallel(rank, 4)) for rank in range(4)]
    assert splits == [HeadSplit(2, 1, 0, 0), HeadSplit(2, 1, 2, 0),
                      HeadSplit(2, 1, 4, 1), HeadSplit(2, 1, 6, 1)]
    assert split_heads(8, 4, TensorParallel(1, 2)) == HeadSplit(4, 2, 4, 2)


@pytest.mark.parametrize("heads, kv_heads, size, message", [
    (6, 2, 4, "6 attention heads"), (8, 3, 2, "3 KV heads"), (12, 4, 6, "replicated")])
def test_a_model_that_does_not_split_is_refused_clearly(heads, kv_heads, size, message):
    with pytest.raises(ValueError, match=message):
        split_heads(heads, kv_heads, TensorParallel(0, size))


def test_the_step_message_round_trips_and_junk_is_refused():
    step = RankStep([[3, 0, [5, 6, 7]]], BatchSpec(decode=False, input_ids=[9, 8, -1],
                                                   req_pool_indices=[3], out_cache_loc=[5, 6, 7],
                                                   extend_prefix_lens=[0], extend_seq_lens=[3],
                                                   logits_indices=[2], num_placeholders=1), 1)
    assert decode(encode(step)) == step
    assert decode(encode(Stop())) == Stop()
    for junk in (b"\xc1", encode(Stop())[:-1] + b"x", b"\x81\xa4kind\xa4exec"):
        with pytest.raises(RankProtocolError):
            decode(junk)


def test_a_killed_rank_fails_the_engine_and_no_rank_is_left(models):
    engine = make_engine(models["qwen2"], tensor_parallel_size=4, max_total_tokens=256)
    pids = engine.ranks.pids
    try:
        params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
        engine.add_request([20, 21, 22], params)
        assert engine.next_outputs(5.0).outputs  # stepping at size 4
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDied, match="rank"):
            for _ in range(200):
                engine.next_outputs(5.0)
        assert time.monotonic() - started < 30
        _wait_gone(pids)
        with pytest.raises(EngineDied):  # and it stays failed
            engine.next_outputs(0.1)
    finally:
        engine.close()
    _wait_gone(pids)


def test_a_rank_dying_while_idle_fails_the_serving_loop_and_its_requests(models):
    engine = make_engine(models["llama"], tensor_parallel_size=2, max_total_tokens=256)
    pids = engine.ranks.pids
    deaths: list[str] = []
    loop = EngineLoop(engine, idle_wait_s=0.05, cancel_poll_s=0.01, on_death=deaths.append,
                      on_error=lambda message: None)
    loop.start()
    try:
        before = RecordingSink()
        loop.submit(generate([30, 31], max_new_tokens=3, temperature=0.0, ignore_eos=True),
                    before)
        assert before.closed.wait(60) and not before.errors
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not deaths:  # the watcher wakes the idle loop, which stops
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "rank 1" in deaths[0]
        later = RecordingSink()
        loop.submit(generate([1, 2]), later)
        assert later.closed.wait(10) and later.errors
    finally:
        loop.stop(timeout_s=10)
        engine.close()
    _wait_gone(pids)


def test_closing_the_engine_stops_every_rank(models):
    engine = make_engine(models["mistral"], tensor_parallel_size=4, max_total_tokens=256)
    pids = engine.ranks.pids
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    engine.close()
    _wait_gone(pids)


def test_a_tensor_parallel_engine_runs_in_an_engine_process_on_gpus_of_its_own():
    assert engine_process_wanted({}, "cpu", 1, tensor_parallel_size=2)
    assert not engine_process_wanted({}, "cpu", 1, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="engine_process"):
        engine_process_wanted({"engine_process": "false"}, "cpu", 1, tensor_parallel_size=2)
    check_tensor_parallel_instance("GPU", 2, 2)  # GPUs 2 and 3
    check_tensor_parallel_instance("MODEL", 0, 4)
    with pytest.raises(ValueError, match="KIND_MODEL"):
        check_tensor_parallel_instance("GPU", 1, 2)  # would share GPU 1 with the one on 0
