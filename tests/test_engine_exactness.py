"""Greedy output is token-identical to transformers' generate on the same float32
weights, whatever the batching: staggered arrivals, radix cache on and off, tiny
prefill chunks, and KV pools small enough to force eviction and retraction."""
from __future__ import annotations

import pytest

from backend.core import SamplingParams
from engine_helpers import hf_greedy, make_engine, random_prompts, run_staggered, tiny_model

NEW_TOKENS = 12
NUM_PROMPTS = 16

SETTINGS = {
    "cache-on": dict(enable_radix_cache=True),
    "cache-off": dict(enable_radix_cache=False),
    "chunk-5": dict(enable_radix_cache=True, max_prefill_tokens=5),
    "fcfs-chunk-3": dict(enable_radix_cache=True, schedule_policy="fcfs", max_prefill_tokens=3),
    # 16 prompts of up to 40 tokens + 12 new each need ~ 830 slots: 140 forces eviction
    # of finished prefixes and retraction of running requests
    "small-pool": dict(enable_radix_cache=True, max_total_tokens=140, max_prefill_tokens=16),
    "small-pool-no-cache": dict(enable_radix_cache=False, max_total_tokens=140, max_prefill_tokens=16),
    # overlap scheduling (on by default on CUDA): steps are built before the previous
    # step's tokens reach the host
    "overlap": dict(enable_overlap=True, max_prefill_tokens=7),
    "overlap-small-pool": dict(enable_overlap=True, max_total_tokens=140, max_prefill_tokens=16),
}

_REFERENCE: dict = {}


def _case(tmp_root, arch):
    if arch not in _REFERENCE:
        path = tiny_model(tmp_root, arch)
        engine = make_engine(path)
        vocab = engine.runner.vocab_size
        prompts = random_prompts(NUM_PROMPTS, vocab, seed=7)
        # repeat some prompts and prefixes so the radix cache really serves hits
        prompts[3] = list(prompts[1])
        prompts[5] = prompts[2][:10] + prompts[5]
        prompts[9] = prompts[2][:20] + prompts[9][:3]
        _REFERENCE[arch] = (path, prompts, hf_greedy(path, prompts, NEW_TOKENS))
    return _REFERENCE[arch]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("exactness")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(tmp_root, arch, setting):
    path, prompts, expected = _case(tmp_root, arch)
    engine = make_engine(path, **SETTINGS[setting])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = run_staggered(engine, prompts, params, every=2)
    mismatches = [i for i in range(len(prompts)) if got[i] != expected[i]]
    assert not mismatches, f"prompts {mismatches} differ: {got[mismatches[0]]} vs {expected[mismatches[0]]}"
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    if "small-pool" in setting:
        assert stats["num_retractions"] > 0, "the small pool was meant to force retraction"
    engine.check_integrity()


def test_generate_api_returns_results_in_order(tmp_root):
    path, prompts, expected = _case(tmp_root, "qwen2")
    engine = make_engine(path)
    outs = engine.generate(prompts[:6], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                       ignore_eos=True))
    assert [o.token_ids for o in outs] == expected[:6]
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.num_prompt_tokens for o in outs] == [len(p) for p in prompts[:6]]
    assert [o.text for o in outs] == [engine.tokenizer.decode(e, skip_special_tokens=True)
                                      for e in expected[:6]]


def test_every_form_of_the_model_output_gives_the_same_logits(tmp_root):
    # what CUDA graphs end with (logits_input), the norm applied (final_hidden) and the
    # raw residual stream all reach compute_logits and must agree with each other
    import torch

    from backend.core.forward_batch import ForwardBatch
    path, prompts, _ = _case(tmp_root, "llama")
    runner = make_engine(path).runner
    ids = prompts[0][:6]
    batch = ForwardBatch.build(input_ids=ids, req_pool_indices=[1], extend_prefix_lens=[0],
                               extend_seq_lens=[len(ids)], out_cache_loc=list(range(1, 7)),
                               logits_indices=[2, 5], device="cpu")
    model = runner.model
    with torch.inference_mode():
        runner.req_pool.req_to_token[1, :6] = batch.out_cache_loc.to(torch.int32)
        runner.attn.prepare(batch)
        stream = model(batch, runner.attn)
        forms = [model.compute_logits(h) for h in
                 (stream, model.final_hidden(stream), model.logits_input(stream))]
    assert forms[0].shape == (2, runner.vocab_size) and forms[0].dtype == torch.float32
    assert torch.isfinite(forms[0]).all() and forms[0].std() > 0
    for other in forms[1:]:
        assert torch.equal(other, forms[0])
    # and it is the runner's own answer for the batch
    assert torch.equal(runner.forward(batch), forms[0])
