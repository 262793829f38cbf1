"""Real weights: the default model (SmolLM2-135M-Instruct) and Gemma 3 270M (a GGUF file
served directly) give transformers' greedy tokens in float32 on the CPU, whatever the
batching: radix cache on and off, tight prefill chunks, a KV pool small enough to retract.

SmolLM2 has 30 layers: these tests use it where only real weights prove something (the
dequantized checkpoint, the tokenizer and chat template, answers that make sense); the
batching and cache machinery is covered on tiny models elsewhere.
"""
from __future__ import annotations

import pytest
import torch

from backend.core import SamplingParams
from engine_helpers import make_engine, run_staggered

try:
    import model_factory as mf
except ImportError:  # tests/ importable as a package
    from tests import model_factory as mf

NEW_TOKENS = 12
RAW = ["The capital of France is", "La capitale de l'Italie est",
       "Die Hauptstadt von Deutschland ist", "中国的首都是"]
CHATS = ["What is the capital of France?", "Xin chào! Bạn là ai?",
         "¿Cuál es la capital de España?", "def fibonacci(n): # complete this"]
SETTINGS = {
    "cache-on": dict(enable_radix_cache=True),
    # 8 prompts of 5-40 tokens + 12 new: 75 slots hold two or three at a time, so
    # decodes retract; no radix cache, prefill in chunks of 7
    "no-cache-chunk-7-small-pool": dict(enable_radix_cache=False, max_prefill_tokens=7,
                                        max_total_tokens=75),
}


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def smollm2():
    """(model folder, prompt ids, transformers' greedy continuations)."""
    from transformers import AutoModelForCausalLM

    path = mf.default_model_dir()
    tok = mf.default_tokenizer()
    prompts = [tok.encode(p) for p in RAW] + [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                return_dict=True)["input_ids"] for c in CHATS]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, prompts, hf_greedy(model, prompts, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_smollm2_greedy_matches_transformers(smollm2, setting):
    path, prompts, expected = smollm2
    engine = make_engine(path, **SETTINGS[setting])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = run_staggered(engine, prompts, params, every=3, check_each_step=False)
    mismatches = [i for i in range(len(prompts)) if got[i] != expected[i]]
    assert not mismatches, f"prompts {mismatches}: {got[mismatches[0]]} vs {expected[mismatches[0]]}"
    stats = engine.stats()
    if setting == "cache-on":  # the chats share SmolLM2's default system prompt
        assert stats["cache_hit_tokens"] >= 3 * 20
    else:
        assert stats["num_retractions"] > 0 and stats["cache_hit_tokens"] == 0
    engine.check_integrity()


@pytest.mark.slow
def test_smollm2_answers_make_sense(smollm2):
    path, _, _ = smollm2
    engine = make_engine(path)
    tok = engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    raw, answer = engine.generate(["The capital of France is", chat],
                                  SamplingParams(max_new_tokens=24, temperature=0.0))
    assert raw.text.startswith(" Paris")
    assert answer.text == "The capital of France is Paris." and answer.finish_reason == "stop"


@pytest.mark.slow
def test_gemma3_270m_gguf_greedy_matches_transformers():
    """Gemma 3 270M (base model, Q4_K_M) served straight from its GGUF file against
    transformers' Gemma 3 on the same dequantized weights: local layers with a 512-token
    window (one prompt is longer than that, prefilled in chunks across it), head_dim 256,
    one KV head. (That the dequantized weights are transformers' own, tensor for tensor:
    ``tools/check_gguf_vs_transformers.py``; the same holds for SmolLM2 in
    test_default_model.py, and for llama.cpp-made files of every architecture in
    test_gguf_loading.py.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backend.core.loaders import open_checkpoint

    gguf, tokenizer_dir = mf.gemma3_270m()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    story = " ".join(f"Day {i}: the river rose by {i % 7} inches and the town kept counting."
                     for i in range(40))
    prompts = [tok.encode(p) for p in ("The capital of France is",
                                       "Le chat est assis sur", "def quicksort(items):",
                                       story + " On the last day the river")]
    assert len(prompts[-1]) > 600  # past the sliding window
    checkpoint = open_checkpoint(gguf)
    model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(dict(checkpoint.weights()), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied
    model.tie_weights()
    expected = hf_greedy(model, prompts, 8)
    del model
    engine = make_engine(gguf, tokenizer_path=str(tokenizer_dir), max_prefill_tokens=256)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                  ignore_eos=True))
    assert [o.token_ids for o in got] == expected
