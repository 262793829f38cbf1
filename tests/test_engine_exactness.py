"""Greedy output is token-identical to transformers' generate on the same float32
weights, whatever the batching: staggered arrivals, radix cache on and off, tiny
prefill chunks, and KV pools small enough to force eviction and retraction."""
from __future__ import annotations

import pytest

from backend.core import SamplingParams
from engine_helpers import hf_greedy, make_engine, random_prompts, run_staggered, tiny_model

NEW_TOKENS = 12
NUM_PROMPTS = 16

SETTINGS = {
    "cache-on": dict(enable_radix_cache=True),
    "cache-off": dict(enable_radix_cache=False),
    "chunk-5": dict(enable_radix_cache=True, max_prefill_tokens=5),
    "fcfs-chunk-3": dict(enable_radix_cache=True, schedule_policy="fcfs", max_prefill_tokens=3),
    # 16 prompts of up to 40 tokens + 12 new each need ~ 830 slots: 140 forces eviction
    # of finished prefixes and retraction of running requests
    "small-pool": dict(enable_radix_cache=True, max_total_tokens=140, max_prefill_tokens=16),
    "small-pool-no-cache": dict(enable_radix_cache=False, max_total_tokens=140, max_prefill_tokens=16),
    # overlap scheduling (on by default on CUDA): steps are built before the previous
    # step's tokens reach the host
    "overlap": dict(enable_overlap=True, max_prefill_tokens=7),
    "overlap-small-pool": dict(enable_overlap=True, max_total_tokens=140, max_prefill_tokens=16),
}

_REFERENCE: dict = {}


def _case(tmp_root, arch):
    if arch not in _REFERENCE:
        path = tiny_model(tmp_root, arch)
        engine = make_engine(path)
        vocab = engine.runner.vocab_size
        prompts = random_prompts(NUM_PROMPTS, vocab, seed=7)
        # repeat some prompts and prefixes so the radix cache really serves hits
        prompts[3] = list(prompts[1])
        prompts[5] = prompts[2][:10] + prompts[5]
        prompts[9] = prompts[2][:20] + prompts[9][:3]
        _REFERENCE[arch] = (path, prompts, hf_greedy(path, prompts, NEW_TOKENS))
    return _REFERENCE[arch]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("exactness")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(tmp_root, arch, setting):
    path, prompts, expected = _case(tmp_root, arch)
    engine = make_engine(path, **SETTINGS[setting])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = run_staggered(engine, prompts, params, every=2)
    mismatches = [i for i in range(len(prompts)) if got[i] != expected[i]]
    assert not mismatches, f"prompts {mismatches} differ: {got[mismatches[0]]} vs {expected[mismatches[0]]}"
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    if "small-pool" in setting:
        assert stats["num_retractions"] > 0, "the small pool was meant to force retraction"
    engine.check_integrity()


def test_generate_api_returns_results_in_order(tmp_root):
    path, prompts, expected = _case(tmp_root, "qwen2")
    engine = make_engine(path)
    outs = engine.generate(prompts[:6], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                       ignore_eos=True))
    assert [o.token_ids for o in outs] == expected[:6]
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.num_prompt_tokens for o in outs] == [len(p) for p in prompts[:6]]
    assert [o.text for o in outs] == [engine.tokenizer.decode(e, skip_special_tokens=True)
                                      for e in expected[:6]]
