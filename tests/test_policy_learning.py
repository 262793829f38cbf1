"""What the adaptive policy learns, piece by piece: a conversation's next turn inherits
its history, the ghosts of a dropped path fold into one, the reuse odds count prefixes
that did not come back, the gap model reads ages the way the traffic calls for, and a
request ticks the use clock once."""
from __future__ import annotations

import random
import sys
from pathlib import Path

from backend.core.eviction import make_policy
from backend.core.gap_model import GapModel
from backend.core.ghost_history import Ghost, GhostHistory, anchor_of, ghost_key
from backend.core.kv_allocator import KVSlotAllocator
from backend.core.radix_cache import RadixCache
from backend.core.reuse_model import ReuseOdds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from cache_optimum import optimal_hits  # noqa: E402
from cache_replay import replay  # noqa: E402
from cache_traces import multi_turn  # noqa: E402
from test_eviction_policy import serve  # noqa: E402  (one request through the cache)


def make(size: int) -> RadixCache:
    return RadixCache(KVSlotAllocator(size), make_policy("adaptive", size))


def leaf_of(cache: RadixCache, tokens: list[int]):
    """The node whose edge ends where ``tokens`` end (the whole sequence cached)."""
    node, i = cache.root, 0
    while i < len(tokens):
        node = node.children[tokens[i]]
        i += len(node.key)
    assert i == len(tokens)
    return node


def test_a_chats_next_turn_starts_with_the_history_of_the_turns_it_extends():
    cache = make(1000)
    chat = list(range(100, 130))
    for turn in range(4):  # each turn resends the whole history and adds to it
        chat = chat + list(range(1000 * (turn + 1), 1000 * (turn + 1) + 20))
        serve(cache, chat)
    leaf = leaf_of(cache, chat)
    assert leaf.key == chat[-20:] and leaf.uses == 4  # not 1: a one-off would be
    assert leaf.parent.uses == 4 and leaf.ends_path and leaf.parent.ends_path


def test_a_new_question_under_a_shared_system_prompt_starts_as_a_one_off():
    cache = make(1000)
    system = list(range(100, 140))
    for q in range(3):
        serve(cache, system + [5000 + 10 * q + i for i in range(10)])
    assert leaf_of(cache, system + [5020 + i for i in range(10)]).uses == 1
    assert leaf_of(cache, system).uses == 3  # the prompt itself: used by every question


def test_the_ghosts_of_a_dropped_path_fold_into_one_for_its_top_edge():
    cache = make(1000)
    chat = list(range(100, 130))
    serve(cache, chat)
    serve(cache, chat + list(range(2000, 2040)))  # a second edge below the first
    assert cache.evict(1000) == 70
    ghosts = cache.policy.ghosts
    assert len(ghosts) == 1  # one ghost stands for both edges
    ghost = ghosts.recall(ghost_key([], chat, 0))
    assert ghost is not None and ghost.num_tokens == 70


def test_ghost_history_absorbs_the_ghosts_that_start_where_an_edge_ends():
    history = GhostHistory(max_tokens=100)
    below = ghost_key([1, 2, 3], [4, 5], 3)
    history.remember(below, Ghost(uses=2, last_use=1, gap=3.0, num_tokens=10))
    assert history.absorb(anchor_of([9, 9, 9], 3)) == 0  # another path: kept
    assert history.absorb(anchor_of([1, 2, 3], 3)) == 10 and len(history) == 0


def test_ghost_history_forgets_the_oldest_when_over_its_token_budget():
    history = GhostHistory(max_tokens=25)
    keys = [ghost_key([], [k], 0) for k in range(3)]
    for key in keys:
        history.remember(key, Ghost(1, 0, 0.0, 10))
    assert keys[0] not in history and keys[1] in history and keys[2] in history


def test_reuse_odds_take_a_drop_back_when_the_prefix_returns():
    odds = ReuseOdds(max_class=4)
    for _ in range(10):
        odds.reused(2)
    before = odds.probability(2)
    odds.dropped(2, 5.0)
    assert odds.probability(2) < before
    odds.undropped(2, 5.0)  # it came back: it was only evicted too early
    assert odds.probability(2) == before


def test_reuse_odds_of_a_use_count_without_data_lean_on_the_count_below():
    odds = ReuseOdds(max_class=8)
    for _ in range(50):
        odds.reused(3)
    odds.dropped(3)
    assert odds.probability(3) > 0.9
    assert odds.probability(6) == odds.probability(5) == odds.probability(4) > 0.9
    assert odds.probability(1) == 0.5  # nothing known: even odds


def _learn(model: GapModel, rates: list[float], rng: random.Random, shape: float) -> None:
    counts = {i: 0 for i in range(len(rates))}
    means = {i: 0.0 for i in range(len(rates))}
    for _ in range(3000):
        i = rng.randrange(len(rates))
        gap = rng.gammavariate(shape, rates[i] / shape)
        model.observe(gap, means[i], min(counts[i], 8))
        counts[i] += 1
        means[i] += (gap - means[i]) / min(counts[i], 8)


def test_prefixes_that_return_at_one_rate_are_read_against_the_typical_gap():
    model = GapModel()  # chats whose users think alike: a prefix's last gap is only noise
    rng = random.Random(1)
    for _ in range(3000):
        model.observe(rng.gammavariate(4.0, 10.0), rng.gammavariate(4.0, 10.0), own_count=1)
    assert model.reads_absolute and 35 < model.typical < 45
    _, wait = model.tail(0.0, own_gap=5.0, own_count=1)
    assert 35 < wait < 45  # a short last gap does not make it due sooner


def test_prefixes_with_very_different_rates_are_read_against_their_own_gaps():
    model = GapModel()  # tenants of Zipf popularity: a popular one is due sooner
    _learn(model, [2.0 ** k for k in range(10)], random.Random(2), shape=1.0)
    assert not model.reads_absolute
    fast, slow = model.tail(4.0, own_gap=2.0, own_count=8), model.tail(4.0, 500.0, 8)
    assert fast[1] < slow[1]  # expected ticks left: the popular prefix comes back sooner


def test_until_it_has_seen_enough_gaps_a_model_reads_ages_against_own_gaps():
    model = GapModel()
    for _ in range(10):
        model.observe(40.0, 40.0, own_count=1)
    assert model.absolute_weight == 0.0
    own = model.own_estimate(5.0, own_count=4)
    assert own == (2 * 40.0 + 4 * 5.0) / 6  # drawn towards the typical gap
    survival, wait = model.relative.tail(10.0 / own)
    assert model.tail(10.0, own_gap=5.0, own_count=4) == (survival, wait * own)


def test_a_request_that_hits_and_brings_a_dropped_edge_back_ticks_the_clock_once():
    cache = make(1000)
    system, a, b = list(range(100, 140)), list(range(500, 520)), list(range(600, 620))
    serve(cache, system + a)
    serve(cache, system + b)
    assert cache.evict(40) == 40  # the two questions go (the system prompt has children)
    assert cache.policy.knows(ghost_key(system, a, len(system)))
    before = cache.use_clock
    assert serve(cache, system + a) == 40  # the system prompt hits; ``a`` is a ghost
    assert cache.use_clock == before + 1


def test_on_a_small_chat_trace_the_adaptive_policy_serves_more_than_lru():
    trace = multi_turn(users=60, active=16, turns=(3, 6), seed=1)
    best = sum(optimal_hits(trace.requests, trace.capacity))
    lru = replay(trace.requests, trace.capacity, "lru", check_every=9).hits / best
    adaptive = replay(trace.requests, trace.capacity, "adaptive", check_every=9).hits / best
    assert adaptive > lru + 0.1, (adaptive, lru)
