"""The weight-only FP8 matrix-vector kernels (backend/core/kernels/fp8_gemv.py) on the
GPU, part of ``check_fp8.py``'s ``kernels`` part:

* correctness: the four projections of Llama-3.1-8B with their prologues (RMSNorm +
  residual before qkv and gate_up, SiLU-and-mul before down), 1 and 8 rows, per-channel
  and 128x128 block scales, against the torch modules followed by ``F.linear`` with the
  dequantized float32 weight (bf16 bound: 2 ulps of the output plus 1% of the row's
  largest output, as tools/check_gemv_gpu.py); the new residual bit for bit;
* time of each projection at 1, 2, 4 and 8 rows, prologue included, against what runs
  otherwise: bf16 (the bf16 GEMV at 1 row, the fused norm or SiLU-and-mul then cuBLAS
  above) and W8A8 (the same prologue, then the per-token quantization and
  ``_scaled_mm``), each call streaming its weights from HBM (copies totalling over 4x
  the L2 cache, replayed in a CUDA graph), with the bandwidth reached against a
  device-to-device copy;
* a tile sweep at 1 row (per-channel scales): (BLOCK_N, BLOCK_K, warps) of each shape,
  ``_config``'s choice among them, fastest first;
* ``check_model``: an FP8 model's decode step through the engine's forward, weight-only
  against W8A8, each against the model's dequantized torch reference.
"""
from __future__ import annotations

SHAPES = {  # name: (prologue, N, K)
    "qkv": ("norm", 6144, 4096), "o": ("plain", 4096, 4096),
    "gate_up": ("norm", 28672, 4096), "down": ("silu", 4096, 14336),
}
BLOCK = 128
TIMED_ROWS = (1, 2, 4, 8)  # where weight-only stops beating W8A8 sets WEIGHT_ONLY_ROWS
# (BLOCK_N, BLOCK_K, warps, stages). At one row the kernel issues 3.4-6.5 instructions a
# float8 weight (sm_90 SASS), near the issue rate HBM allows, so tiles that spend fewer
# can win: fewer warps (reductions over more weights a thread), chunks summed into a 2-D
# accumulator (BLOCK_K < K: one fused multiply-add a weight), pipelined chunks (stages > 1)
SWEEP = ((4, 4096, 8, 1), (8, 4096, 4, 1), (16, 4096, 16, 1), (8, 2048, 8, 1),
         (8, 2048, 8, 2), (8, 1024, 8, 3), (16, 512, 8, 4))


def _quantize(w, block):
    """(float8 weight, float32 scales, dequantized float32 weight) of a bf16 weight."""
    import torch

    from backend.core.fp8 import quantize_rows
    from backend.core.loaders.fp8_checkpoint import dequantize

    if not block:
        q, s = quantize_rows(w)
        return q, s.view(-1).contiguous(), q.float() * s
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, device=w.device)
    padded[:n, :k] = w.float().abs()
    s = (padded.view(nb, block, kb, block).amax((1, 3)) / 448).clamp(min=1e-12)
    full = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, dequantize(q, s, (block, block))


class _Case:
    """One projection's inputs and the ways to run it."""

    def __init__(self, kind, rows, n, k, gen, device):
        import torch

        from backend.core.layers.basic import RMSNorm

        dt = torch.bfloat16
        self.kind, self.k = kind, k
        self.norm = RMSNorm(k, 1e-5).to(device, dt)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.3 * torch.randn(k, generator=gen, device=device))
        width = 2 * k if kind == "silu" else k
        self.x = (torch.randn(rows, width, generator=gen, device=device) * 2).to(dt)
        self.res = torch.randn(rows, k, generator=gen, device=device).to(dt)

    def activation(self):
        """The projection's input as the torch modules make it, and the new residual."""
        import torch.nn.functional as F

        if self.kind == "norm":
            return self.norm(self.x, self.res)
        if self.kind == "silu":
            gate, up = self.x.split(self.k, dim=-1)
            return F.silu(gate) * up, None
        return self.x, None

    def fp8(self, q, s, block, config=None):
        from backend.core.kernels import fp8_gemv as g

        nw = self.norm.weight
        if self.kind == "norm":
            return lambda: g.fp8_rmsnorm_linear_rows(self.x, self.res, nw, 1e-5, q, s,
                                                     block=block, config=config)
        if self.kind == "silu":
            return lambda: g.fp8_silu_mul_linear_rows(self.x, q, s, block=block, config=config)
        return lambda: g.fp8_linear_rows(self.x, q, s, block=block, config=config)

    def prologue(self):
        """The prologue as its own fused launch (what precedes cuBLAS or W8A8)."""
        from backend.core.kernels.fused import fused_add_rmsnorm, silu_and_mul

        if self.kind == "norm":
            return lambda: fused_add_rmsnorm(self.x, self.res, self.norm.weight, 1e-5)[0]
        if self.kind == "silu":
            return lambda: silu_and_mul(self.x)
        return lambda: self.x

    def bf16(self, w):
        import torch.nn.functional as F

        from backend.core.kernels import gemv

        if self.x.shape[0] > gemv.MAX_ROWS:
            before = self.prologue()
            return lambda: F.linear(before(), w)
        if self.kind == "norm":
            return lambda: gemv.rmsnorm_linear_rows(self.x, self.res, self.norm.weight, 1e-5, w)
        if self.kind == "silu":
            return lambda: gemv.silu_mul_linear_rows(self.x, w)
        return lambda: gemv.linear_rows(self.x, w)

    def w8a8(self, layer):
        before = self.prologue()
        return lambda: layer(before())


def check_gemv(device: str, sweep: bool = True) -> dict:
    """The checks, timings and sweep above, as a dict (``ok``: no check failed)."""
    import torch

    with torch.no_grad():
        return _check_gemv(device, sweep)


def _check_gemv(device: str, sweep: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from backend.core.kernels.fp8_gemv import _config
    from backend.core.layers.fp8_linear import Fp8Linear
    from benchmarks.gpu.bench_engine import copy_bandwidth
    from tools.check_gemv_gpu import time_graph

    gen = torch.Generator(device=device).manual_seed(0)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    bw = copy_bandwidth(torch, device, 1 << 30)
    out = {"copy_bw_TBps": round(bw / 1e12, 3), "errors": {}, "timing": {}, "sweep": {},
           "failures": []}
    print(f"fp8 gemv: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name, (kind, n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(torch.bfloat16)
        for block in (0, BLOCK):
            q, s, deq = _quantize(w, block)
            for rows in (1, 8):
                case = _Case(kind, rows, n, k, gen, device)
                act, ref_res = case.activation()
                ref = F.linear(act.float(), deq)
                got = case.fp8(q, s, block)()
                got, got_res = got if isinstance(got, tuple) else (got, None)
                diff = (got.float() - ref).abs()
                bound = 2 * 2.0 ** -7 * ref.abs() + 1e-2 * ref.abs().amax(1, keepdim=True)
                key = f"{name}/{'block' if block else 'channel'}/m{rows}"
                out["errors"][key] = round(float(diff.max() / ref.abs().max()), 6)
                if (diff > bound).any():
                    out["failures"].append(f"{key}: max diff {diff.max().item():.4g}")
                if ref_res is not None and not torch.equal(got_res, ref_res):
                    out["failures"].append(f"{key}: residual differs")
        copies = max(2, -(-4 * l2 // (n * k)))  # float8 bytes; bf16 streams twice as many
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        layers = [Fp8Linear.from_linear(_as_linear(x)) for x in ws]
        for rows in TIMED_ROWS:
            case = _Case(kind, rows, n, k, gen, device)
            t = {"bf16_us": time_graph([case.bf16(x) for x in ws]),
                 "w8a8_us": time_graph([case.w8a8(lay) for lay in layers]),
                 "fp8_gemv_us": time_graph([case.fp8(lay.weight, lay.weight_scale, 0)
                                            for lay in layers])}
            t = {key: round(v * 1e6, 2) for key, v in t.items()}
            t["fp8_gemv_hbm"] = round(n * k / (t["fp8_gemv_us"] * 1e-6) / bw, 3)
            t["vs_bf16"] = round(t["bf16_us"] / t["fp8_gemv_us"], 3)
            t["vs_w8a8"] = round(t["w8a8_us"] / t["fp8_gemv_us"], 3)
            t["config"] = list(_config(n, k, rows))
            out["timing"][f"{name}/m{rows}"] = t
            print(f"fp8 gemv {name} m={rows}: {t}", flush=True)
        if sweep:
            case = _Case(kind, 1, n, k, gen, device)
            grid = []
            for config in dict.fromkeys([_config(n, k, 1), *SWEEP]):
                try:
                    us = time_graph([case.fp8(lay.weight, lay.weight_scale, 0, config)
                                     for lay in layers]) * 1e6
                except Exception as exc:  # noqa: BLE001 - a config may not compile
                    print(f"   config {config}: {type(exc).__name__}", flush=True)
                    continue
                grid.append([list(config), round(us, 2)])
            grid.sort(key=lambda g: g[1])
            out["sweep"][name] = grid
            print(f"fp8 gemv sweep {name} (BLOCK_N, BLOCK_K, warps) us: {grid[:4]}", flush=True)
        del ws, layers
        torch.cuda.empty_cache()
    out["ok"] = not out["failures"]
    return out


def _as_linear(weight):
    import torch

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                             device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def check_model(model_dir: str, device: str, layers: int = 2) -> dict:
    """An FP8 model (``model_dir``'s shape, ``layers`` layers, random weights) through
    the engine's own forward, eager: a 12-token prefill, then one decode step, whose
    rows take the weight-only kernels with ``enable_fused_gemv`` and W8A8 without it;
    each against the same model with its FP8 layers swapped for their dequantized
    weights (``dequantize_linears``). The weight-only step must be the closer one."""
    import torch
    from transformers import AutoConfig

    from backend.core.config import EngineConfig
    from backend.core.forward_batch import ForwardBatch
    from backend.core.layers.fp8_linear import dequantize_linears
    from backend.core.model_runner import ModelRunner

    hf = AutoConfig.from_pretrained(model_dir)
    hf.num_hidden_layers = layers
    ids = [(11 + 997 * i) % hf.vocab_size for i in range(13)]  # 12 to prefill, 1 to decode
    logits = {}
    for name in ("gemv", "w8a8", "reference"):
        config = EngineConfig(model_path=model_dir, device=device, dtype="bfloat16",
                              load_format="dummy", quantization="fp8", max_total_tokens=4096,
                              max_running_requests=4, enable_cuda_graph=False,
                              enable_fused_gemv=name == "gemv")
        runner = ModelRunner(config, hf)
        if name == "reference":
            dequantize_linears(runner.model, runner.dtype)
        prefill = ForwardBatch.build(
            input_ids=ids[:12], req_pool_indices=[1], extend_prefix_lens=[0],
            extend_seq_lens=[12], out_cache_loc=list(range(1, 13)), logits_indices=[11],
            device=runner.to_device)
        runner.forward(prefill)
        decode = ForwardBatch.build(
            input_ids=ids[12:], req_pool_indices=[1], extend_prefix_lens=[12],
            extend_seq_lens=[1], out_cache_loc=[13], logits_indices=[0],
            device=runner.to_device)
        logits[name] = runner.forward(decode).float().clone()
        del runner
        torch.cuda.empty_cache()
    ref = logits["reference"]
    errs = {name: float((logits[name] - ref).abs().max() / ref.abs().max())
            for name in ("gemv", "w8a8")}
    ok = errs["gemv"] < min(errs["w8a8"], 5e-2)
    print(f"fp8 model decode logits vs dequantized reference, max |diff| / max |logit|: "
          f"{errs}", flush=True)
    return {"decode_rel_err": errs, "ok": ok}
