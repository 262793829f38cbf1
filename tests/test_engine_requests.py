"""Request-level behaviour of the engine: validation, finishing rules, streaming text,
logprobs, seeds, aborts — and that no KV slot ever leaks."""
from __future__ import annotations

import random

import pytest
import torch

from backend.core import SamplingParams
from engine_helpers import make_engine, random_prompts, tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("requests"), "llama")


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(model, max_total_tokens=2048)


@pytest.mark.parametrize("prompt, params, message", [
    ("", {}, "prompt is empty"),
    ([], {}, "prompt is empty"),
    ([1, 2, -5], {}, "token ids"),
    ("hello", {"max_tokens": 0}, "max_tokens must be >= 1"),
    ("hello", {"top_p": 0.0}, "top_p"),
    ("hello", {"top_p": 1.5}, "top_p"),
    ("hello", {"temperature": -1}, "temperature"),
    ("hello", {"bogus_key": 1}, "unknown sampling parameter(s): bogus_key"),
    ("hello", {"n": 0}, "n must be"),
])
def test_bad_input_raises_clear_value_error(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.add_request(prompt, params)


def test_prompt_longer_than_context_is_rejected(engine):
    too_long = [11] * engine.context_len
    with pytest.raises(ValueError, match="context length"):
        engine.add_request(too_long, SamplingParams(max_new_tokens=1))
    out = engine.generate([[11, 12, 13]], SamplingParams(max_new_tokens=2, **GREEDY))[0]
    assert len(out.token_ids) == 2  # the engine keeps serving


def test_max_new_tokens_and_length_reason(engine):
    out = engine.generate(["hello world"], SamplingParams(max_new_tokens=7, **GREEDY))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids_end_the_request_and_keep_the_token_out_of_text(engine):
    base = engine.generate(["hello world"], SamplingParams(max_new_tokens=8, **GREEDY))[0]
    stop_at = base.token_ids[3]
    out = engine.generate(["hello world"], SamplingParams(max_new_tokens=8, stop_token_ids=[stop_at],
                                                          **GREEDY))[0]
    first = base.token_ids.index(stop_at)
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop"
    assert out.text == engine.tokenizer.decode(base.token_ids[:first], skip_special_tokens=True)


def test_stop_string_is_cut_from_text(engine):
    base = engine.generate(["xin chào"], SamplingParams(max_new_tokens=16, **GREEDY))[0]
    assert len(base.text) >= 4
    stop = base.text[2:4]
    out = engine.generate(["xin chào"], SamplingParams(max_new_tokens=16, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:base.text.index(stop)]


def test_streamed_pieces_concatenate_to_the_final_text(engine):
    prompts = ["Hello there", "Xin chào thế giới", "สวัสดีครับ", "你好，世界"]
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    rids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    pieces = {i: [] for i in range(len(prompts))}
    ids = {i: [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            pieces[rids[out.request_id]].append(out.new_text)
            ids[rids[out.request_id]].extend(out.new_token_ids)
    for i in pieces:
        assert "".join(pieces[i]) == engine.tokenizer.decode(ids[i], skip_special_tokens=True)


def test_same_seed_same_output_different_seed_different_output(engine):
    def run(seed):
        return engine.generate(["hello"], SamplingParams(max_new_tokens=12, temperature=1.0,
                                                         seed=seed, ignore_eos=True))[0].token_ids
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_logprobs_match_a_direct_forward(engine, model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompt = random_prompts(1, engine.runner.vocab_size, seed=9, min_len=10, max_len=10)[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=4, logprobs=3,
                                                   prompt_logprobs=0, logprob_start_len=1,
                                                   **GREEDY))[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    for j, lp in enumerate(out.logprobs):
        pos = len(prompt) - 1 + j
        assert lp.token_id == seq[pos + 1]
        assert lp.logprob == pytest.approx(ref[pos, seq[pos + 1]].item(), abs=1e-4)
        top = ref[pos].topk(3)
        assert list(lp.top) == top.indices.tolist()
    # from logprob_start_len on, the first entry without a logprob (as SGLang's are)
    assert [p.token_id for p in out.prompt_logprobs] == prompt[1:]
    assert out.prompt_logprobs[0].logprob is None
    for k, p in enumerate(out.prompt_logprobs[1:]):
        assert p.logprob == pytest.approx(ref[k + 1, prompt[k + 2]].item(), abs=1e-4)
        assert p.text == engine.tokenizer.decode([prompt[k + 2]])


def test_abort_frees_everything(engine):
    rid = engine.add_request("hello world", SamplingParams(max_new_tokens=100, **GREEDY))
    engine.step()
    engine.step()
    engine.abort(rid)
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [(rid, True, "abort")]
    assert engine.stats()["num_running"] == 0
    engine.check_integrity()


@pytest.mark.parametrize("overlap, total", [(False, 1000), (True, 300)])
def test_thousand_random_requests_with_random_aborts_leave_no_slot_in_use(model, overlap, total):
    engine = make_engine(model, max_total_tokens=600, max_running_requests=48, max_prefill_tokens=96,
                         enable_overlap=overlap)
    rng = random.Random(0)
    prompts = random_prompts(total, engine.runner.vocab_size, seed=10, min_len=1, max_len=24)
    live: list[str] = []
    finished = 0
    submitted = 0
    steps = 0
    while finished < total:
        for _ in range(rng.randint(0, 12)):
            if submitted < total:
                params = SamplingParams(max_new_tokens=rng.randint(1, 8),
                                        temperature=rng.choice([0.0, 1.0]), ignore_eos=True)
                live.append(engine.add_request(prompts[submitted], params))
                submitted += 1
        if live and rng.random() < 0.3:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                finished += 1
                if out.request_id in live:
                    live.remove(out.request_id)
        steps += 1
        if steps % 25 == 0 and not engine.step_in_flight:
            engine.check_integrity()
        assert steps < 5000
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_tokens_in_use_by_requests"] == 0
    assert stats["finished_requests"] == total
    engine.check_integrity()


def test_warm_up_touches_only_the_dummy_slot_and_row(engine):
    """The start-up warm-up (run on GPUs to compile kernels) writes KV slot 0 and table
    row 0 only: no slot is taken from the pool and later outputs are unchanged."""
    before = engine.generate([[11, 12, 13, 14]], SamplingParams(max_new_tokens=5, **GREEDY))[0]
    free = engine.slots.available_size()
    engine.runner.warm_up()
    assert engine.slots.available_size() == free
    engine.check_integrity()
    engine.cache.reset()
    after = engine.generate([[11, 12, 13, 14]], SamplingParams(max_new_tokens=5, **GREEDY))[0]
    assert after.token_ids == before.token_ids


def test_warm_up_runs_the_round_lengths_and_those_the_attention_backend_names(engine,
                                                                              monkeypatch):
    """The backend's lengths (its prefill tiles: 5-8 tokens take their own at GROUP 4)
    join the round ones, each run once, in order, capped at the context length."""
    runner = engine.runner
    monkeypatch.setattr(runner.attn, "extend_warmup_lens", lambda num_heads, dtype: [5, 9, 16])
    lengths, forward = [], runner.forward
    monkeypatch.setattr(runner, "forward",
                        lambda batch: lengths.append(batch.extend_seq_lens_cpu[0]) or forward(batch))
    runner.warm_up()
    assert lengths == sorted({min(n, runner.context_len)
                              for n in (1, 5, 9, 16, 32, 64, 128, 256)})
    assert lengths[:4] == [1, 5, 9, 16]


def test_a_request_id_in_use_is_rejected_until_it_finishes(engine):
    engine.add_request("hello", SamplingParams(max_new_tokens=2, **GREEDY), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("hello", SamplingParams(max_new_tokens=2, **GREEDY), request_id="dup")
    while engine.has_work():
        engine.step()
    assert engine.add_request("again", SamplingParams(max_new_tokens=1, **GREEDY), request_id="dup") == "dup"
    while engine.has_work():
        engine.step()
    engine.check_integrity()
