"""Shared pieces for engine tests: tiny model folders (built once per session) and a
step loop that lets requests arrive at different steps."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from backend.core import Engine, EngineConfig, SamplingParams
from model_factory import build_tiny_model

_BUILT: dict[tuple, Path] = {}

ARCH_OVERRIDES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2": dict(tie_word_embeddings=True),
    "mistral": dict(),
}


def tiny_model(root: Path, arch: str) -> Path:
    key = (str(root), arch)
    if key not in _BUILT:
        _BUILT[key] = Path(build_tiny_model(root / arch, arch=arch, **ARCH_OVERRIDES[arch]))
    return _BUILT[key]


def make_engine(model_path: Path, **overrides) -> Engine:
    settings = dict(model_path=str(model_path), device="cpu", dtype="float32",
                    max_total_tokens=4096, max_running_requests=32, max_prefill_tokens=512)
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


def random_prompts(n: int, vocab: int, seed: int, min_len: int = 1, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    # skip the low ids, where tiny tokenizers keep their special tokens
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run_staggered(engine: Engine, prompts, params: SamplingParams, every: int = 2,
                  check_each_step: bool = True) -> dict[int, list[int]]:
    """Submit one prompt every ``every`` steps; returns generated ids per prompt index."""
    ids: dict[str, int] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done: set[int] = set()
    step = 0
    while len(done) < len(prompts):
        if step % every == 0 and len(ids) < len(prompts):
            ids[engine.add_request(prompts[len(ids)], params)] = len(ids)
        for out in engine.step():
            tokens[ids[out.request_id]].extend(out.new_token_ids)
            if out.finished:
                done.add(ids[out.request_id])
        if check_each_step:
            engine.check_integrity()
        step += 1
        assert step < 20000, "engine made no progress"
    return tokens


def hf_greedy(model_path: Path, prompts, max_new_tokens: int) -> list[list[int]]:
    """transformers' own generate on the same weights: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out
