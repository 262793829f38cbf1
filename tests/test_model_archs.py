"""Every architecture in the registry gives transformers' greedy tokens (float32, CPU) on
random weights with unusual shapes: odd head counts, head_dim != hidden / heads, GQA
ratios 1 to 5, tied and untied embeddings, sliding windows shorter than the prompts
(with radix-cache hits, chunked prefill and retraction across them), Gemma 3's local and
global layers, Phi-3's LongRoPE with its short and its long factors."""
from __future__ import annotations

from pathlib import Path

import pytest

from backend.core import SamplingParams
from engine_helpers import hf_greedy, make_engine, random_prompts, run_staggered
from model_factory import build_tiny_model

NEW_TOKENS = 12
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0]}

# name -> (arch, config overrides, engine overrides, prompt lengths)
VARIANTS = {
    "llama-odd-heads-tied": ("llama", dict(hidden_size=48, num_attention_heads=3,
                                           num_key_value_heads=1, head_dim=20,
                                           tie_word_embeddings=True), {}, (1, 40)),
    "mistral-window": ("mistral", dict(sliding_window=7, num_attention_heads=6,
                                       num_key_value_heads=2, head_dim=12), {}, (10, 40)),
    "qwen2-window-upper-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                                max_window_layers=1), {}, (10, 40)),
    "qwen3-head-dim-24": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2,
                                        head_dim=24), {}, (1, 40)),
    "qwen3-window-tied": ("qwen3", dict(use_sliding_window=True, sliding_window=6,
                                        max_window_layers=1, tie_word_embeddings=True),
                          {}, (10, 40)),
    "gemma3-gqa5-softcap": ("gemma3", dict(hidden_size=80, num_attention_heads=5,
                                           num_key_value_heads=1, head_dim=12,
                                           final_logit_softcapping=3.0),
                            {}, (10, 40)),
    "gemma3-untied-linear-rope": ("gemma3", dict(
        tie_word_embeddings=False, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), {}, (10, 40)),
    # LongRoPE: transformers switches to the long factors once a sequence passes
    # original_max_position_embeddings (32). Served contexts up to 32 use the short ones
    # throughout; a longer served context uses the long ones, which transformers agrees
    # with when the prompt alone is already past 32.
    "phi3-longrope-short": ("phi3", dict(rope_parameters=LONGROPE, max_position_embeddings=1024,
                                         original_max_position_embeddings=32),
                            dict(context_length=32), (1, 18)),
    "phi3-longrope-long-window": ("phi3", dict(rope_parameters=LONGROPE,
                                               max_position_embeddings=1024,
                                               original_max_position_embeddings=32,
                                               sliding_window=9), {}, (33, 45)),
}
SETTINGS = {
    "cache-chunk-5": dict(enable_radix_cache=True, max_prefill_tokens=5),
    # room for about two requests at a time (of 8): decodes outgrow it and retract
    "small-pool": dict(enable_radix_cache=True, max_prefill_tokens=16),
}

_REFERENCE: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("archs")


def _reference(root: Path, name: str):
    if name not in _REFERENCE:
        arch, overrides, _, (shortest, longest) = VARIANTS[name]
        path = build_tiny_model(root / name, arch=arch, **overrides)
        prompts = random_prompts(8, 1200, seed=len(name), min_len=shortest, max_len=longest)
        prompts[3] = list(prompts[1])  # whole-prompt and partial radix-cache hits
        prompts[7] = prompts[2][:shortest + 4] + prompts[7][:longest - shortest - 4]
        _REFERENCE[name] = (path, prompts, hf_greedy(path, prompts, NEW_TOKENS))
    return _REFERENCE[name]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_transformers(tmp_root, name, setting):
    path, prompts, expected = _reference(tmp_root, name)
    settings = dict(VARIANTS[name][2], **SETTINGS[setting])
    if setting == "small-pool":
        # the longest request and a little more: admission reserves room for the decodes
        # it admits, so only a pool this tight makes running requests outgrow it
        settings["max_total_tokens"] = max(map(len, prompts)) + 2 * NEW_TOKENS + 8
    engine = make_engine(path, **settings)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = run_staggered(engine, prompts, params, every=2, check_each_step=False)
    mismatches = [i for i in range(len(prompts)) if got[i] != expected[i]]
    assert not mismatches, (f"prompts {mismatches} differ: {got[mismatches[0]]} vs "
                            f"{expected[mismatches[0]]}")
    if setting == "small-pool":
        assert engine.stats()["num_retractions"] > 0, "the small pool was meant to retract"
    engine.check_integrity()


def test_a_window_layer_does_not_see_past_its_window(tmp_root):
    """The windowed model's answers differ from the same weights with the window off,
    so the exact match above is not full attention by another name."""
    import json

    path, prompts, expected = _reference(tmp_root, "mistral-window")
    config = json.loads((path / "config.json").read_text())
    unwindowed = tmp_root / "mistral-no-window"
    unwindowed.mkdir(exist_ok=True)
    for item in path.iterdir():
        target = unwindowed / item.name
        if not target.exists():
            target.symlink_to(item)
    (unwindowed / "config.json").unlink()
    (unwindowed / "config.json").write_text(json.dumps(dict(config, sliding_window=None)))
    engine = make_engine(unwindowed)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    full = [o.token_ids for o in engine.generate(prompts, params)]
    assert sum(f != e for f, e in zip(full, expected)) >= len(prompts) // 2


def test_the_window_no_longer_caps_the_context(tmp_root):
    path, _, _ = _reference(tmp_root, "mistral-window")
    assert make_engine(path).context_len == 1024  # max_position_embeddings, not the window
