"""The shared prefix of a decode batch (cascade attention's input): the longest run of
leading positions whose KV slots are the same in every row, below every row's new token,
found on the host and carried to the device with the batch."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.core import SamplingParams
from backend.core.forward_batch import BatchSpec
from backend.core.parallel.protocol import RankStep, decode, encode
from backend.core.shared_prefix import SharedPrefixTracker, common_prefix_len
from engine_helpers import make_engine, random_prompts, tiny_model


@given(a=st.lists(st.integers(0, 3), max_size=40), b=st.lists(st.integers(0, 3), max_size=40),
       limit=st.integers(0, 50))
def test_common_prefix_len_is_the_first_mismatch_within_the_limit(a, b, limit):
    naive = 0
    while naive < min(limit, len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix_len(a, b, limit) == naive


def _req(rid, slots):
    return SimpleNamespace(rid=rid, kv_indices=slots)


def test_rows_share_the_slots_they_all_hold_below_the_first_row_to_differ():
    tracker = SharedPrefixTracker()
    prefix = list(range(100, 164))
    reqs = [_req("a", prefix + [1, 2, 3]), _req("b", prefix + [7]), _req("c", prefix + [1, 9])]
    assert tracker.shared_len(reqs, [67, 65, 66]) == 64
    # one row alone shares nothing with anyone
    assert tracker.shared_len(reqs[:1], [67]) == 0


def test_the_shared_prefix_stays_below_every_rows_new_token():
    tracker = SharedPrefixTracker()
    slots = list(range(50))
    # two rows with identical slot lists (their new slots not yet listed): the shortest
    # row's new token, at position 20, caps it
    reqs = [_req("a", slots), _req("b", slots)]
    assert tracker.shared_len(reqs, [30, 20]) == 20
    # the same requests a step later: the cap moves with them (the scan is redone)
    assert tracker.shared_len(reqs, [31, 21]) == 21


def test_the_last_scan_is_reused_only_for_the_same_requests():
    tracker = SharedPrefixTracker()
    a, b = _req("a", [1, 2, 3, 4, 5]), _req("b", [1, 2, 9, 9, 9])
    assert tracker.shared_len([a, b], [5, 5]) == 2
    # a new request set is scanned again, though its pool rows may be the old ones'
    c = _req("c", [1, 2, 3, 4, 8])
    assert tracker.shared_len([a, c], [5, 5]) == 4
    a.kv_indices = [6, 6, 6, 6, 6]  # the same requests keep their slots: no rescan
    assert tracker.shared_len([a, c], [5, 5]) == 4


def test_the_batch_spec_carries_it_to_every_rank_and_onto_the_device():
    spec = BatchSpec(decode=True, input_ids=[5, 6, 7], req_pool_indices=[1, 2, 3],
                     out_cache_loc=[40, 41, 42], positions=[30, 31, 32], shared_prefix_len=30)
    back = decode(encode(RankStep([], spec, 3)))
    assert back.batch == spec
    batch = spec.build("cpu")
    assert batch.shared_prefix_len_cpu == 30
    assert batch.shared_prefix_len.tolist() == [30]
    # an extend batch shares nothing
    extend = BatchSpec(decode=False, input_ids=[5, 6], req_pool_indices=[1],
                       out_cache_loc=[40, 41], extend_prefix_lens=[0], extend_seq_lens=[2],
                       logits_indices=[1]).build("cpu")
    assert extend.shared_prefix_len_cpu == 0 and extend.shared_prefix_len.tolist() == [0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("shared"), "llama")


def test_requests_after_a_cached_prompt_decode_with_it_as_their_shared_prefix(model):
    engine = make_engine(model)
    shots, *questions = random_prompts(4, engine.runner.vocab_size, seed=3, min_len=24,
                                       max_len=40)
    for i, q in enumerate(questions):  # each question starts differently
        q[0] = 10 + i
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    engine.generate([shots + [10]], params)  # the examples are cached now
    seen: list[int] = []
    build = engine.forward_step._build_decode

    def spy(items):
        spec = build(items)
        if spec is not None and len(items) == len(questions):
            seen.append(spec.shared_prefix_len)
        return spec

    engine.forward_step._build_decode = spy
    engine.generate([shots + q for q in questions], params)
    assert seen and set(seen) == {len(shots)}
