"""FP8 on the GPU: kernels against torch, FP8 products and decode speed against bf16.

Decode speed and quality of bf16 vs FP8 weights vs FP8 KV vs both:

    python3 tools/gpu/check_fp8.py --out $OUT [--smollm2 DIR]
        [--parts kernels,block,gemm,speed,quality] [--settings bf16,fp8_weights,fp8_block]
        [--batches 1] [--speed-models llama-8b] [--no-sweep] [--gemv-rows 1,2]

The FP8 matrix-vector kernels alone, each 8B projection's GB/s against the kernel
before split K, and batch-1 decode of the 8B shape in bf16 and FP8 (about 75 s):

    python3 tools/gpu/check_fp8.py --out $OUT --parts gemv,speed --no-sweep \
        --gemv-rows 1,2 --settings bf16,fp8_weights --batches 1 --speed-models llama-8b

* kernels: the float8 KV stores (store_kv, the fused rotary store, the decode kernel's
  own store) give the bytes ``KVPool.store`` gives, exactly; attention over a float8
  pool equals the torch backend's; the per-token quantizer equals its torch reference;
  ``_scaled_mm`` equals the dequantized float32 product; the weight-only FP8
  matrix-vector kernels match torch and are timed against bf16 and W8A8, with a tile
  sweep (``fp8_gemv_checks.py``; ``--no-sweep`` skips the sweep; ``--parts gemv`` runs
  these alone, ``--gemv-rows`` the row counts timed), and a 2-layer
  8B-shaped FP8 model's decode step through them is closer to its dequantized
  reference than through W8A8.
* block: the block-scaled FP8 kernels (128 x 128 weight blocks, activations per token
  and 128 columns) against torch, each 8B projection timed as bf16, per-channel and
  block FP8 at 1/32/128/1024 rows, and a tile sweep of the block GEMM
  (``fp8_block_checks.py``; ``--no-sweep`` skips the sweep).
* gemm: time of one projection of Llama-3.1-8B's shapes at 1/32/128/1024 tokens, bf16
  ``F.linear`` vs ``Fp8Linear`` (weight-only kernels at 1 token, per-token
  quantization + ``_scaled_mm`` above), the choice ``layers/fp8_linear.py`` explains.
* speed: output tokens/s at batch 1/32/128 (``--batches``; 32-token prompts, 128 new
  tokens) for an 8B-shaped random-weight model and SmolLM2 (``--speed-models``), one
  process per engine setting (``--settings``).
* quality (SmolLM2 in bf16): agreement and KL of next-token distributions
  (tools/fp8_quality.py) and free-running greedy agreement against the bf16 engine.

SmolLM2 comes from ``--smollm2`` (a Hugging Face folder), else from the folder
``check_real_models.py`` assembles from the carried batches (stage them first, as that
script says); without either, its rows are skipped and say so. Writes ``$OUT/fp8.json``
after each part; exits 1 if a kernel check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SETTINGS = {"bf16": {}, "fp8_weights": {"quantization": "fp8"},
            "fp8_block": {"quantization": "fp8_block"},
            "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
            "both": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}}
BATCHES = (1, 32, 128)
PROMPT_LEN, NEW_TOKENS = 32, 128
GEMM_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
               "down": (14336, 4096)}


def shape_folder(name: str, tokenizer: str | None) -> str:
    """A random-weight model folder of shape ``name`` (benchmarks/gpu/shapes.py), with
    the tokenizer of the folder ``tokenizer`` (SmolLM2's; or models/default here)."""
    from benchmarks.gpu.shapes import write_shape

    made = Path(os.environ.get("BENCH_SHAPES", "/nonexistent")) / name  # benchmarks/gpu/setup.sh's
    if (made / "config.json").exists():
        return str(made)
    tok = Path(tokenizer) if tokenizer else REPO / "models" / "default"
    return str(write_shape(name, Path(tempfile.mkdtemp(prefix="fp8-shapes-")), tok))


def smollm2_folder(given: str | None) -> str | None:
    if given:
        return given
    try:
        from tools.gpu import check_real_models as real

        real.stage()
        sys.path.insert(0, str(real.assemble("gguf-0.19.0-py3-none-any.whl")))
        import tarfile

        with tarfile.open(real.assemble("tokenizers.tar.xz")) as tar:
            tar.extractall(real.WORK, filter="data")
        return str(real.hf_folder("smollm2"))
    except (SystemExit, OSError, ImportError) as exc:
        print(f"SmolLM2 not available ({exc}): its rows are skipped", flush=True)
        return None


# ---------------------------------------------------------------- gemm
def time_gemm(device: str) -> dict:
    import torch
    import torch.nn.functional as F

    from backend.core.layers.fp8_linear import Fp8Linear

    out = {}
    for name, (k, n) in GEMM_SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = Fp8Linear.from_linear(lin)
        fp8.fuse_rows = True  # as the runner sets it: weight-only for the smallest batches
        for m in (1, 32, 128, 1024):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bf16_us = _cuda_time(lambda: F.linear(x, lin.weight))
            fp8_us = _cuda_time(lambda: fp8(x))
            out[f"{name}/m{m}"] = {"bf16_us": bf16_us, "fp8_us": fp8_us,
                                   "speedup": round(bf16_us / fp8_us, 3)}
        print("gemm", name, {m: out[f"{name}/m{m}"]["speedup"] for m in (1, 32, 128, 1024)},
              flush=True)
    return out


def _cuda_time(fn, reps: int = 50) -> float:
    """Median microseconds of ``fn`` replayed in a CUDA graph (no launch overhead)."""
    import torch

    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return round(sorted(times)[len(times) // 2], 2)


# ---------------------------------------------------------------- speed (one process each)
def speed_one(model: str, setting: str, device: str, dummy: bool,
              batches: tuple[int, ...]) -> dict:
    import random

    from backend.core import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model_path=model, device=device, dtype="bfloat16",
                                 load_format="dummy" if dummy else "auto",
                                 max_running_requests=max(batches), host_cache_ratio=0,
                                 **SETTINGS[setting]))  # no host tier: seconds of pinning
    rng = random.Random(0)
    top = min(30000, engine.runner.vocab_size)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate([[rng.randrange(100, top) for _ in range(PROMPT_LEN)]] * 2, params)
    out = {"kv_pool_tokens": engine.runner.kv_pool.size}
    for batch in batches:
        prompts = [[rng.randrange(100, top) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        started = time.perf_counter()
        engine.generate(prompts, params)
        out[f"batch{batch}_tok_s"] = round(batch * NEW_TOKENS / (time.perf_counter() - started), 1)
    engine.close()
    return out


def speed(model: str, dummy: bool, device: str, settings: list[str],
          batches: tuple[int, ...]) -> dict:
    result = {}
    for setting in settings:
        cmd = [sys.executable, __file__, "--speed-one", model, setting, "--device", device,
               "--batches", ",".join(map(str, batches))]
        cmd += ["--dummy"] if dummy else []
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SPEED ")]
        result[setting] = (json.loads(lines[-1][6:]) if lines
                           else {"error": proc.stderr[-2000:]})
        print("speed", Path(model).name, setting, result[setting], flush=True)
    base = result.get("bf16", {"error": "bf16 not run"})
    for setting, row in result.items():
        if "error" not in row and "error" not in base:
            row["vs_bf16"] = {f"batch{b}": round(row[f"batch{b}_tok_s"] / base[f"batch{b}_tok_s"], 3)
                              for b in batches}
    return result


# ---------------------------------------------------------------- quality
def quality(model: str, device: str) -> dict:
    import torch
    from transformers import AutoTokenizer

    from backend.core import Engine, EngineConfig, SamplingParams
    from tools import fp8_quality
    from tools.gpu.check_real_models import RAW, compare

    tok = AutoTokenizer.from_pretrained(model)
    texts = [tok(t)["input_ids"] for t in fp8_quality.TEXTS]
    prompts = [tok.encode(p) for p in RAW]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    logits, greedy, out = {}, {}, {}
    for setting, extra in SETTINGS.items():
        engine = Engine(EngineConfig(model_path=model, device=device, dtype="bfloat16",
                                     max_total_tokens=65536, **extra))
        logits[setting] = fp8_quality.text_logits(engine.runner, texts)
        greedy[setting] = [o.token_ids for o in engine.generate(prompts, params)]
        engine.close()
        del engine
        torch.cuda.empty_cache()
        if setting != "bf16":
            out[setting] = dict(fp8_quality.compare(logits["bf16"], logits[setting]).as_dict(),
                                greedy=compare(greedy[setting], greedy["bf16"]))
            print("quality", setting, out[setting]["mean_kl"], out[setting]["agreement"],
                  out[setting]["greedy"]["share_tokens"], flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--smollm2", default=None, help="a Hugging Face folder of SmolLM2-135M")
    ap.add_argument("--parts", default="kernels,block,gemm,speed,quality")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="speed: engine settings")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="speed: batch sizes")
    ap.add_argument("--speed-models", default="llama-8b,smollm2")
    ap.add_argument("--no-sweep", action="store_true", help="kernels: no FP8 GEMV tile sweep")
    ap.add_argument("--gemv-rows", default="1,2,4,8", help="kernels/gemv: FP8 GEMV rows timed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--speed-one", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    gemv_rows = tuple(int(r) for r in args.gemv_rows.split(","))
    if args.speed_one:
        print("SPEED " + json.dumps(speed_one(*args.speed_one, args.device, args.dummy,
                                              batches)))
        return 0
    import torch

    parts, models = args.parts.split(","), args.speed_models.split(",")
    settings = args.settings.split(",")
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch": torch.__version__}
    out = Path(args.out) / "fp8.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(part: str, started: float) -> None:  # after each part: a later one may not end
        report.setdefault("seconds", {})[part] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"{part}: {report['seconds'][part]} s, wrote {out}", flush=True)

    wants_smollm2 = "quality" in parts or ("speed" in parts and "smollm2" in models)
    smollm2 = smollm2_folder(args.smollm2) if wants_smollm2 else None
    ok = True
    if "kernels" in parts:
        started = time.perf_counter()
        from tools.gpu.fp8_gemv_checks import check_gemv
        from tools.gpu.fp8_model_check import check_model
        from tools.gpu.fp8_kernel_checks import check_kernels

        report["kernels"] = check_kernels(args.device)
        print("kernels", report["kernels"], flush=True)
        report["kernels"]["fp8_gemv"] = gemv = check_gemv(args.device, not args.no_sweep,
                                                          gemv_rows)
        for failure in gemv["failures"]:
            print("FAIL fp8 gemv", failure, flush=True)
        report["kernels"]["fp8_model"] = model = check_model(shape_folder("llama-8b", smollm2),
                                                             args.device)
        ok = report["kernels"]["ok"] and gemv["ok"] and model["ok"]
        save("kernels", started)
    if "block" in parts:
        started = time.perf_counter()
        from tools.gpu.fp8_block_checks import check_block

        report["block"] = block = check_block(args.device, sweep=not args.no_sweep)
        for failure in block["failures"]:
            print("FAIL fp8 block", failure, flush=True)
        ok = ok and block["ok"]
        save("block", started)
    if "gemv" in parts and "kernels" not in parts:  # the FP8 GEMV checks alone
        started = time.perf_counter()
        from tools.gpu.fp8_gemv_checks import check_gemv

        report["fp8_gemv"] = gemv = check_gemv(args.device, not args.no_sweep, gemv_rows)
        for failure in gemv["failures"]:
            print("FAIL fp8 gemv", failure, flush=True)
        ok = ok and gemv["ok"]
        save("gemv", started)
    if "gemm" in parts:
        started = time.perf_counter()
        report["gemm"] = time_gemm(args.device)
        save("gemm", started)
    if "speed" in parts:
        started = time.perf_counter()
        report["speed"] = {}
        if "llama-8b" in models:
            report["speed"]["llama-8b"] = speed(shape_folder("llama-8b", smollm2), True,
                                                args.device, settings, batches)
        if smollm2 and "smollm2" in models:
            report["speed"]["smollm2"] = speed(smollm2, False, args.device, settings, batches)
        save("speed", started)
    if "quality" in parts:
        started = time.perf_counter()
        report["quality"] = quality(smollm2, args.device) if smollm2 else "SmolLM2 not available"
        save("quality", started)
    print("check_fp8:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
