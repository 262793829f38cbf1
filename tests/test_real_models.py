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

NEW_TOKENS = 16
RAW = ["The capital of France is", "La capitale de l'Italie est",
       "Die Hauptstadt von Deutschland ist", "中国的首都是", "def fibonacci(n):"]
CHATS = ["What is the capital of France?", "Xin chào! Bạn là ai?",
         "¿Cuál es la capital de España?", "Name three colors."]
SETTINGS = {
    "cache-on": dict(enable_radix_cache=True),
    "cache-off": dict(enable_radix_cache=False),
    # 9 prompts of 5-40 tokens + 16 new: 80 slots hold two or three at a time
    "chunk-7-small-pool": dict(enable_radix_cache=True, max_prefill_tokens=7,
                               max_total_tokens=80),
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
    if setting.endswith("small-pool"):
        assert stats["num_retractions"] > 0
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
