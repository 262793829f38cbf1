"""The engine honours vLLM's sampling keys: minimum length, logit bias, allowed and bad
tokens, stop regular expressions, stop strings kept in the output, best_of, prompt
truncation, logprob entries with ranks and texts, scoring after an empty prompt; and it
refuses token ids outside the vocabulary, work beyond its admission bound, and flushes
its prefix cache on request."""
from __future__ import annotations

import re

import pytest

from backend.core import SamplingParams
from engine_helpers import make_engine, random_prompts, tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("rules"), "llama")


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(model, max_total_tokens=2048)


def one(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams(**params))[0]


@pytest.fixture(scope="module")
def prompt(engine):
    return random_prompts(1, engine.runner.vocab_size, seed=4, min_len=8, max_len=8)[0]


@pytest.fixture(scope="module")
def base(engine, prompt):
    return one(engine, prompt, max_new_tokens=12, **GREEDY)


def test_min_tokens_holds_back_the_stop_token_until_that_many_tokens(engine, prompt, base):
    stop = base.token_ids[0]
    early = one(engine, prompt, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])
    assert (early.token_ids, early.finish_reason) == ([stop], "stop")
    held = one(engine, prompt, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop],
               min_new_tokens=5)
    assert len(held.token_ids) >= 5
    assert stop not in held.token_ids[:5]


def test_a_large_logit_bias_makes_its_token_the_greedy_choice(engine, prompt, base):
    favourite = next(t for t in range(20, 100) if t not in base.token_ids)
    out = one(engine, prompt, max_new_tokens=6, logit_bias={favourite: 100}, **GREEDY)
    assert out.token_ids == [favourite] * 6


def test_allowed_token_ids_are_the_only_tokens_drawn(engine, prompt):
    allowed = [31, 47, 52]
    out = one(engine, prompt, max_new_tokens=10, temperature=1.0, seed=3, ignore_eos=True,
              allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 10


def test_bad_words_never_appear(engine, prompt, base):
    word = engine.tokenizer.decode(base.token_ids[:2])
    banned = engine.intake._bad_word_ids([word])
    out = one(engine, prompt, max_new_tokens=12, bad_words=[word], **GREEDY)
    ids = out.token_ids
    for seq in banned:
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids)))
    assert ids != base.token_ids


def test_a_stop_regex_ends_the_output_where_its_first_match_ends(engine, prompt, base):
    assert len(base.text) >= 6
    target = base.text[3:6]
    out = one(engine, prompt, max_new_tokens=12, stop_regex=[re.escape(target)], **GREEDY)
    end = base.text.index(target) + len(target)
    assert (out.text, out.finish_reason) == (base.text[:end], "stop")


def test_include_stop_str_in_output_keeps_the_stop_string(engine, prompt, base):
    stop = base.text[2:5]
    cut = one(engine, prompt, max_new_tokens=12, stop=[stop], **GREEDY)
    kept = one(engine, prompt, max_new_tokens=12, stop=[stop], include_stop_str_in_output=True,
               **GREEDY)
    at = base.text.index(stop)
    assert (cut.text, kept.text) == (base.text[:at], base.text[:at + len(stop)])


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(engine, prompt):
    sampled = dict(max_new_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    every = one(engine, prompt, n=4, cumulative_logprob=True, **sampled)
    best = one(engine, prompt, n=2, best_of=4, **sampled)
    ranked = sorted(every.samples, key=lambda s: -s.cumulative_logprob)
    assert [s.token_ids for s in [best, *best.samples[1:]]] == \
        [s.token_ids for s in ranked[:2]]
    assert len(best.samples) == 2


def test_truncate_prompt_tokens_keeps_the_prompts_tail(engine, prompt):
    cut = one(engine, prompt, max_new_tokens=5, truncate_prompt_tokens=3, **GREEDY)
    tail = one(engine, prompt[-3:], max_new_tokens=5, **GREEDY)
    assert (cut.num_prompt_tokens, cut.token_ids) == (3, tail.token_ids)


def test_logprob_entries_carry_rank_text_and_the_asked_alternatives(engine, prompt):
    chosen_only = one(engine, prompt, max_new_tokens=4, logprobs=0, **GREEDY)
    with_top = one(engine, prompt, max_new_tokens=4, logprobs=2, **GREEDY)
    for lp, tid in zip(chosen_only.logprobs, chosen_only.token_ids):
        assert (lp.token_id, lp.top, lp.rank) == (tid, None, 1)  # greedy: the most likely
        assert lp.text == engine.tokenizer.decode([tid])
    for lp in with_top.logprobs:
        assert len(lp.top) == 2 and list(lp.top)[0] == lp.token_id
        assert lp.top_text == {t: engine.tokenizer.decode([t]) for t in lp.top}
    assert with_top.cumulative_logprob == pytest.approx(
        sum(lp.logprob for lp in with_top.logprobs), abs=1e-5)


def test_prompt_logprobs_of_several_samples_are_computed_once(engine, prompt):
    out = one(engine, prompt, n=3, max_new_tokens=2, prompt_logprobs=1, **GREEDY)
    assert [e.token_id for e in out.prompt_logprobs] == prompt
    assert out.prompt_logprobs[0].logprob is None
    assert all(len(e.top) == 1 for e in out.prompt_logprobs[1:])


@pytest.mark.parametrize("params, message", [
    (dict(stop_token_ids=[10 ** 6]), r"stop_token_ids entries must be token ids in \[0, \d+\)"),
    (dict(allowed_token_ids=[5, 10 ** 6]), "allowed_token_ids entries must be token ids"),
    (dict(logit_bias={10 ** 6: 1.0}), "logit_bias keys must be token ids"),
    (dict(top_k=10 ** 12), "top_k must be at most the vocabulary size"),
])
def test_token_ids_outside_the_vocabulary_are_refused(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SamplingParams(**params))


def test_input_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, \d+\), got "
                                         "1099511627776"):
        engine.add_request([5, 2 ** 40], SamplingParams())


def test_scoring_after_an_empty_prompt_scores_each_choice_from_its_second_token(engine):
    rid = engine.add_score_request("", ["hello world", "good morning"])
    scores = None
    while scores is None:
        scores = next((o.choice_scores for o in engine.step() if o.request_id == rid), None)
    for score, choice in zip(scores, ["hello world", "good morning"]):
        ids = engine.tokenizer.encode(choice)  # with the tokenizer's BOS, if it adds one
        assert score.token_ids == ids[1:] and score.num_tokens == len(ids) - 1


def test_json_object_output_is_an_object(engine, prompt):
    out = one(engine, prompt, max_new_tokens=24, response_format={"type": "json_object"},
              **GREEDY)
    assert out.text.lstrip().startswith("{")


def test_new_work_is_refused_beyond_the_admission_bound(model):
    busy = make_engine(model, max_waiting_requests=2)
    busy.add_request("one", SamplingParams())
    busy.add_request("two", SamplingParams())
    with pytest.raises(ValueError, match="the server is busy: 2 requests are waiting"):
        busy.add_request("three", SamplingParams())


def test_flush_cache_drops_every_unused_cached_prefix(model):
    fresh = make_engine(model)
    fresh.generate(["a prompt to cache"], SamplingParams(max_new_tokens=3, **GREEDY))
    assert fresh.stats()["radix_cache_tokens"] > 0
    assert fresh.flush_cache() > 0
    assert fresh.stats()["radix_cache_tokens"] == 0
    fresh.check_integrity()
