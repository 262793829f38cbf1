"""num_cached_tokens is exactly the prompt tokens whose KV the radix cache supplied.

A finished request leaves prompt + output in the tree, except its last sampled token,
which never had KV computed. At least one prompt token is always recomputed, since the
next token's logits come from it."""
from __future__ import annotations

import random

import pytest

from backend.core import SamplingParams
from engine_helpers import make_engine, random_prompts, tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("cache"), "qwen2")


def _one(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams(**{**GREEDY, **params}))[0]


def test_shared_system_prompt_with_different_questions(model):
    engine = make_engine(model)
    system, q1, q2 = random_prompts(3, engine.runner.vocab_size, seed=1, min_len=12, max_len=30)
    q2[0] = q1[0] + 1 if q1[0] + 1 < engine.runner.vocab_size else q1[0] - 1  # differ at once
    first = _one(engine, system + q1, max_new_tokens=4)
    second = _one(engine, system + q2, max_new_tokens=4)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == len(system)


def test_multi_turn_chat_reuses_previous_answer(model):
    engine = make_engine(model)
    turn1, user2 = random_prompts(2, engine.runner.vocab_size, seed=2, min_len=8, max_len=20)
    first = _one(engine, turn1, max_new_tokens=6)
    second = _one(engine, turn1 + first.token_ids + user2, max_new_tokens=6)
    # everything but the last answer token (never fed back, so never got KV)
    assert second.num_cached_tokens == len(turn1) + len(first.token_ids) - 1


def test_identical_prompt_is_served_from_cache_but_one_token(model):
    engine = make_engine(model)
    (prompt,) = random_prompts(1, engine.runner.vocab_size, seed=3, min_len=20, max_len=20)
    _one(engine, prompt, max_new_tokens=3)
    again = _one(engine, prompt, max_new_tokens=3)
    assert again.num_cached_tokens == len(prompt) - 1


def test_n_samples_share_one_prefill(model):
    engine = make_engine(model)
    (prompt,) = random_prompts(1, engine.runner.vocab_size, seed=4, min_len=15, max_len=15)
    out = _one(engine, prompt, max_new_tokens=5, n=4, temperature=1.0, seed=11)
    assert len(out.samples) == 4
    assert [s.num_cached_tokens for s in out.samples] == [0] + [len(prompt) - 1] * 3
    assert len({tuple(s.token_ids) for s in out.samples}) > 1, "seeded samples should differ"
    engine.check_integrity()


def test_cached_count_after_eviction(model):
    # room for about two prompts' KV: serving others evicts the first prompt's prefix (LRU,
    # no host tier to keep it in)
    engine = make_engine(model, max_total_tokens=64, max_prefill_tokens=64,
                         radix_eviction_policy="lru", host_cache_ratio=0)
    a, b, c = random_prompts(3, engine.runner.vocab_size, seed=5, min_len=25, max_len=25)
    _one(engine, a, max_new_tokens=2)
    _one(engine, b, max_new_tokens=2)
    _one(engine, c, max_new_tokens=2)  # needs slots: a (least recently used) goes
    again_a = _one(engine, a, max_new_tokens=2)
    assert again_a.num_cached_tokens == 0
    again_c = _one(engine, c, max_new_tokens=2)  # c was used last and survives
    assert again_c.num_cached_tokens == len(c) - 1
    engine.check_integrity()


def test_cache_disabled_reports_no_hits(model):
    engine = make_engine(model, enable_radix_cache=False)
    (prompt,) = random_prompts(1, engine.runner.vocab_size, seed=6, min_len=20, max_len=20)
    _one(engine, prompt, max_new_tokens=3)
    again = _one(engine, prompt, max_new_tokens=3)
    assert again.num_cached_tokens == 0
    assert engine.stats()["radix_cache_tokens"] == 0
    engine.check_integrity()


def test_chunked_prefill_is_cached_chunk_by_chunk(model):
    engine = make_engine(model, max_prefill_tokens=8)
    (prompt,) = random_prompts(1, engine.runner.vocab_size, seed=8, min_len=30, max_len=30)
    engine.add_request(prompt, SamplingParams(max_new_tokens=2, **GREEDY))
    engine.step()  # first chunk of 8 tokens
    assert engine.cache.total_size() == 8
    engine.step()
    assert engine.cache.total_size() == 16
    while engine.has_work():
        engine.step()
    assert engine.cache.total_size() == len(prompt) + 1


def _few_shot(engine, n_questions: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """48 shared example tokens and questions that differ from their first token."""
    shots, *questions = random_prompts(n_questions + 1, engine.runner.vocab_size, seed=seed,
                                       min_len=6, max_len=12)
    shots = (shots * 10)[:48]
    for i, q in enumerate(questions):
        q[0] = 10 + i
    return shots, questions


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [512, 32])
def test_questions_arriving_with_their_shared_examples_compute_them_once(model, overlap,
                                                                         budget):
    """Few-shot questions sent together into an empty cache: the examples are computed
    once, also when the next step is scheduled while the first prefill still runs
    (overlap), and when the first question's prefill is cut into chunks (a budget of 32
    tokens: the others wait for the chunk that holds the rest of the examples)."""
    engine = make_engine(model, enable_overlap=overlap, max_prefill_tokens=budget)
    shots, questions = _few_shot(engine, 6, seed=8)
    outs = engine.generate([shots + q for q in questions], SamplingParams(max_new_tokens=3,
                                                                           **GREEDY))
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [len(shots)] * 5
    engine.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_questions_share_the_examples_in_the_step_that_computes_them(model, overlap):
    """The first step takes every question: the first computes the examples and its own
    tokens, each of the others only its own, reading the examples' K/V that the same
    forward stores before its attention runs. No slot is spent twice."""
    engine = make_engine(model, enable_overlap=overlap)
    shots, questions = _few_shot(engine, 6, seed=9)
    params = SamplingParams(max_new_tokens=4, **GREEDY)
    free = engine.slots.available_size()
    rids = [engine.add_request(shots + q, params) for q in questions]
    outputs = engine.step()
    assert engine.scheduler.waiting == []
    computed = len(shots) + sum(len(q) for q in questions)
    assert free - engine.slots.available_size() == computed
    assert engine.cache.total_size() == computed  # all of it shareable at once
    got = {rid: [] for rid in rids}
    while True:
        for o in outputs:
            got[o.request_id].extend(o.new_token_ids)
        engine.check_integrity()
        if not engine.has_work():
            break
        outputs = engine.step()
    # the same tokens as each question served alone, from an empty cache
    for q, rid in zip(questions, rids):
        alone = make_engine(model).generate([shots + q], params)[0]
        assert got[rid] == alone.token_ids


def test_identical_prompts_sent_together_compute_all_but_one_token_once(model):
    """The second copy matches all of the first's prompt but the last token, which it
    computes itself in the same step; its duplicate slot is freed once it finishes."""
    engine = make_engine(model)
    (prompt,) = random_prompts(1, engine.runner.vocab_size, seed=10, min_len=20, max_len=20)
    params = SamplingParams(max_new_tokens=3, **GREEDY)
    outs = engine.generate([prompt, list(prompt)], params)
    assert [o.num_cached_tokens for o in outs] == [0, len(prompt) - 1]
    assert outs[0].token_ids == outs[1].token_ids
    engine.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_waves_of_prompts_sharing_prefixes_keep_their_tokens_and_leave_no_slot_in_use(
        model, overlap):
    """Waves of prompts built from four shared prefixes (some sent twice), in a pool small
    enough to evict and retract, with prefills cut into chunks and random aborts: the
    accounting holds at every step, nothing is left in use, and the greedy requests that
    ran to the end produced what they produce alone."""
    engine = make_engine(model, max_total_tokens=300, max_running_requests=24,
                         max_prefill_tokens=48, new_token_ratio=0.0, enable_overlap=overlap)
    rng = random.Random(3)
    vocab = engine.runner.vocab_size
    prefixes = random_prompts(4, vocab, seed=12, min_len=20, max_len=60)
    suffixes = random_prompts(60, vocab, seed=13, min_len=1, max_len=12)
    prompts = []
    for suffix in suffixes:
        prompts.append(rng.choice(prefixes) + suffix)
        if rng.random() < 0.2:
            prompts.append(list(prompts[-1]))
    params = SamplingParams(max_new_tokens=8, **GREEDY)
    prompt_of: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    completed: list[str] = []
    aborted: set[str] = set()
    steps = 0
    while len(prompt_of) < len(prompts) or engine.has_work():
        for _ in range(rng.randint(0, 8)):
            if len(prompt_of) < len(prompts):
                p = prompts[len(prompt_of)]
                rid = engine.add_request(p, params)
                prompt_of[rid], tokens[rid] = p, []
        live = [r for r in prompt_of if r not in aborted and r not in completed]
        if live and rng.random() < 0.1:
            rid = rng.choice(live)
            engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished and out.finish_reason != "abort":
                completed.append(out.request_id)
        if not engine.step_in_flight:
            engine.check_integrity()
        steps += 1
        assert steps < 3000, "engine made no progress"
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["kv_tokens_in_use_by_requests"] == 0
    engine.check_integrity()
    assert len(completed) > len(prompts) // 2
    assert engine.scheduler.num_retractions > 0  # the pool was short: some were preempted
    alone = make_engine(model)
    for rid in completed:
        assert tokens[rid] == alone.generate([prompt_of[rid]], params)[0].token_ids
