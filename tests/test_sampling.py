"""Sampler specs on hand-made logits (CPU, float32): the filters (temperature, top-k,
top-p, min-p), the penalties, the seeded draw, mixed greedy/sampled batches and the
reported logprobs; then SamplingParams.from_dict validation.

Probabilities are built as logits = log(p), so softmax gives p back and every expected
value below can be checked by hand."""
from __future__ import annotations

import math

import pytest
import torch

from backend.core import SamplingParams
from backend.core.sampling import (SamplingRow, apply_penalties, argmax_rows, draw,
                                   filter_logits, sample, vocab_chunks)
from backend.core.transfer import HostToDevice

CPU = HostToDevice("cpu")

# The most likely token is not at index 0, so a filter that forgets to sort is caught.
#           token:   0     1     2     3
PROBS = torch.tensor([0.15, 0.05, 0.50, 0.30])
LOGITS = PROBS.log()


def _filter(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """filter_logits for one row; returns the probability vector."""
    return filter_logits(logits.unsqueeze(0), torch.tensor([float(temperature)]),
                         torch.tensor([top_k]), torch.tensor([float(top_p)]),
                         torch.tensor([float(min_p)]))[0]


def _kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def _row(prompt=(), output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- greedy

def test_greedy_picks_the_argmax_of_each_row():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9],
                           [5.0, 4.0, 3.0, 2.0],
                           [-3.0, -2.0, -1.0, -4.0]])
    res = sample(logits, [_row(temperature=0.0) for _ in range(3)], CPU, 0, want_logprobs=False)
    assert res.token_ids.tolist() == [1, 0, 2]


@pytest.mark.parametrize("vocab", [128256, 151936, 49152, 32000, 1000, 4099])
def test_the_two_round_argmax_is_torch_argmax_ties_and_nans_included(vocab):
    """argmax_rows cuts a row into chunks (128,256 = 256 x 501; a prime 4099 is not
    cut): the same index as argmax, the first of tied maxima even across chunks, the
    first NaN where a row has one."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    logits[1, [7, vocab // 2, vocab - 1]] = 50.0  # tied maxima in different chunks
    logits[2] = 0.0  # all tied: index 0
    logits[3, [vocab - 3, 5]] = float("nan")  # NaN wins, the first one
    logits[4, vocab - 1] = float("inf")
    logits[5, :] = float("-inf")
    logits[5, vocab // 3] = -1.0
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[1].item() == 7 and argmax_rows(logits)[3].item() == 5


def test_vocabularies_are_cut_into_chunks_of_at_least_256_logits():
    assert vocab_chunks(128256) == 256 and 128256 // 256 == 501
    assert vocab_chunks(32000) == 125 and vocab_chunks(4099) == 1
    assert vocab_chunks(1000) == 1  # under 16 chunks of 256: one round
    for v in (151936, 49152, 262144, 50257, 32064):
        c = vocab_chunks(v)
        assert c == 1 or (v % c == 0 and v // c >= 256 and 16 <= c <= 256)


def test_top_k_one_is_greedy_even_at_high_temperature():
    # near-flat distribution: a real draw would leave the argmax most of the time
    logits = torch.tensor([[1.0, 1.1, 1.05, 0.9]]).repeat(200, 1)
    rows = [_row(temperature=5.0, top_k=1, generator=_seeded(i)) for i in range(200)]
    res = sample(logits, rows, CPU, 0, want_logprobs=False)
    assert res.token_ids.tolist() == [1] * 200


def test_top_k_one_filter_keeps_only_the_argmax():
    probs = _filter(LOGITS, top_k=1)
    assert _kept(probs) == {2}


# ---------------------------------------------------------------------------- top-p / top-k / min-p

def test_tiny_top_p_keeps_only_the_most_likely_token():
    assert _kept(_filter(LOGITS, top_p=1e-6)) == {2}


@pytest.mark.parametrize("top_p, survivors", [
    (0.4, {2}),           # 0.5 alone reaches 0.4
    (0.7, {2, 3}),        # 0.5 < 0.7; 0.5 + 0.3 reaches it
    (0.8, {2, 3}),        # 0.5 + 0.3 = 0.8 reaches 0.8 exactly: 0.15 is not needed
    (0.81, {2, 3, 0}),    # just past 0.8: the 0.15 token is needed
    (0.95, {2, 3, 0}),    # 0.5 + 0.3 + 0.15 = 0.95 reaches it exactly
    (0.96, {2, 3, 0, 1}),
    (1.0, {2, 3, 0, 1}),
])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(top_p, survivors):
    probs = _filter(LOGITS, top_p=top_p)
    assert _kept(probs) == survivors
    for t in survivors:  # survivors keep their probability (no reshaping by the filter)
        assert probs[t].item() == pytest.approx(PROBS[t].item(), abs=1e-6)


@pytest.mark.parametrize("top_k, survivors", [(2, {2, 3}), (3, {2, 3, 0}), (-1, {0, 1, 2, 3}),
                                               (0, {0, 1, 2, 3})])
def test_top_k_keeps_the_k_most_likely_tokens(top_k, survivors):
    assert _kept(_filter(LOGITS, top_k=top_k)) == survivors


@pytest.mark.parametrize("min_p, survivors", [
    (0.0, {0, 1, 2, 3}),
    (0.2, {2, 3, 0}),     # threshold 0.1: 0.05 goes
    (0.5, {2, 3}),        # threshold 0.25: 0.15 goes
    (0.7, {2}),           # threshold 0.35: 0.3 goes
])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, survivors):
    assert _kept(_filter(LOGITS, min_p=min_p)) == survivors


def test_filters_combine_as_an_intersection():
    # top_k=3 keeps {2,3,0}; top_p=0.7 keeps {2,3}; min_p=0.5 keeps {2,3}
    assert _kept(_filter(LOGITS, top_k=3, top_p=0.7, min_p=0.5)) == {2, 3}
    # top_p=0.95 keeps {2,3,0}, min_p=0.5 drops 0
    assert _kept(_filter(LOGITS, top_p=0.95, min_p=0.5)) == {2, 3}


# ---------------------------------------------------------------------------- temperature

def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_divides_the_logits_before_softmax(temperature):
    logits = [2.0, 1.0, 0.0, -1.0]
    probs = _filter(torch.tensor(logits), temperature=temperature)
    expected = _softmax([x / temperature for x in logits])
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)


def test_low_temperature_sharpens_and_high_temperature_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cold, base, hot = (_filter(logits, temperature=t) for t in (0.5, 1.0, 2.0))
    assert cold[0] > base[0] > hot[0]
    assert cold[3] < base[3] < hot[3]
    # hand computation of the top token's probability at T = 0.5: e^4 / (e^4 + e^2 + 1 + e^-2)
    assert cold[0].item() == pytest.approx(math.exp(4) / (math.exp(4) + math.exp(2) + 1 + math.exp(-2)),
                                           abs=1e-6)


def test_temperature_applies_before_top_p():
    # at T=1 the top token alone (0.5) does not reach 0.6; at T=0.25 it has 0.5^4/sum(p^4) > 0.6
    assert _kept(_filter(LOGITS, temperature=1.0, top_p=0.6)) == {2, 3}
    assert _kept(_filter(LOGITS, temperature=0.25, top_p=0.6)) == {2}


# ---------------------------------------------------------------------------- penalties

def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 4.0, 1.0]])
    # token 0 in the prompt, 1 in the output, 2 in both (penalised once), 3 in the prompt twice
    apply_penalties(logits, [_row(prompt=[0, 2, 3, 3], output=[1, 2], repetition_penalty=2.0)])
    assert logits[0].tolist() == [1.0, -2.0, 1.5, -4.0, 4.0, 1.0]


def test_repetition_penalty_of_one_changes_nothing():
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    apply_penalties(logits, [_row(prompt=[0, 1], output=[2], repetition_penalty=1.0)])
    assert logits[0].tolist() == [2.0, -1.0, 3.0]


def test_frequency_and_presence_penalties_cover_output_tokens_only():
    logits = torch.zeros(1, 6)
    # token 4 appears in the prompt only: untouched; 1 appears 3 times, 3 once in the output
    apply_penalties(logits, [_row(prompt=[4, 4, 1], output=[1, 3, 1, 1],
                                  frequency_penalty=0.5, presence_penalty=0.25)])
    assert logits[0].tolist() == pytest.approx([0.0, -(3 * 0.5 + 0.25), 0.0, -(0.5 + 0.25), 0.0, 0.0])


def test_negative_frequency_penalty_raises_repeated_tokens():
    logits = torch.zeros(1, 4)
    apply_penalties(logits, [_row(output=[2, 2], frequency_penalty=-1.0)])
    assert logits[0].tolist() == [0.0, 0.0, 2.0, 0.0]


def test_penalties_are_per_row():
    logits = torch.ones(2, 3)
    apply_penalties(logits, [_row(output=[0], presence_penalty=1.0), _row(output=[0])])
    assert logits.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_penalties_change_the_greedy_choice_but_not_the_callers_logits():
    logits = torch.tensor([[3.0, 2.5, 1.0]])
    before = logits.clone()
    res = sample(logits, [_row(prompt=[0], temperature=0.0, repetition_penalty=2.0)], CPU, 0,
                 want_logprobs=False)
    assert res.token_ids.tolist() == [1]  # 3.0 / 2 = 1.5 < 2.5
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------- the draw

def test_seeded_draw_repeats_exactly():
    probs = torch.full((500, 10), 0.1)
    first = draw(probs, [_seeded(42)] * 500)  # one generator feeds every row in turn
    again = draw(probs, [_seeded(42)] * 500)
    assert torch.equal(first, again)
    assert len(set(first.tolist())) == 10  # the draws themselves vary


def test_different_seeds_draw_different_sequences():
    probs = torch.full((500, 10), 0.1)
    a = draw(probs, [_seeded(1)] * 500)
    b = draw(probs, [_seeded(2)] * 500)
    assert (a != b).sum().item() > 300  # ~450 expected for independent uniform draws


def test_draw_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3]]).repeat(2000, 1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        picks = draw(probs, [None] * 2000)
    assert set(picks.tolist()) == {1, 3}


def test_empirical_frequencies_match_the_filtered_distribution():
    n = 20000
    # T = 2 then top_k = 3: p ∝ sqrt(p) over tokens {2, 3, 0}; token 1 never
    root = {t: math.sqrt(PROBS[t].item()) for t in (0, 2, 3)}
    expected = {t: v / sum(root.values()) for t, v in root.items()}
    rows = [_row(temperature=2.0, top_k=3) for _ in range(n)]
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        tokens = sample(LOGITS.repeat(n, 1), rows, CPU, 0, want_logprobs=False).token_ids
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[1] == 0
    for t, p in expected.items():
        # the standard error is at most 0.0035 here; 0.015 is over four of them
        assert counts[t] / n == pytest.approx(p, abs=0.015), (t, counts)


def test_mixed_batch_keeps_greedy_rows_at_the_argmax():
    # argmax (token 2) has only 0.5: a sampled row leaves it about half of the time
    n = 400
    logits = LOGITS.repeat(n, 1)
    rows = [_row(temperature=0.0) if i % 2 == 0 else _row(temperature=1.0, generator=_seeded(i))
            for i in range(n)]
    tokens = sample(logits, rows, CPU, 0, want_logprobs=False).token_ids.tolist()
    greedy, sampled = tokens[0::2], tokens[1::2]
    assert greedy == [2] * (n // 2)
    assert 60 < sum(t != 2 for t in sampled) < 140  # ~100 expected: the sampled rows do sample


# ---------------------------------------------------------------------------- logprobs

def test_logprobs_score_the_raw_logits_not_the_penalised_or_tempered_ones():
    raw = torch.tensor([[3.0, 2.5, 1.0, 0.0],
                        [0.0, 1.0, 4.0, 2.0]])
    before = raw.clone()
    rows = [_row(prompt=[0], temperature=0.0, repetition_penalty=4.0),  # greedy picks 1, not 0
            _row(temperature=0.3, top_k=2, presence_penalty=2.0, output=[2], generator=_seeded(5))]
    res = sample(raw, rows, CPU, num_top_logprobs=2, want_logprobs=True)
    logp = torch.log_softmax(before, dim=-1)
    chosen = res.token_ids.tolist()
    assert chosen[0] == 1
    assert res.logprobs.tolist() == pytest.approx([logp[i, t].item() for i, t in enumerate(chosen)])
    # top alternatives come from the raw distribution: token 0 leads row 0 despite its penalty
    assert res.top_ids.tolist() == [[0, 1], [2, 3]]
    assert torch.allclose(res.top_logprobs, torch.stack([logp[0, [0, 1]], logp[1, [2, 3]]]))
    assert torch.equal(raw, before)


def test_no_logprobs_unless_asked():
    res = sample(LOGITS.unsqueeze(0), [_row(temperature=0.0)], CPU, 0, want_logprobs=False)
    assert res.logprobs is None and res.top_ids is None and res.top_logprobs is None


def test_chosen_logprob_without_alternatives():
    res = sample(LOGITS.unsqueeze(0), [_row(temperature=0.0)], CPU, 0, want_logprobs=True)
    assert res.logprobs.tolist() == pytest.approx([math.log(0.5)], abs=1e-6)
    assert res.top_ids is None


# ---------------------------------------------------------------------------- SamplingParams.from_dict

def test_max_tokens_is_an_alias_of_max_new_tokens():
    assert SamplingParams.from_dict({"max_tokens": 7}).max_new_tokens == 7


def test_none_values_mean_the_default():
    p = SamplingParams.from_dict({"temperature": None, "top_k": None})
    assert (p.temperature, p.top_k) == (1.0, -1)


def test_unknown_keys_raise_naming_each_of_them():
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"max_tokens": 3, "temprature": 0.5, "top_q": 0.9})
    assert "temprature" in str(err.value) and "top_q" in str(err.value)
    assert "max_tokens" not in str(err.value)


@pytest.mark.parametrize("key, value", [
    ("max_new_tokens", 2.5),
    ("max_new_tokens", "16"),
    ("top_k", "5"),
    ("top_k", True),
    ("n", 1.0),
    ("temperature", "hot"),
    ("top_p", [0.9]),
    ("min_p", "0.1"),
    ("repetition_penalty", False),
    ("seed", 1.5),
    ("stop", 5),
    ("stop_token_ids", ["eos"]),
    ("stop_token_ids", 3),
    ("logprobs", "3"),
    ("logprobs", 2.5),
])
def test_wrongly_typed_values_raise_value_error(key, value):
    with pytest.raises(ValueError):
        SamplingParams.from_dict({key: value})


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams.from_dict({"stop": "END"}).stop == ["END"]
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ["a", "b"]


@pytest.mark.parametrize("data", [
    {"regex": "[a-z]+", "json_schema": "{\"type\": \"string\"}"},
    {"regex": "[a-z]+", "choices": ["yes", "no"]},
    {"ebnf": "root ::= \"a\"", "response_format": {"type": "json_object"}},
])
def test_conflicting_constraints_are_rejected(data):
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams.from_dict(data)


def test_a_single_constraint_is_accepted():
    assert SamplingParams.from_dict({"regex": "[a-z]+"}).constraint == ("regex", "[a-z]+")
    schema = SamplingParams.from_dict({"json_schema": {"type": "string"}})
    assert schema.constraint == ("json_schema", "{\"type\": \"string\"}")


@pytest.mark.parametrize("data, message", [
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"min_p": 1.5}, "min_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": [""]}, "stop"),
])
def test_out_of_range_values_raise_naming_the_parameter(data, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(data)


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
