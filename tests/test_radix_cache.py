"""RadixCache specs: prefix matching, edge splitting, slot ownership, pinning, LRU eviction
(whole edges, least recently matched first), and the cache-off baseline. Each test builds
its own small pool so slot numbers are exact. The adaptive policy and the host tier have
their own specs (test_eviction_policy.py, test_host_tier.py)."""
from __future__ import annotations

import random

from backend.core.eviction import LRUPolicy
from backend.core.kv_allocator import KVSlotAllocator
from backend.core.radix_cache import NoCache, RadixCache
from backend.core.radix_node import common_prefix_len


def _pool(size: int) -> KVSlotAllocator:
    return KVSlotAllocator(size)


def _cache(size: int = 32) -> RadixCache:
    return RadixCache(_pool(size), LRUPolicy())


def _put(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Allocate fresh slots for ``tokens``, insert them, free the caller's duplicates, as the
    scheduler does; returns the slots the caller allocated."""
    slots = cache.slots.alloc(len(tokens))
    present = cache.insert(tokens, slots)
    cache.slots.free(slots[:present])
    return slots


def _edges(cache: RadixCache) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every edge of the tree as (key, value)."""
    return {(tuple(n.key), tuple(n.value)) for n in cache.nodes()}


def _depth(cache: RadixCache, node) -> int:
    depth = 0
    while node is not cache.root:
        depth += len(node.key)
        node = node.parent
    return depth


# ---------------------------------------------------------------------- matching
def test_match_on_empty_tree_returns_no_slots_and_the_root():
    cache = _cache()
    result = cache.match_prefix([1, 2, 3])
    assert result.kv_indices == []
    assert result.last_node is cache.root
    cache.check_integrity()


def test_match_ending_inside_an_edge_splits_it_and_returns_exactly_the_matched_slots():
    cache = _cache()
    slots = _put(cache, [1, 2, 3, 4])
    assert _edges(cache) == {((1, 2, 3, 4), tuple(slots))}

    result = cache.match_prefix([1, 2, 9])

    assert result.kv_indices == slots[:2]
    assert result.last_node.key == [1, 2]
    assert _depth(cache, result.last_node) == 2
    assert _edges(cache) == {((1, 2), tuple(slots[:2])), ((3, 4), tuple(slots[2:]))}
    assert cache.total_size() == 4
    cache.check_integrity()


def test_match_of_a_query_shorter_than_the_edge_splits_at_the_query_end():
    cache = _cache()
    slots = _put(cache, [5, 6, 7])
    result = cache.match_prefix([5])
    assert result.kv_indices == slots[:1]
    assert _edges(cache) == {((5,), tuple(slots[:1])), ((6, 7), tuple(slots[1:]))}
    cache.check_integrity()


def test_match_longer_than_the_cached_sequence_returns_all_cached_slots_without_splitting():
    cache = _cache()
    slots = _put(cache, [1, 2, 3])
    result = cache.match_prefix([1, 2, 3, 4, 5])
    assert result.kv_indices == slots
    assert _depth(cache, result.last_node) == 3
    assert _edges(cache) == {((1, 2, 3), tuple(slots))}


def test_device_prefix_len_measures_a_match_without_splitting_or_touching_anything():
    cache = _cache()
    slots = _put(cache, [1, 2, 3, 4])
    edges, clock = _edges(cache), [n.last_access for n in cache.nodes()]
    assert cache.device_prefix_len([1, 2, 3]) == 3
    assert cache.device_prefix_len([1, 2, 3, 4, 5]) == 4
    assert cache.device_prefix_len([1, 2, 7]) == 2
    assert cache.device_prefix_len([7]) == 0
    assert _edges(cache) == edges == {((1, 2, 3, 4), tuple(slots))}
    assert [n.last_access for n in cache.nodes()] == clock
    cache.check_integrity()


# ---------------------------------------------------------------------- insert
def test_insert_into_empty_tree_reports_nothing_present():
    cache = _cache()
    assert cache.insert([1, 2, 3], [10, 11, 12]) == 0
    assert cache.evictable_size == 3


def test_insert_sharing_a_prefix_returns_the_shared_length():
    cache = _cache()
    _put(cache, [1, 2, 3, 4])
    assert cache.insert([1, 2, 7, 8, 9], [20, 21, 22, 23, 24]) == 2
    assert cache.insert([1, 2, 3], [30, 31, 32]) == 3  # strict prefix of a cached sequence
    assert cache.insert([1, 2, 3, 4], [40, 41, 42, 43]) == 4  # exact repeat
    assert cache.insert([9], [50]) == 0  # nothing in common
    cache.check_integrity()


def test_first_inserter_keeps_its_slots_and_only_the_new_suffix_is_taken():
    cache = _cache()
    first = _put(cache, [1, 2, 3, 4])
    second = _put(cache, [1, 2, 5, 6])
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices == first
    assert cache.match_prefix([1, 2, 5, 6]).kv_indices == first[:2] + second[2:]
    assert sorted(cache.cached_slots()) == sorted(first + second[2:])


def test_duplicate_slots_held_by_callers_plus_tree_slots_plus_free_slots_cover_the_pool():
    size = 24
    cache = _cache(size)
    duplicates: list[int] = []  # slots insert reported as already present, still held
    for tokens in ([1, 2, 3, 4], [1, 2, 3, 9], [1, 2], [7, 7, 7], [1, 2, 3, 4, 5]):
        slots = cache.slots.alloc(len(tokens))
        present = cache.insert(tokens, slots)
        duplicates += slots[:present]

    assert len(duplicates) == 0 + 3 + 2 + 0 + 4  # the shared lengths insert reported
    tree = cache.cached_slots()
    assert len(tree) == 4 + 1 + 3 + 1 == cache.total_size()  # [1,2,3,4] [9] [7,7,7] [5]
    assert not set(duplicates) & set(tree)  # the tree never took a duplicate
    assert sorted(tree + duplicates + cache.slots.free_slots()) == list(range(1, size + 1))

    cache.slots.free(duplicates)  # the caller gives them back: nothing leaks
    assert sorted(tree + cache.slots.free_slots()) == list(range(1, size + 1))  # slot 0 never used
    cache.check_integrity()


# ---------------------------------------------------------------------- lock / unlock
def test_lock_pins_the_whole_path_and_unlock_makes_it_evictable_again():
    cache = _cache()
    path = _put(cache, [1, 2, 3, 4])
    branch = _put(cache, [1, 2, 5])  # trunk [1,2] with leaves [3,4] and [5]
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.lock(node)
    assert cache.protected_size == 4 and cache.evictable_size == 1

    assert cache.evict(100) == 1  # only the unlocked sibling [5] can go
    assert cache.slots.free_slots()[-1:] == [branch[2]]
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices == path
    cache.check_integrity()

    cache.unlock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 4
    assert cache.evict(100) == 4
    assert cache.total_size() == 0 and cache.root.children == {}
    cache.check_integrity()


def test_lock_held_across_a_later_split_still_pins_both_halves():
    cache = _cache()
    _put(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.lock(node)
    cache.match_prefix([1, 2])  # splits the locked edge
    assert cache.evict(100) == 0
    assert cache.protected_size == 4
    cache.check_integrity()

    cache.unlock(node)  # unlocking the original (now lower) node releases the upper too
    assert cache.evictable_size == 4 and cache.protected_size == 0
    assert cache.evict(100) == 4
    cache.check_integrity()


def test_two_locks_on_one_path_need_two_unlocks():
    cache = _cache()
    _put(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert cache.evict(100) == 2


# ---------------------------------------------------------------------- eviction
def test_eviction_frees_the_least_recently_used_leaf_first():
    cache = _cache()
    a = _put(cache, [1, 1])
    b = _put(cache, [2, 2])
    c = _put(cache, [3, 3])
    cache.match_prefix([1, 1])  # touching A makes it the most recently used

    assert cache.evict(2) == 2
    assert sorted(cache.slots.free_slots()[-2:]) == sorted(b)
    assert cache.match_prefix([2, 2]).kv_indices == []
    assert cache.evict(2) == 2
    assert sorted(cache.slots.free_slots()[-2:]) == sorted(c)
    assert cache.match_prefix([1, 1]).kv_indices == a


def test_shared_trunk_outlives_its_branches_and_becomes_a_candidate_once_childless():
    cache = _cache()
    slots3 = _put(cache, [1, 2, 3])
    slots4 = _put(cache, [1, 2, 4])  # splits into trunk [1,2] + leaves [3], [4]
    other = _put(cache, [7])  # used after the trunk

    assert cache.evict(2) == 2  # the two branch leaves, not the older trunk
    assert sorted(cache.slots.free_slots()[-2:]) == sorted([slots3[2], slots4[2]])
    assert sorted(cache.cached_slots()) == sorted(slots3[:2] + other)

    # now childless, the trunk is older than [7] and goes next, whole edge at once
    assert cache.evict(1) == 2
    assert cache.cached_slots() == other
    cache.check_integrity()


def test_a_locked_parent_left_childless_is_not_evicted():
    cache = _cache()
    trunk = _put(cache, [1, 2, 3])[:2]
    _put(cache, [1, 2, 4])
    node = cache.match_prefix([1, 2]).last_node
    cache.lock(node)
    assert cache.evict(100) == 2  # both branches, then the pinned trunk stops it
    assert cache.cached_slots() == trunk
    cache.unlock(node)
    assert cache.evict(100) == 2
    cache.check_integrity()


def test_reinserting_a_cached_sequence_counts_as_a_use():
    cache = _cache()
    a = _put(cache, [1, 1])
    b = _put(cache, [2, 2])
    _put(cache, [1, 1])  # a repeat: nothing new is cached but A is now the most recent
    assert cache.evict(2) == 2
    assert sorted(cache.slots.free_slots()[-2:]) == sorted(b)
    assert cache.cached_slots() == a


def test_a_match_ending_inside_an_edge_refreshes_only_the_matched_part():
    cache = _cache()
    old = _put(cache, [1, 2, 3, 4])
    other = _put(cache, [9, 9])
    cache.match_prefix([1, 2])  # [1,2] is now the most recent; [3,4] keeps its old time
    assert cache.evict(2) == 2
    assert sorted(cache.slots.free_slots()[-2:]) == sorted(old[2:])
    assert cache.match_prefix([9, 9]).kv_indices == other


def test_evict_stops_after_the_leaf_that_reaches_the_target():
    cache = _cache()
    for first in (1, 2, 3):
        _put(cache, [first] * 3)
    free_before = cache.slots.available_size()

    assert cache.evict(4) == 6  # two leaves of 3: the second crosses the target
    assert cache.slots.available_size() == free_before + 6
    assert cache.match_prefix([3, 3, 3]).kv_indices != []  # third leaf untouched
    assert cache.evict(0) == 0
    assert len(cache.cached_slots()) == 3


def test_evict_more_than_evictable_frees_everything_unlocked_and_reports_it():
    cache = _cache()
    _put(cache, [1, 2, 3])
    _put(cache, [4, 5])
    assert cache.evict(1000) == 5
    assert cache.evict(1000) == 0
    assert cache.slots.available_size() == cache.slots.size


# ---------------------------------------------------------------------- cache off
def test_nocache_never_matches_and_insert_reports_everything_present():
    cache = NoCache(_pool(16))
    slots = cache.slots.alloc(3)
    assert cache.insert([1, 2, 3], slots) == 3  # caller frees all of its slots
    cache.slots.free(slots)
    result = cache.match_prefix([1, 2, 3])
    assert result.kv_indices == [] and result.last_node is cache.root
    assert cache.enabled is False
    assert cache.cached_slots() == [] and cache.total_size() == 0
    assert cache.evict(10) == 0
    assert cache.slots.available_size() == 16


# ---------------------------------------------------------------------- churn (seed 003)
L = 8
PREFIXES = {name: [100 * k + i for i in range(L)] for k, name in enumerate("ABCDE", start=1)}


def _serve(order: str) -> int:
    """Serve one request per letter against a pool of exactly 4 prefixes' worth of slots."""
    cache = _cache(4 * L)
    hits = 0
    for name in order:
        tokens = PREFIXES[name]
        if len(cache.match_prefix(tokens).kv_indices) == L:
            hits += 1
            continue
        short = L - cache.slots.available_size()
        if short > 0:
            cache.evict(short)
        slots = cache.slots.alloc(L)
        assert slots is not None
        assert cache.insert(tokens, slots) == 0
        cache.check_integrity()
    assert sorted(cache.cached_slots() + cache.slots.free_slots()) == list(range(1, 4 * L + 1))
    return hits


def test_lru_churn_five_prefixes_cycling_through_a_cache_of_four_never_hit():
    assert _serve("ABCDEABCDE") == 0


def test_the_same_traffic_grouped_by_prefix_hits_half_the_time():
    assert _serve("AABBCCDDEE") == 5


def test_common_prefix_len_finds_the_first_difference_anywhere_in_a_long_edge():
    rng = random.Random(3)
    key = [rng.randrange(50) for _ in range(700)]
    for cut in (0, 1, 15, 16, 17, 350, 699):
        other = key[:cut] + [999] + key[cut + 1:]
        assert common_prefix_len(key, other) == cut
        assert common_prefix_len(key, [7, 7] + other, 2) == cut
    assert common_prefix_len(key, key + [1, 2]) == 700  # the edge ends first
    assert common_prefix_len(key, key[:300]) == 300  # the tokens end first
    assert common_prefix_len(key, tuple(key[:40]) + (999,)) == 40  # no slices across types
