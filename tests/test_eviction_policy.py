"""The adaptive eviction policy on integer slots: cycles, scans, frequency, ghosts, partial
eviction, and what it learns (reuse_model.py). Requests are served as the scheduler
serves them (``serve``): match, pin, make room for the whole request, record the use,
insert, unpin."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from backend.core.eviction import AdaptivePolicy, LRUPolicy, make_policy
from backend.core.kv_allocator import KVSlotAllocator
from backend.core.radix_cache import RadixCache
from backend.core.reuse_model import GapShape, ReuseOdds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from cache_optimum import TraceRequest, optimal_hits  # noqa: E402


def make(size: int, policy: str = "adaptive") -> RadixCache:
    return RadixCache(KVSlotAllocator(size), make_policy(policy, size))


def serve(cache: RadixCache, tokens: list[int]) -> int:
    """One request (no output) through ``cache``; returns its cached prompt tokens."""
    match = cache.match_prefix(tokens[:-1])  # the last prompt token is always computed
    cache.lock(match.deepest)
    cached = len(match.kv_indices)
    short = len(tokens) - cached - cache.slots.available_size()
    if short > 0:
        cache.evict(short)
    cache.record_use(match.deepest)
    kv = list(match.kv_indices) + cache.slots.alloc(len(tokens) - cached)
    present = cache.insert(tokens, kv)
    cache.slots.free(kv[cached:present])
    cache.unlock(match.deepest)
    cache.check_integrity()
    return cached


L = 8
CYCLE = {name: [100 * k + i for i in range(L)] for k, name in enumerate("ABCDE", start=1)}


def _cycle_hits(policy: str, rounds: int) -> list[int]:
    cache = make(4 * L, policy)  # room for four of the five prefixes
    return [serve(cache, CYCLE[name]) for name in "ABCDE" * rounds]


def test_lru_never_hits_the_seed_cycle_and_the_adaptive_policy_does_from_the_second_round():
    assert sum(_cycle_hits("lru", 2)) == 0
    hits = _cycle_hits("adaptive", 2)
    assert hits[:5] == [0] * 5  # the first round is compulsory misses
    assert hits[5:] == [L - 1, L - 1, L - 1, 0, 0]  # three of five prefixes stay


def test_on_a_long_cycle_the_adaptive_policy_serves_most_of_what_the_optimum_serves():
    hits = _cycle_hits("adaptive", 20)
    # the offline optimum (token granularity, knowing the rotation) on the same requests
    best = optimal_hits([TraceRequest(CYCLE[name], [0]) for name in "ABCDE" * 20], 4 * L)
    assert sum(best) == 573  # about 6 of the 7 servable tokens of each request
    assert sum(hits) >= 0.8 * sum(best), (sum(hits), sum(best))


def test_a_burst_of_one_off_prompts_does_not_flush_prefixes_that_keep_coming_back():
    rng = random.Random(0)
    hot = [[1000 * k + i for i in range(10)] for k in range(1, 4)]
    results = {}
    for policy in ("lru", "adaptive"):
        cache = make(64, policy)
        for _ in range(5):
            for h in hot:
                serve(cache, h)
        for _ in range(20):  # 20 x 16 one-off tokens through a cache of 64
            serve(cache, [rng.randrange(10**6, 10**7) for _ in range(16)])
        results[policy] = [serve(cache, h) for h in hot]
    assert results == {"lru": [0, 0, 0], "adaptive": [9, 9, 9]}


def test_the_prefix_used_more_often_survives_though_the_other_was_used_last():
    cache = make(25)
    often, rare = list(range(10, 20)), list(range(20, 30))
    for name in "ORRROOOOOR":  # rare: a long gap at the end; often: a short one
        serve(cache, often if name == "O" else rare)
    serve(cache, list(range(30, 40)))  # needs room: one of the two must shrink
    assert serve(cache, often) == 9


def test_eviction_takes_only_the_tail_it_needs_and_the_head_still_hits():
    cache = make(20)
    long = list(range(100, 116))
    serve(cache, long)
    assert cache.evict(5) == 5  # LRU would free the whole 16-token edge
    assert len(cache.match_prefix(long).kv_indices) == 11
    lru = make(20, "lru")
    serve(lru, long)
    assert lru.evict(5) == 16


def test_a_prefix_dropped_and_back_resumes_its_use_count_from_its_ghost():
    cache = make(12)
    a = list(range(50, 60))
    for _ in range(3):
        serve(cache, a)
    node = cache.match_prefix(a[:9]).last_node
    assert node.uses == 3  # created, then used twice
    cache.evict(12)
    assert cache.total_size() == 0 and len(cache.policy.ghosts) >= 1
    serve(cache, a)  # a miss: inserted again
    node = cache.match_prefix(a[:9]).last_node
    assert node.uses == 4 and node.gap > 0


def test_pinned_paths_are_never_evicted_whatever_their_rank():
    cache = make(16)
    pinned = [7] * 8
    serve(cache, pinned)
    node = cache.match_prefix(pinned).last_node
    cache.lock(node)
    serve(cache, [8] * 8)
    assert cache.evict(100) == 8
    assert cache.match_prefix(pinned).kv_indices != [] and cache.total_size() == 8
    cache.unlock(node)
    cache.check_integrity()


def test_deeper_tokens_rank_higher_all_else_equal():
    policy = AdaptivePolicy(1000)
    shallow, deep = make(64).root, make(64).root
    for node, depth in ((shallow, 0), (deep, 20000)):
        node.key, node.uses, node.last_use, node.gap, node.depth = [1] * 10, 3, 5, 4.0, depth
    assert policy.priority(deep, 6) > policy.priority(shallow, 6)


def test_lru_ranks_by_last_match_alone():
    policy = LRUPolicy()
    node = make(8).root
    node.last_access = 42
    assert policy.priority(node, 1000) == 42


def test_unknown_policy_names_are_refused():
    with pytest.raises(ValueError, match="radix_eviction_policy"):
        make_policy("fifo", 10)


# ---------------------------------------------------------------------- what it learns
def test_periodic_gaps_make_a_prefix_due_and_memoryless_gaps_do_not():
    periodic, memoryless = GapShape(), GapShape()
    rng = random.Random(1)
    for _ in range(400):
        periodic.add(1.0)
        memoryless.add(rng.expovariate(1.0))
    # periodic: the wait left shrinks as the prefix ages towards its period
    assert periodic.tail(0.1)[1] > periodic.tail(0.5)[1] > periodic.tail(0.9)[1]
    assert periodic.tail(0.9)[1] < 0.3
    # memoryless: about one expected gap left, whatever the age
    waits = [memoryless.tail(u)[1] for u in (0.1, 0.5, 1.0, 2.0)]
    assert all(0.7 < w < 1.3 for w in waits), waits
    # survival falls with age, to near nothing past the period for periodic reuse
    assert periodic.tail(1.5)[0] < 0.05 < memoryless.tail(1.5)[0]


def test_reuse_odds_follow_what_happened_per_use_count():
    odds = ReuseOdds(max_class=4)
    for _ in range(30):
        odds.dropped(1)
        odds.reused(3)
    odds.reused(1)
    assert odds.probability(1) < 0.1 and odds.probability(3) > 0.9
    assert odds.probability(9) == odds.probability(4)  # counts above the last class share it


def test_the_policy_and_the_host_tier_are_set_from_config_pbtxt_parameters(tmp_path):
    from backend.model_config import engine_config_from_parameters

    config = engine_config_from_parameters(
        {"model_path": str(tmp_path), "radix_eviction_policy": "lru", "host_cache_ratio": "0",
         "host_cache_tokens": "4096"}, [tmp_path])
    assert (config.radix_eviction_policy, config.host_cache_ratio, config.host_cache_tokens) == \
        ("lru", 0.0, 4096)
    default = engine_config_from_parameters({"model_path": str(tmp_path)}, [tmp_path])
    assert (default.radix_eviction_policy, default.host_cache_ratio) == ("adaptive", 2.0)
    with pytest.raises(ValueError, match="radix_eviction_policy"):
        engine_config_from_parameters({"model_path": str(tmp_path),
                                       "radix_eviction_policy": "mru"}, [tmp_path])
    with pytest.raises(ValueError, match="host_cache_ratio"):
        engine_config_from_parameters({"model_path": str(tmp_path),
                                       "host_cache_ratio": "-1"}, [tmp_path])
