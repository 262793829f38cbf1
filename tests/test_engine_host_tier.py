"""The host tier through the engine on CPU: evicted prefixes come back from host memory
instead of being recomputed, the reloaded KV is exact (greedy outputs equal the cache-off
engine's), a request waits for its load while the others step, and nothing leaks when
requests are aborted mid-load."""
from __future__ import annotations

import pytest

from backend.core import SamplingParams
from engine_helpers import make_engine, random_prompts, tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
# LRU: which prefix leaves the device is then plain (the least recently used); prompts
# of a few tokens: every host match is loaded, however short
SMALL = dict(max_total_tokens=64, max_prefill_tokens=64, host_cache_tokens=256,
             radix_eviction_policy="lru", host_load_min_tokens=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("host_tier"), "qwen2")


def _one(engine, prompt, n=2):
    return engine.generate([prompt], SamplingParams(max_new_tokens=n, **GREEDY))[0]


def _step_until_idle(engine, limit=500):
    steps = 0
    while engine.has_work():
        engine.step()
        engine.check_integrity()
        steps += 1
        assert steps < limit, "engine made no progress"


def test_an_evicted_prefix_is_loaded_back_from_the_host_instead_of_recomputed(model):
    engine = make_engine(model, **SMALL)
    a, b, c = random_prompts(3, engine.runner.vocab_size, seed=5, min_len=25, max_len=25)
    for p in (a, b, c):  # the pool holds about two: a leaves the device
        _one(engine, p)
    before = engine.stats()
    assert before["host_saved_tokens"] > 0 and before["kv_bytes_to_host"] > 0
    again = _one(engine, a)
    assert again.num_cached_tokens == len(a) - 1  # from either tier
    stats = engine.stats()
    loaded = stats["cache_hit_tokens_host"]
    assert 0 < loaded <= len(a) - 1
    assert stats["host_loads"] >= 1 and stats["host_loaded_tokens"] >= loaded
    token_bytes = stats["kv_bytes_to_host"] // stats["host_saved_tokens"]
    assert stats["kv_bytes_to_device"] == stats["host_loaded_tokens"] * token_bytes
    assert stats["host_load_seconds"] > 0
    engine.check_integrity()


def test_prefixes_shorter_than_the_load_threshold_are_neither_saved_nor_loaded(model):
    engine = make_engine(model, **{**SMALL, "host_load_min_tokens": 40})
    a, b, c = random_prompts(3, engine.runner.vocab_size, seed=5, min_len=25, max_len=25)
    for p in (a, b, c):
        _one(engine, p)
    assert _one(engine, a).num_cached_tokens < len(a) - 1  # recomputed
    stats = engine.stats()
    assert stats["host_saved_tokens"] == stats["host_loads"] == stats["kv_bytes_to_host"] == 0
    engine.check_integrity()


def test_without_the_host_tier_the_same_prefix_is_recomputed(model):
    engine = make_engine(model, **{**SMALL, "host_cache_tokens": 0})
    a, b, c = random_prompts(3, engine.runner.vocab_size, seed=5, min_len=25, max_len=25)
    for p in (a, b, c):
        _one(engine, p)
    assert _one(engine, a).num_cached_tokens < len(a) - 1
    stats = engine.stats()
    assert stats["host_cache_tokens_total"] == 0 and stats["kv_bytes_to_host"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_outputs_with_reloaded_kv_equal_the_cache_off_outputs(model, overlap):
    vocab = make_engine(model, **SMALL).runner.vocab_size
    heads = random_prompts(5, vocab, seed=9, min_len=20, max_len=20)
    tails = random_prompts(10, vocab, seed=10, min_len=3, max_len=6)
    prompts = [heads[i % 5] + tails[i] for i in range(10)]  # a cycle larger than the pool
    params = SamplingParams(max_new_tokens=6, **GREEDY)
    results = {}
    for name, settings in {"host": SMALL, "off": {**SMALL, "enable_radix_cache": False}}.items():
        engine = make_engine(model, **settings, enable_overlap=overlap)
        results[name] = [engine.generate([p], params)[0] for p in prompts]
        engine.check_integrity()
        if name == "host":
            assert engine.stats()["cache_hit_tokens_host"] > 0, "nothing came from the host"
    assert [r.token_ids for r in results["host"]] == [r.token_ids for r in results["off"]]


def test_a_request_waits_for_its_load_while_another_keeps_decoding(model):
    engine = make_engine(model, **SMALL)
    a, b, c, d = random_prompts(4, engine.runner.vocab_size, seed=12, min_len=20, max_len=20)
    for p in (a, b, c):
        _one(engine, p)
    engine.add_request(d, SamplingParams(max_new_tokens=8, **GREEDY))
    engine.step()  # d is admitted and decodes from here on
    engine.add_request(a, SamplingParams(max_new_tokens=2, **GREEDY))
    engine.step()
    (loading,) = [r for r in engine.scheduler.running if r.origin_input_ids == a]
    assert loading.waiting_load and loading.num_host_cached_tokens > 0
    decoding = next(r for r in engine.scheduler.running if r.origin_input_ids == d)
    out_before = len(decoding.output_ids)
    engine.step()  # the load is done by now (CPU): a steps, and d went on decoding
    assert not loading.waiting_load
    assert len(decoding.output_ids) > out_before
    _step_until_idle(engine)


def test_aborting_requests_mid_load_returns_every_slot_and_block(model):
    engine = make_engine(model, **SMALL)
    prompts = random_prompts(4, engine.runner.vocab_size, seed=14, min_len=20, max_len=20)
    for p in prompts:
        _one(engine, p)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=4, **GREEDY)) for p in prompts[:2]]
    engine.step()  # admitted, their host parts loading
    assert any(r.waiting_load for r in engine.scheduler.running)
    for rid in ids:
        engine.abort(rid)
    _step_until_idle(engine)
    stats = engine.stats()
    assert stats["kv_tokens_in_use_by_requests"] == 0 and stats["host_loads_in_flight"] == 0
    assert engine.cache.protected_size == 0
    engine.cache.reset()
    assert engine.slots.available_size() == engine.slots.size
    assert engine.cache.host.available_size() == engine.cache.host.size
