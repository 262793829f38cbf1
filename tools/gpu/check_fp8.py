"""FP8 on the GPU: kernels against torch, W8A8 products against bf16, decode speed and
quality of bf16 vs FP8 weights vs FP8 KV vs both.

    python3 tools/gpu/check_fp8.py --out $OUT [--smollm2 DIR] [--parts kernels,gemm,speed,quality]

* kernels: the float8 KV stores (store_kv, the fused rotary store, the decode kernel's
  own store) give the bytes ``KVPool.store`` gives, exactly; attention over a float8
  pool equals the torch backend's; the per-token quantizer equals its torch reference;
  ``_scaled_mm`` equals the dequantized float32 product.
* gemm: time of one projection of Llama-3.1-8B's shapes at 1/32/128/1024 tokens, bf16
  ``F.linear`` vs ``Fp8Linear`` (per-token quantization + ``_scaled_mm``), the choice
  ``layers/fp8_linear.py`` explains.
* speed: output tokens/s at batch 1/32/128 (32-token prompts, 128 new tokens) for an
  8B-shaped random-weight model and SmolLM2, one process per engine setting.
* quality (SmolLM2 in bf16): agreement and KL of next-token distributions
  (tools/fp8_quality.py) and free-running greedy agreement against the bf16 engine.

SmolLM2 comes from ``--smollm2`` (a Hugging Face folder), else from the folder
``check_real_models.py`` assembles from the carried batches (stage them first, as that
script says); without either, its rows are skipped and say so. Writes ``$OUT/fp8.json``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SETTINGS = {"bf16": {}, "fp8_weights": {"quantization": "fp8"},
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


# ---------------------------------------------------------------- kernels
def check_kernels(device: str) -> dict:
    import torch

    from backend.core.fp8 import FP8_DTYPE
    from backend.core.kernels import store_kv
    from backend.core.kernels.fp8_quant import per_token_quant
    from backend.core.layers.fp8_linear import Fp8Linear, emulated_mm, scaled_mm
    from backend.core.memory_pool import KVPool

    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    kvh, d, n = 8, 128, 300
    ref, got = (KVPool(1000, 1, kvh, d, FP8_DTYPE, device) for _ in range(2))
    scales = torch.rand(1, kvh, generator=gen, device=device) * 0.05 + 0.005
    for pool in (ref, got):
        pool.set_scales(scales, scales * 0.5)
    k = torch.randn(n, kvh, d, generator=gen, device=device, dtype=torch.bfloat16) * 3
    v = torch.randn(n, kvh, d, generator=gen, device=device, dtype=torch.bfloat16)
    k[0, 0, 0] = 1e4  # clamped, not NaN
    loc = torch.randperm(999, device=device)[:n] + 1
    ref.store(0, loc, k, v)
    store_kv(got.k_buffer[0], got.v_buffer[0], loc, k, v, got.k_scale[0], got.v_scale[0])
    out["store_kv_bytes_equal"] = bool(
        torch.equal(ref.k_buffer[0].view(torch.uint8), got.k_buffer[0].view(torch.uint8))
        and torch.equal(ref.v_buffer[0].view(torch.uint8), got.v_buffer[0].view(torch.uint8)))
    x = torch.randn(77, 4096, generator=gen, device=device, dtype=torch.bfloat16)
    q, s = per_token_quant(x)
    want_s = (x.abs().amax(-1, keepdim=True).float() / 448).clamp(min=1e-12)
    want_q = (x.float() / want_s).clamp(-448, 448).to(FP8_DTYPE)
    out["per_token_quant_equal"] = bool(torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
                                        and torch.allclose(s, want_s, rtol=1e-6))
    lin = Fp8Linear.from_linear(torch.nn.Linear(4096, 1024, bias=False, device=device))
    a = scaled_mm(q, s, lin.weight, lin.weight_scale, torch.bfloat16).float()
    b = emulated_mm(q, s, lin.weight, lin.weight_scale, torch.float32)
    out["scaled_mm_rel_err"] = float((a - b).norm() / b.norm())
    out["rotary_store_share_equal"] = check_rotary_store(device)
    out.update(check_attention(device))
    out["ok"] = (out["store_kv_bytes_equal"] and out["per_token_quant_equal"]
                 and out["rotary_store_share_equal"] > 0.999
                 and out["scaled_mm_rel_err"] < 1e-2 and out["attention_rel_err"] < 2e-2)
    return out


def check_rotary_store(device: str) -> float:
    """The share of bytes the fused rotary + float8 store writes as the torch rotation
    followed by ``KVPool.store`` (1.0 unless the two rotations round differently)."""
    from types import SimpleNamespace

    import torch

    from backend.core.fp8 import FP8_DTYPE
    from backend.core.kernels.fused import rotary_store_kv
    from backend.core.layers.rotary import RotaryEmbedding
    from backend.core.memory_pool import KVPool

    gen = torch.Generator(device=device).manual_seed(2)
    n, h, kvh, d = 200, 32, 8, 128
    half = torch.bfloat16 if device == "cuda" else torch.float16
    q, k, v = (torch.randn(n, x, d, generator=gen, device=device, dtype=half)
               for x in (h, kvh, kvh))
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=500000.0), d, max_positions=4096)
    rot.fill_tables(torch.device(device))
    positions = torch.randint(0, 4000, (n,), generator=gen, device=device)
    loc = torch.arange(1, n + 1, device=device)
    ref, got = (KVPool(n, 1, kvh, d, FP8_DTYPE, device) for _ in range(2))
    for pool in (ref, got):
        pool.set_scales(torch.full((1, kvh), 0.01, device=device),
                        torch.full((1, kvh), 0.005, device=device))
    _, k_rot = rot(positions, q.clone(), k.clone())
    ref.store(0, loc, k_rot, v)
    rotary_store_kv(q.clone(), k, v, positions, rot.cos, rot.sin, got.k_buffer[0],
                    got.v_buffer[0], loc, got.k_scale[0], got.v_scale[0])
    same = (ref.k_buffer[0].view(torch.uint8) == got.k_buffer[0].view(torch.uint8)).float().mean()
    return float(same)


def check_attention(device: str) -> dict:
    """Triton extend + decode over a float8 pool vs the torch backend over the same pool."""
    import torch

    from backend.core.forward_batch import ForwardBatch
    from backend.core.fp8 import FP8_DTYPE
    from backend.core.layers.attention import TorchAttention
    from backend.core.layers.triton_attention import TritonAttention, _Scoring
    from backend.core.memory_pool import KVPool, ReqToTokenPool
    from backend.core.transfer import HostToDevice

    gen = torch.Generator(device=device).manual_seed(1)
    h, kvh, d = 32, 8, 128
    lens = [700, 33, 1]
    copy = HostToDevice(device)
    table = ReqToTokenPool(4, 1024, device)
    slots, used = [], 1
    for row, n in enumerate(lens, start=1):
        table.write(row, 0, list(range(used, used + n)), copy)
        slots += list(range(used, used + n))
        used += n
    errs = {}
    for name, prefix in (("extend", [0, 0, 0]), ("decode", [n - 1 for n in lens])):
        ext = [n - p for n, p in zip(lens, prefix)]
        loc = [s for row, (p, n) in enumerate(zip(prefix, lens)) for s in
               range(1 + sum(lens[:row]) + p, 1 + sum(lens[:row]) + n)]
        batch = ForwardBatch.build(input_ids=[0] * sum(ext), req_pool_indices=[1, 2, 3],
                                   extend_prefix_lens=prefix, extend_seq_lens=ext,
                                   out_cache_loc=loc, logits_indices=[], device=copy)
        pool = KVPool(used, 1, kvh, d, FP8_DTYPE, device)
        pool.set_scales(torch.full((1, kvh), 0.02, device=device), torch.full((1, kvh), 0.01, device=device))
        pool.store(0, torch.tensor(slots, device=device),
                   torch.randn(len(slots), kvh, d, generator=gen, device=device),
                   torch.randn(len(slots), kvh, d, generator=gen, device=device))
        # (float16 for a CPU dry run: the interpreter's tl.dot misreads bfloat16)
        half = torch.bfloat16 if device == "cuda" else torch.float16
        q, k, v = (torch.randn(sum(ext), x, d, generator=gen, device=device, dtype=half)
                   for x in (h, kvh, kvh))
        tri = TritonAttention(pool, table.req_to_token, num_heads=h)
        tri.prepare(batch)
        tri.forward(q, k, v, 0, batch, d ** -0.5)  # (its stores: store_kv_bytes_equal)
        ref = TorchAttention(pool, table.req_to_token).forward(q, k, v, 0, batch, d ** -0.5)
        got = tri._attend(q, 0, batch, _Scoring(d ** -0.5, 0, 0.0))  # the same pool read
        errs[name] = float((got.float() - ref.float()).norm() / ref.float().norm())
    return {"attention_rel_err": max(errs.values()), "attention_errs": errs}


# ---------------------------------------------------------------- gemm
def time_gemm(device: str) -> dict:
    import torch
    import torch.nn.functional as F

    from backend.core.layers.fp8_linear import Fp8Linear

    out = {}
    for name, (k, n) in GEMM_SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = Fp8Linear.from_linear(lin)
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
def speed_one(model: str, setting: str, device: str, dummy: bool) -> dict:
    import random

    from backend.core import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model_path=model, device=device, dtype="bfloat16",
                                 load_format="dummy" if dummy else "auto",
                                 max_running_requests=max(BATCHES), **SETTINGS[setting]))
    rng = random.Random(0)
    top = min(30000, engine.runner.vocab_size)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate([[rng.randrange(100, top) for _ in range(PROMPT_LEN)]] * 2, params)
    out = {"kv_pool_tokens": engine.runner.kv_pool.size}
    for batch in BATCHES:
        prompts = [[rng.randrange(100, top) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        started = time.perf_counter()
        engine.generate(prompts, params)
        out[f"batch{batch}_tok_s"] = round(batch * NEW_TOKENS / (time.perf_counter() - started), 1)
    engine.close()
    return out


def speed(model: str, dummy: bool, device: str) -> dict:
    result = {}
    for setting in SETTINGS:
        cmd = [sys.executable, __file__, "--speed-one", model, setting, "--device", device]
        cmd += ["--dummy"] if dummy else []
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SPEED ")]
        result[setting] = (json.loads(lines[-1][6:]) if lines
                           else {"error": proc.stderr[-2000:]})
        print("speed", Path(model).name, setting, result[setting], flush=True)
    base = result["bf16"]
    for setting, row in result.items():
        if "error" not in row and "error" not in base:
            row["vs_bf16"] = {f"batch{b}": round(row[f"batch{b}_tok_s"] / base[f"batch{b}_tok_s"], 3)
                              for b in BATCHES}
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
    ap.add_argument("--parts", default="kernels,gemm,speed,quality")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--speed-one", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.speed_one:
        print("SPEED " + json.dumps(speed_one(*args.speed_one, args.device, args.dummy)))
        return 0
    import torch

    parts = args.parts.split(",")
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch": torch.__version__}
    smollm2 = smollm2_folder(args.smollm2) if {"speed", "quality"} & set(parts) else None
    if "kernels" in parts:
        report["kernels"] = check_kernels(args.device)
        print("kernels", report["kernels"], flush=True)
    if "gemm" in parts:
        report["gemm"] = time_gemm(args.device)
    if "speed" in parts:
        report["speed"] = {"llama-8b": speed(shape_folder("llama-8b", smollm2), True, args.device)}
        if smollm2:
            report["speed"]["smollm2"] = speed(smollm2, False, args.device)
    if "quality" in parts:
        report["quality"] = quality(smollm2, args.device) if smollm2 else "SmolLM2 not available"
    out = Path(args.out) / "fp8.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if report.get("kernels", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
