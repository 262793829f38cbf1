"""An FP8 model's decode step through the engine's forward on the GPU, weight-only
matrix-vector kernels against W8A8, part of ``check_fp8.py``'s ``kernels`` part."""
from __future__ import annotations


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
