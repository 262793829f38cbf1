"""The scheduling policy on its own: scheduler, radix cache and slot allocators driven
with integer slots and hand-made tokens, no model, no torch."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from backend.core.config import EngineConfig
from backend.core.kv_allocator import KVSlotAllocator, TableRowAllocator
from backend.core.radix_cache import RadixCache
from backend.core.request import Req
from backend.core.sampling_params import SamplingParams
from backend.core.schedule_plan import TableWrite
from backend.core.scheduler import Scheduler


def make(pool: int = 64, rows: int = 8, **settings) -> Scheduler:
    config = EngineConfig(model_path="unused", **{"max_prefill_tokens": 512, **settings})
    slots = KVSlotAllocator(pool)
    return Scheduler(config, slots, TableRowAllocator(rows), RadixCache(slots), context_len=256)


def req(rid: str, prompt: list[int], max_new: int = 4) -> Req:
    return Req(rid=rid, group_id=rid, index=0, origin_input_ids=prompt,
               params=SamplingParams(max_new_tokens=max_new, temperature=0.0))


def run_step(s: Scheduler, token: int = 7):
    """One step as the engine runs it, the forward pass replaced by ``token``."""
    plan = s.schedule()
    for it in plan.items:
        if it.samples:
            it.req.output_ids.append(token)
        else:
            s.cache_unfinished(it.req)
    return plan


def test_importing_the_policy_modules_does_not_import_torch():
    code = ("import sys\n"
            "import backend.core.scheduler, backend.core.radix_cache, backend.core.request\n"
            "import backend.core.kv_allocator, backend.core.groups, backend.core.inbox\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_checking_for_room_takes_nothing_and_allocating_past_it_fails():
    slots = KVSlotAllocator(4)
    assert slots.can_alloc(4) and not slots.can_alloc(5)
    assert slots.available_size() == 4  # a check changes nothing
    assert slots.alloc(3) == [1, 2, 3]
    with pytest.raises(RuntimeError):
        slots.alloc(2)
    rows = TableRowAllocator(2)  # row 0 is the dummy row: one usable
    assert rows.can_alloc() and rows.alloc() == 1 and not rows.can_alloc()


def test_a_new_request_gets_its_whole_prompt_in_one_step_and_decodes_one_token_a_step():
    s = make()
    r = req("a", [1, 2, 3, 4, 5])
    s.add(r)
    plan = run_step(s)
    [item] = plan.items
    assert (item.num_new, item.start_pos, item.samples) == (5, 0, True)
    assert plan.table_writes == [TableWrite(r.req_pool_idx, 0, [])]  # nothing cached yet
    [item] = run_step(s).items
    assert (item.num_new, item.start_pos, item.new_slots) == (1, 5, [6])


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    s = make(max_prefill_tokens=4)
    r = req("a", list(range(10, 20)))
    s.add(r)
    news = [(it.num_new, it.samples) for _ in range(3) for it in run_step(s).items]
    assert news == [(4, False), (4, False), (2, True)]


def test_a_cached_prefix_is_written_to_the_new_requests_table_row_before_its_step():
    s = make()
    first = req("a", [1, 2, 3, 4, 5, 6], max_new=1)
    s.add(first)
    run_step(s)
    s.finish(first)  # its prompt and token go into the tree
    second = req("b", [1, 2, 3, 4, 9])
    s.add(second)
    plan = run_step(s)
    [item] = plan.items
    assert item.start_pos == 4 and second.num_cached_tokens == 4
    cached = second.kv_indices[:4]
    assert plan.table_writes == [TableWrite(second.req_pool_idx, 0, cached)]


def test_an_admission_that_does_not_fit_evicts_nothing():
    s = make(pool=12)
    old = req("old", [50, 51, 52, 53, 54, 55], max_new=1)
    s.add(old)
    run_step(s)
    s.finish(old)  # 7 slots in the tree, evictable
    runner = req("run", [60, 61, 62], max_new=100)
    s.add(runner)
    run_step(s)
    assert s.cache.evictable_size > 0
    before = (s.slots.available_size(), s.cache.evictable_size)
    big = req("big", list(range(100, 111)))  # more than free + evictable minus the reserve
    s.add(big)
    plan = s.schedule()
    assert [it.req for it in plan.items] == [runner]  # the decode only
    assert big in s.waiting
    # the decode took one slot; the refused admission took and evicted nothing
    assert (s.slots.available_size(), s.cache.evictable_size) == (before[0] - 1, before[1])


def test_a_request_alone_in_a_full_pool_is_handed_back_to_finish_not_finished_here():
    s = make(pool=6)
    r = req("a", [1, 2, 3, 4, 5], max_new=100)
    s.add(r)
    run_step(s)  # 5 slots, the sampled token needs the 6th
    run_step(s)
    plan = s.schedule()
    assert plan.items == [] and plan.out_of_room == [r]
    assert r.finish_reason is None  # deciding that it ends is the engine's


def test_retraction_frees_the_newest_request_and_requeues_it_first():
    s = make(pool=16, new_token_ratio=0.0)
    a, b = req("a", [1, 2, 3, 4, 5, 6], max_new=50), req("b", [7, 8, 9, 10, 11, 12], max_new=50)
    s.add(a)
    run_step(s)
    s.add(b)
    run_step(s)
    for _ in range(4):
        run_step(s)
    assert s.num_retractions >= 1 and s.waiting[0] is b and b.kv_indices == []
    assert a in s.running


def test_a_full_pool_is_not_evicted_from_every_decode_step(monkeypatch):
    # The pool full of cached sequences of 10 tokens; each decode step takes 8 slots. An
    # eviction frees a share of the pool (least recently used leaves first), so its fixed
    # cost (re-ranking the candidates touched since the last one) is paid once per many
    # steps, not once per step.
    s = make(pool=65536)
    slots, cache = s.slots, s.cache
    rng, seqs = random.Random(21), []
    while slots.available_size() >= 10:
        seq = [rng.randrange(10, 1000) for _ in range(10)]
        taken = slots.alloc(len(seq))
        slots.free(taken[:cache.insert(seq, taken)])  # what was there stays the tree's
        seqs.append(seq)
    evictions = []  # (each refreshes the candidates first)
    refresh = cache.candidates.refresh
    monkeypatch.setattr(cache.candidates, "refresh", lambda: evictions.append(1) or refresh())
    taken = []
    for _ in range(100):
        assert s.can_fit(8)
        taken += s.take_slots(8)
    assert 1 <= len(evictions) <= 100 * 8 // (slots.size // 256) + 1, len(evictions)
    # least recently used first: the earliest inserted went, the latest are still found
    assert len(cache.match_prefix(seqs[0]).kv_indices) < 10  # (a shared first token may stay)
    assert len(cache.match_prefix(seqs[-1]).kv_indices) == 10
    slots.free(taken)
    assert sorted(slots.free_slots() + cache.cached_slots()) == list(range(1, slots.size + 1))
