"""Quick correctness and speed smoke test of the engine on a CUDA GPU.

    python scripts/gpu_smoke.py --tokenizer DIR [--shape 1b]

Builds a Llama-3.2-1B-shaped model with random bf16 weights (load_format="dummy"), then:
1. greedy outputs with CUDA graphs + overlap equal those of the plain eager path, and the
   Triton attention path stays close to the torch reference path (bf16);
2. decode speed at batch 1 and 64 with each feature on/off (tokens/s, ms/step).
Exits 1 on a correctness failure.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.core import Engine, EngineConfig, SamplingParams  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
               max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
               max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
}


def make_shape_dir(shape: str, tokenizer_dir: str) -> str:
    out = Path(tempfile.mkdtemp(prefix=f"llama-{shape}-"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, **SHAPES[shape]}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return str(out)


def engine(path: str, **kw) -> Engine:
    settings = dict(model_path=path, device="cuda", dtype="bfloat16", load_format="dummy",
                    max_total_tokens=200_000, max_running_requests=128, max_prefill_tokens=8192)
    settings.update(kw)
    return Engine(EngineConfig(**settings))


def greedy(eng: Engine, prompts, n: int) -> list[list[int]]:
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def decode_speed(eng: Engine, batch: int, in_len: int = 32, out_len: int = 128) -> tuple[float, float]:
    prompts = [[(7 * i + j) % 120000 + 100 for j in range(in_len)] for i in range(batch)]
    greedy(eng, prompts[:1], 4)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    greedy(eng, prompts, out_len)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return batch * out_len / dt, dt / out_len * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", default="1b")
    args = ap.parse_args()
    path = make_shape_dir(args.shape, args.tokenizer)
    prompts = [[(13 * i + 5 * j) % 120000 + 100 for j in range(8 + 9 * i)] for i in range(8)]
    failures = []

    results = {}
    for name, kw in [("graph+overlap", {}), ("eager", dict(enable_cuda_graph=False, enable_overlap=False)),
                     ("torch-attn", dict(enable_cuda_graph=False, enable_overlap=False,
                                         attention_backend="torch"))]:
        eng = engine(path, **kw)
        t = time.perf_counter()
        results[name] = greedy(eng, prompts, 24)
        print(f"{name:<14} greedy run {time.perf_counter() - t:.2f}s  first: {results[name][0][:8]}")
        eng.check_integrity()
        del eng
        torch.cuda.empty_cache()
    if results["graph+overlap"] != results["eager"]:
        failures.append("graph+overlap output differs from eager")
    same = sum(a == b for a, b in zip(results["eager"], results["torch-attn"]))
    print(f"triton vs torch attention: {same}/{len(prompts)} identical greedy sequences (bf16)")

    print(f"\n{'config':<22}{'batch':>6}{'tok/s':>10}{'ms/step':>9}")
    for name, kw in [("graph+overlap", {}), ("no-graph", dict(enable_cuda_graph=False)),
                     ("no-overlap", dict(enable_overlap=False))]:
        eng = engine(path, **kw)
        for b in (1, 64):
            tps, ms = decode_speed(eng, b)
            print(f"{name:<22}{b:>6}{tps:>10.0f}{ms:>9.2f}")
        del eng
        torch.cuda.empty_cache()
    if failures:
        print("FAILED:", failures)
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
