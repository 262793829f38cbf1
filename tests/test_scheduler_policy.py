"""Scheduling policy, seen from outside the engine: which request is served first (fcfs,
lpm, the starvation bound), how chunked prefill shares steps with decodes, the running
cap, and retraction when the KV pool runs out.

Requests are told apart by the step in which they first produce output: with
``max_running_requests=1`` that order is the admission order."""
from __future__ import annotations

import math

import pytest

from backend.core import SamplingParams
from engine_helpers import make_engine, random_prompts, tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_STEPS = 2000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("policy"), "qwen2")


def _params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, **GREEDY)


def _prompts(engine, n: int, seed: int, length: int) -> list[list[int]]:
    return random_prompts(n, engine.runner.vocab_size, seed=seed, min_len=length, max_len=length)


def _serve(engine, prompt: list[int]) -> None:
    """Run one request to the end, so its prompt is in the radix cache."""
    engine.generate([prompt], _params(2))


def _first_output_order(engine) -> list[str]:
    """Step until idle; request ids in the order of their first output."""
    order: list[str] = []
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            return order
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
    raise AssertionError("engine made no progress")


def _tokens_per_step(engine, rids: list[str], steps: int) -> list[dict[str, int]]:
    """Run ``steps`` steps; for each, how many tokens every request in ``rids`` produced."""
    counts = []
    for _ in range(steps):
        produced = dict.fromkeys(rids, 0)
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
        counts.append(produced)
    return counts


# ---------------------------------------------------------------------------- order of service

def test_fcfs_serves_in_arrival_order_even_past_a_cached_prefix(model):
    engine = make_engine(model, schedule_policy="fcfs", max_running_requests=1)
    cached, a, b = _prompts(engine, 3, seed=10, length=20)
    _serve(engine, cached)
    ra = engine.add_request(a, _params(2))
    rb = engine.add_request(b, _params(2))
    rs = engine.add_request(cached[:16] + b[:4], _params(2))  # lpm would take it first
    assert _first_output_order(engine) == [ra, rb, rs]


def test_lpm_serves_the_request_with_a_cached_prefix_before_an_earlier_unrelated_one(model):
    engine = make_engine(model, schedule_policy="lpm", max_running_requests=1)
    cached, unrelated = _prompts(engine, 2, seed=12, length=24)
    _serve(engine, cached)
    ru = engine.add_request(unrelated, _params(2))
    rs = engine.add_request(cached[:20] + unrelated[:4], _params(2))
    assert _first_output_order(engine) == [rs, ru]
    # and the cache did serve it
    assert engine.counters.cache_hit_tokens >= 20


def test_lpm_with_nothing_cached_falls_back_to_arrival_order(model):
    engine = make_engine(model, schedule_policy="lpm", max_running_requests=1)
    prompts = _prompts(engine, 3, seed=13, length=10)
    rids = [engine.add_request(p, _params(2)) for p in prompts]
    assert _first_output_order(engine) == rids


def _admissions_until_unrelated_starts(model, bound: int) -> int:
    """lpm with one request at a time: a new request sharing a cached prefix arrives every
    step while one unrelated request waits. Returns the unrelated request's position
    (1-based) in the order of admissions."""
    engine = make_engine(model, schedule_policy="lpm", max_running_requests=1,
                         starvation_bound=bound)
    cached, unrelated = _prompts(engine, 2, seed=14, length=16)
    _serve(engine, cached)
    ru = engine.add_request(unrelated, _params(1))
    order: list[str] = []
    for i in range(4 * bound + 10):
        # one token each: every request is admitted and finished within one step
        engine.add_request(cached + [10 + i, 11 + i], _params(1))
        for out in engine.step():
            assert out.request_id not in order
            order.append(out.request_id)
        assert len(order) == i + 1, "one admission per step"
        if ru in order:
            return order.index(ru) + 1
    raise AssertionError(f"unrelated request never admitted with starvation_bound={bound}")


def test_starvation_bound_limits_how_often_a_waiting_request_is_passed_over(model):
    small, large = 2, 6
    waited_small = _admissions_until_unrelated_starts(model, small)
    waited_large = _admissions_until_unrelated_starts(model, large)
    assert 1 < waited_small <= small + 1  # passed over (lpm at work), but at most `small` times
    assert waited_large <= large + 1
    assert waited_large > waited_small


def test_starvation_bound_zero_is_first_come_first_served(model):
    assert _admissions_until_unrelated_starts(model, 0) == 1


# ---------------------------------------------------------------------------- chunked prefill

@pytest.mark.parametrize("length", [8, 9, 16, 30])
def test_a_prompt_takes_ceil_length_over_budget_steps_to_its_first_token(model, length):
    engine = make_engine(model, max_prefill_tokens=8)
    (prompt,) = _prompts(engine, 1, seed=20 + length, length=length)
    rid = engine.add_request(prompt, _params(2))
    steps = _tokens_per_step(engine, [rid], math.ceil(length / 8))
    assert [s[rid] for s in steps] == [0] * (len(steps) - 1) + [1]


def _decode_then_long_prefill(model, mixed: bool):
    engine = make_engine(model, max_prefill_tokens=8, enable_mixed_batch=mixed)
    short, long = _prompts(engine, 1, seed=30, length=5) + _prompts(engine, 1, seed=31, length=30)
    rd = engine.add_request(short, _params(20))
    assert _tokens_per_step(engine, [rd], 1) == [{rd: 1}]  # prefilled: now decoding
    rl = engine.add_request(long, _params(4))
    steps = _tokens_per_step(engine, [rd, rl], 5)
    engine.check_integrity()
    return rd, rl, steps


def test_mixed_batches_keep_decoding_during_a_chunked_prefill(model):
    rd, rl, steps = _decode_then_long_prefill(model, mixed=True)
    assert [s[rl] for s in steps] == [0, 0, 0, 1, 1]  # ceil(30 / 8) = 4 steps to the first token
    assert [s[rd] for s in steps] == [1, 1, 1, 1, 1]


def test_without_mixed_batches_decodes_pause_during_prefill_steps(model):
    rd, rl, steps = _decode_then_long_prefill(model, mixed=False)
    assert [s[rl] for s in steps] == [0, 0, 0, 1, 1]
    assert [s[rd] for s in steps] == [0, 0, 0, 0, 1]


# ---------------------------------------------------------------------------- running cap

def test_never_more_than_max_running_requests_in_a_step(model):
    cap = 3
    engine = make_engine(model, max_running_requests=cap)
    schedule = engine.scheduler.schedule
    running_per_step: list[int] = []

    def spy():
        plan = schedule()
        running_per_step.append(len(engine.scheduler.running))
        assert len(plan.items) <= cap
        return plan

    engine.scheduler.schedule = spy
    prompts = random_prompts(10, engine.runner.vocab_size, seed=40, min_len=3, max_len=25)
    rids = {engine.add_request(p, _params(3 + i % 5)): 3 + i % 5 for i, p in enumerate(prompts)}
    produced = dict.fromkeys(rids, 0)
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
        assert len(engine.scheduler.waiting) + len(engine.scheduler.running) <= len(rids)
    assert max(running_per_step) == cap  # the cap was reached, and never passed
    assert produced == rids  # everyone was served in full


# ---------------------------------------------------------------------------- retraction

def _run_all(engine, prompts, max_new_tokens: int) -> list[list[int]]:
    rids = [engine.add_request(p, _params(max_new_tokens)) for p in prompts]
    tokens = {r: [] for r in rids}
    reasons = {}
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        engine.check_integrity()
    assert reasons == dict.fromkeys(rids, "length")
    return [tokens[r] for r in rids]


def test_retraction_under_kv_pressure_still_finishes_every_request_exactly(model):
    max_new = 20
    small = make_engine(model, max_total_tokens=60)
    prompts = _prompts(small, 3, seed=50, length=10)  # each needs 10 + 20 = 30 slots
    squeezed = _run_all(small, prompts, max_new)
    assert small.stats()["num_retractions"] > 0
    roomy = make_engine(model, max_total_tokens=4096)
    reference = _run_all(roomy, prompts, max_new)
    assert roomy.stats()["num_retractions"] == 0
    assert [len(t) for t in squeezed] == [max_new] * len(prompts)
    assert squeezed == reference
    assert small.stats()["num_running"] == 0 and small.stats()["num_waiting"] == 0
