"""Real models on the GPU: the engine (Triton kernels, CUDA graphs) against transformers'
greedy output, in bfloat16 and float32, on SmolLM2-135M-Instruct and Gemma 3 270M.

    python3 tools/gpu/check_real_models.py --stage-only     # copy a carried batch aside
    python3 tools/gpu/check_real_models.py --out $OUT       # stage the last, then check

The models arrive in batches (``tools/gpu/pack_real_models.py`` explains why and prints
the calls). Each GGUF is checked against its pinned SHA-256, dequantized by the engine's
own loader into a Hugging Face folder that both sides then load, so any difference comes
from the forward passes, not from the weights. Writes ``$OUT/real_models.json``: per model
and run, the share of prompts whose tokens all agree, the share of tokens before the
first divergence, and each divergent prompt's first differing position.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools import model_assets  # noqa: E402

STAGE = Path("/tmp/radixlm-stage")
WORK = Path("/tmp/radixlm-real")
MODELS = {"smollm2": model_assets.SMOLLM2, "gemma3": model_assets.GEMMA3}
RAW = ["The capital of France is", "La capitale de l'Italie est", "Die Hauptstadt von Spanien ist",
       "东京是", "Thủ đô của Việt Nam là", "def merge_sort(items):", "SELECT name FROM users WHERE",
       "Once upon a time, in a small village by the sea,", "1, 1, 2, 3, 5, 8, 13,",
       "The three primary colors are", "Water boils at", "In 1969, Neil Armstrong"]
CHATS = ["What is the capital of France?", "Write a haiku about autumn.",
         "Explain what a hash table is in one sentence.", "Xin chào! Bạn là ai?",
         "¿Cuántos días tiene una semana?", "List three fruits."]
LONG = " ".join(f"Entry {i}: the sensor read {i * 37 % 101} units at hour {i % 24}." for i in range(90))


def stage() -> None:
    STAGE.mkdir(parents=True, exist_ok=True)
    for part in sorted((REPO / ".gpu-models").glob("batch*/*")):
        target = STAGE / part.name
        if not target.exists() or target.stat().st_size != part.stat().st_size:
            shutil.copyfile(part, target)
            print(f"staged {part.name}", flush=True)


def assemble(name: str, sha256: str | None = None) -> Path:
    target = WORK / name
    if target.exists():
        return target
    parts = sorted(STAGE.glob(f"{name}.part*of*"))
    counts = {p.name.rsplit("of", 1)[1] for p in parts}
    if not parts or len(counts) != 1 or len(parts) != int(counts.pop()):
        raise SystemExit(f"{name}: staged parts {[p.name for p in parts]} are not one complete "
                         f"packing in {STAGE}: carry every batch of the same packing")
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    if sha256 is not None and model_assets.sha256(tmp) != sha256:
        raise SystemExit(f"{name}: SHA-256 differs from the pin (a batch is missing?)")
    tmp.replace(target)
    return target


def hf_folder(key: str) -> Path:
    """The GGUF dequantized by the engine's loader, with the carried tokenizer."""
    folder = WORK / key
    if (folder / "model.safetensors").exists():
        return folder
    from safetensors.torch import save_file

    from backend.core.loaders.checkpoint import GGUFCheckpoint

    asset = MODELS[key]
    checkpoint = GGUFCheckpoint(assemble(asset.filename, asset.sha256))
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = checkpoint.config
    config.dtype = "float32"
    config.save_pretrained(tmp)
    tensors = {n: t.contiguous() for n, t in checkpoint.weights()
               if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for path in (WORK / "tokenizers" / key).iterdir():
        shutil.copy(path, tmp / path.name)
    tmp.replace(folder)
    return folder


def prompts_for(key: str, tok) -> list[list[int]]:
    ids = [tok.encode(p) for p in RAW + [LONG]]
    if tok.chat_template:  # Gemma 3 270M is a base model: no template
        ids += [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"] for c in CHATS]
    return ids


def hf_greedy(folder: Path, dtype: str, prompts, new_tokens: int, device: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    del model
    _free_memory()
    return out


def engine_greedy(folder: Path, dtype: str, graphs: bool, prompts, new_tokens: int, device: str):
    """(first pass, second pass over the same prompts: served from the radix cache)."""
    from backend.core import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model_path=str(folder), device=device, dtype=dtype,
                                 max_total_tokens=131072, max_running_requests=64,
                                 enable_cuda_graph=graphs))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first = [o.token_ids for o in engine.generate(prompts, params)]
    again = [o.token_ids for o in engine.generate(prompts, params)]
    hits = engine.stats()["cache_hit_tokens"]
    del engine
    _free_memory()
    return first, again, hits


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    diverge = {}
    agreeing = 0
    for i, (g, w) in enumerate(zip(got, want)):
        same = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
        agreeing += same
        if same < len(w):
            diverge[i] = same
    total = sum(len(w) for w in want)
    return {"prompts": len(want), "prompts_agreeing": len(want) - len(diverge),
            "share_prompts": round(1 - len(diverge) / len(want), 4),
            "tokens": total, "tokens_before_divergence": agreeing,
            "share_tokens": round(agreeing / total, 4),
            "first_divergence": {str(k): v for k, v in sorted(diverge.items())}}


def check(key: str, new_tokens: int, device: str, max_prompts: int | None) -> dict:
    from transformers import AutoTokenizer

    folder = hf_folder(key)
    prompts = prompts_for(key, AutoTokenizer.from_pretrained(folder))[:max_prompts]
    result = {"prompt_lengths": [len(p) for p in prompts], "new_tokens": new_tokens, "runs": {}}
    for dtype in ("bfloat16", "float32"):
        started = time.monotonic()
        ref = hf_greedy(folder, dtype, prompts, new_tokens, device)
        runs = {"graphs": engine_greedy(folder, dtype, True, prompts, new_tokens, device)}
        if dtype == "bfloat16":
            runs["eager"] = engine_greedy(folder, dtype, False, prompts, new_tokens, device)
        for name, (first, again, hits) in runs.items():
            result["runs"][f"{dtype}-{name}-vs-transformers"] = compare(first, ref)
            result["runs"][f"{dtype}-{name}-cached-rerun-vs-first"] = dict(
                compare(again, first), cache_hit_tokens=hits)
        if "eager" in runs:
            result["runs"]["bfloat16-graphs-vs-eager"] = compare(runs["graphs"][0], runs["eager"][0])
        result[f"{dtype}_seconds"] = round(time.monotonic() - started, 1)
        print(key, dtype, json.dumps({k: (v["share_prompts"], v["share_tokens"])
                                      for k, v in result["runs"].items()}), flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage-only", action="store_true", help="copy the carried batch and exit")
    ap.add_argument("--out", default=".", help="folder for real_models.json ($OUT)")
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing")
    ap.add_argument("--max-prompts", type=int, default=None, help="the first N prompts only")
    args = ap.parse_args(argv)
    stage()
    if args.stage_only:
        return 0
    sys.path.insert(0, str(assemble("gguf-0.19.0-py3-none-any.whl")))  # pure Python: zipimport
    with tarfile.open(assemble("tokenizers.tar.xz")) as tar:
        tar.extractall(WORK, filter="data")
    import torch

    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report = {"device": name, "torch": torch.__version__, "models": {}}
    for key in args.models.split(","):
        report["models"][key] = check(key, args.new_tokens, args.device, args.max_prompts)
    out = Path(args.out) / "real_models.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
