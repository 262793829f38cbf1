"""The host tier on integer slots: host block runs, demotion of evicted leaves, host hits,
loads that pin their nodes, the host's own eviction, and the copy records in the order
the device side must run them."""
from __future__ import annotations

import pytest

from backend.core.eviction import LRUPolicy, make_policy
from backend.core.host_tier import HostBlockAllocator, HostLoad, HostSave, runs
from backend.core.kv_allocator import KVSlotAllocator
from backend.core.radix_cache import RadixCache


def make(device: int, host: int, policy: str = "lru") -> RadixCache:
    return RadixCache(KVSlotAllocator(device), make_policy(policy, device + host),
                      HostBlockAllocator(host))


def put(cache: RadixCache, tokens: list[int]) -> list[int]:
    short = len(tokens) - cache.slots.available_size()
    if short > 0:
        cache.evict(short)
    slots = cache.slots.alloc(len(tokens))
    present = cache.insert(tokens, slots)
    cache.slots.free(slots[:present])
    return slots


# ---------------------------------------------------------------------- host blocks
def test_host_blocks_come_in_runs_and_merge_back_when_freed():
    host = HostBlockAllocator(10)
    a = host.alloc(4)
    b = host.alloc(3)
    assert a == [0, 1, 2, 3] and b == [4, 5, 6]
    host.free(a)
    assert host.alloc(2) == [7, 8]  # the smallest run that fits: [7..9], not [0..3]
    host.free(b)  # [0..6] is one run again
    assert host.alloc(7) == list(range(7))
    assert host.available_size() == 1 and host.free_blocks() == [9]


def test_host_blocks_span_several_runs_when_none_is_long_enough():
    host = HostBlockAllocator(8)
    blocks = host.alloc(8)
    host.free(blocks[0:2] + blocks[4:6])
    got = host.alloc(4)
    assert sorted(got) == [0, 1, 4, 5] and runs(got) in ([(0, 2), (4, 2)], [(4, 2), (0, 2)])
    with pytest.raises(RuntimeError):
        host.alloc(1)


# ---------------------------------------------------------------------- tiers in the tree
def test_an_evicted_leaf_moves_to_the_host_and_is_matched_there():
    cache = make(device=8, host=16)
    a = put(cache, [1, 2, 3, 4])
    put(cache, [5, 6, 7, 8])
    cache.evict(4)  # LRU: [1,2,3,4] goes to the host
    (save,) = cache.take_copies()
    assert isinstance(save, HostSave) and save.device_slots == a and len(save.host_blocks) == 4
    match = cache.match_prefix([1, 2, 3, 4, 9])
    assert match.kv_indices == [] and match.host_len == 4 and match.last_node is cache.root
    assert cache.host_size == 4 and cache.total_size() == 4
    cache.check_integrity()


def test_a_host_hit_gets_device_slots_and_one_load_and_stays_pinned_until_done():
    cache = make(device=8, host=16)
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6, 7, 8])
    cache.evict(4)
    save = cache.take_copies()[0]
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.deepest)
    slots = cache.slots.alloc(4)
    ticket = cache.start_load(match, slots)
    (load,) = cache.take_copies()
    assert load == HostLoad(ticket, save.host_blocks, slots)
    cache.unlock(match.deepest)  # the request gives up: the load still pins the path
    assert not cache.is_ready(match.deepest)
    assert cache.evict(100) == 4  # only [5,6,7,8] can go
    cache.finish_load(ticket)
    assert cache.is_ready(match.deepest)
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices == slots  # on both tiers now
    assert cache.protected_size == 0
    cache.check_integrity()


def test_a_node_on_both_tiers_leaves_the_device_without_a_copy():
    cache = make(device=4, host=8)
    put(cache, [1, 2, 3, 4])
    cache.evict(4)
    cache.take_copies()
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.deepest)
    ticket = cache.start_load(match, cache.slots.alloc(4))
    cache.finish_load(ticket)
    cache.unlock(match.deepest)
    cache.take_copies()
    assert cache.evict(4) == 4
    assert cache.take_copies() == []  # its host copy was kept
    assert cache.host_size == 4 and cache.total_size() == 0


def test_a_full_host_drops_its_lowest_ranked_copy_for_a_better_one():
    cache = make(device=4, host=4)
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6, 7, 8])  # evicts [1..4] to the host
    put(cache, [9, 10, 11, 12])  # [5..8] ranks above [1..4] (LRU): it takes the host
    assert cache.match_prefix([1, 2, 3, 4]).host_len == 0
    assert cache.match_prefix([5, 6, 7, 8]).host_len == 4
    cache.check_integrity()


def test_a_victim_ranking_below_everything_on_a_full_host_is_dropped_not_copied():
    cache = make(device=4, host=4)
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6, 7, 8])  # [1..4] to the host
    cache.take_copies()
    cache.match_prefix([1, 2, 3, 4])  # refreshed: now newer than [5..8]
    put(cache, [9, 10, 11, 12])  # [5..8] is older than what the host holds
    assert cache.take_copies() == []
    assert cache.match_prefix([5, 6, 7, 8]).host_len == 0
    assert cache.match_prefix([1, 2, 3, 4]).host_len == 4


def test_dropping_a_device_node_drops_the_host_only_nodes_below_it():
    cache = make(device=6, host=2)
    put(cache, [1, 2, 3, 4, 5, 6])
    cache.match_prefix([1, 2, 3, 4])  # split: [1..4] then [5, 6]
    cache.evict(2)  # the leaf [5, 6] goes to the host
    assert cache.host_size == 2
    put(cache, [7, 8, 9, 10, 11, 12])  # [1..4] cannot go to the full host: dropped, with [5, 6]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).host_len == 0
    assert cache.host_size == 0 and cache.host.available_size() == 2
    cache.check_integrity()


def test_a_request_recomputing_a_host_only_prefix_gives_it_device_slots_again():
    cache = make(device=8, host=8)
    put(cache, [1, 2, 3, 4])
    cache.evict(8)
    fresh = cache.slots.alloc(6)
    present = cache.insert([1, 2, 3, 4, 5, 6], fresh)
    assert present == 0  # nothing was on the device: the tree takes every slot
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).kv_indices == fresh
    assert cache.host_size == 4  # the host copy stays
    cache.check_integrity()


def test_device_prefix_len_stops_where_the_host_only_part_begins():
    cache = make(device=8, host=8)
    put(cache, [1, 2, 3, 4])
    cache.evict(8)  # all of it on the host only
    put(cache, [1, 2, 9])  # [1, 2] on both tiers again, [3, 4] still on the host only
    assert cache.device_prefix_len([1, 2, 3, 4]) == 2
    assert cache.device_prefix_len([1, 2, 9, 5]) == 3
    assert cache.match_prefix([1, 2, 3, 4]).host_len == 2
    cache.check_integrity()


def test_without_a_host_tier_eviction_only_drops():
    cache = RadixCache(KVSlotAllocator(4), LRUPolicy(), HostBlockAllocator(0))
    put(cache, [1, 2, 3, 4])
    assert cache.host is None and cache.evict(4) == 4
    assert cache.take_copies() == [] and cache.root.children == {}


# ---------------------------------------------------------------------- short host matches
def make_min(device: int, host: int, min_load: int) -> RadixCache:
    return RadixCache(KVSlotAllocator(device), LRUPolicy(), HostBlockAllocator(host),
                      host_load_min_tokens=min_load)


def test_a_host_match_shorter_than_the_load_threshold_is_a_miss_and_is_recomputed():
    cache = make_min(device=12, host=16, min_load=4)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])  # a path of 8: leaves below [1, 2, 3]
    put(cache, [9, 10, 11, 12])
    cache.evict(5)  # LRU: the leaf [4..8] goes to the host (it ends 8 deep: loadable)
    assert cache.take_copies()[0].host_blocks
    long = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert long.kv_indices and long.host_len == 5  # 5 >= 4: loaded
    short = cache.match_prefix([1, 2, 3, 4, 5, 99])
    assert len(short.kv_indices) == 3 and short.host_len == 0 and short.host_node is None
    cache.check_integrity()


def test_a_leaf_that_no_load_could_bring_back_is_dropped_not_saved():
    cache = make_min(device=6, host=16, min_load=4)
    put(cache, [1, 2, 3])  # 3 tokens from the root: never a load of 4
    put(cache, [5, 6, 7])
    cache.evict(3)
    assert cache.take_copies() == [] and cache.host_size == 0
    assert cache.prefix_len([1, 2, 3]) == 0
    cache.check_integrity()


def test_prefix_len_stops_at_the_limit_and_changes_nothing():
    cache = make(device=16, host=0)
    put(cache, [1, 2, 3, 4, 5, 6])
    before = cache.root.children[1].last_access
    assert cache.prefix_len([1, 2, 3, 4, 9]) == 4
    assert cache.prefix_len([1, 2, 3, 4, 5, 6, 7], limit=5) == 5
    assert cache.prefix_len([1, 2, 3, 4, 5, 6], limit=0) == 0
    (node,) = cache.root.children.values()
    assert node.key == [1, 2, 3, 4, 5, 6] and node.last_access == before  # no split, no touch


def test_prefix_len_counts_a_host_part_only_as_far_as_a_match_would():
    cache = make_min(device=12, host=16, min_load=4)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    put(cache, [9, 10, 11, 12])
    cache.evict(5)  # [4..8] to the host
    assert cache.prefix_len([1, 2, 3, 4, 5, 6, 7, 8]) == 8  # 5 on the host: loaded
    assert cache.prefix_len([1, 2, 3, 4, 5, 6, 7, 8], limit=6) == 3  # 3 on the host: not
    assert cache.prefix_len([1, 2, 3, 4, 5, 99]) == 3
    assert cache.prefix_len([9, 10, 99]) == 2
