"""FP8 weights and the FP8 KV cache on tiny models (CPU): the settings, the layers,
the pool's size in bytes, and the radix cache and host tier over a float8 pool.
Quality on the real default model: test_fp8_quality.py; the kernels: test_fp8_kernels.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend.core import EngineConfig, SamplingParams
from backend.core.fp8 import FP8_DTYPE
from backend.core.layers.fp8_linear import Fp8Linear, emulated_mm, \
    quantize_tokens, scaled_mm
from backend.core.memory_pool import KVPool
from backend.model_config import engine_config_from_parameters
import model_factory as mf
from engine_helpers import make_engine, random_prompts, tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
FP8_KV = dict(kv_cache_dtype="fp8_e4m3")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("fp8"), "qwen2")


@pytest.mark.parametrize("key, value", [("quantization", "int8"), ("quantization", "FP8"),
                                        ("kv_cache_dtype", "fp8_e5m2"),
                                        ("kv_cache_dtype", "float8"),
                                        ("kv_cache_scales", "per_head")])
def test_unknown_settings_are_refused_by_name(model, key, value):
    with pytest.raises(ValueError, match=f"{key} must be one of .*{value!r}"):
        EngineConfig(model_path=str(model), **{key: value})
    with pytest.raises(ValueError, match=key):  # and from config.pbtxt
        engine_config_from_parameters({"model_path": str(model), key: value}, [])


@pytest.mark.parametrize("setting", [dict(quantization="fp8"), FP8_KV])
def test_fp8_with_tensor_parallelism_is_refused_until_the_shards_have_a_float8_form(
        model, setting):
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size > 1"):
        EngineConfig(model_path=str(model), tensor_parallel_size=2, **setting)
    assert EngineConfig(model_path=str(model), tensor_parallel_size=1, **setting)


def test_settings_from_config_pbtxt(model):
    config = engine_config_from_parameters(
        {"model_path": str(model), "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3",
         "kv_cache_scales": "unit"}, [])
    assert (config.quantization, config.kv_cache_dtype, config.kv_cache_scales) == \
        ("fp8", "fp8_e4m3", "unit")


def test_a_linear_layer_keeps_a_float8_weight_and_one_scale_per_output_row():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight[3] *= 100  # one loud row does not cost the others precision
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale.shape == (1, 48)
    assert torch.equal(fp8.weight.float().abs().amax(1), torch.full((48,), 448.0))
    assert torch.allclose(fp8.weight_scale.view(-1), linear.weight.abs().amax(1) / 448)
    dequantized = fp8.weight.float() * fp8.weight_scale.view(-1, 1)
    assert ((dequantized - linear.weight).abs() <= linear.weight.abs() / 16 + 1e-9).all()
    x = torch.randn(5, 64)
    with torch.no_grad():
        want, got = linear(x), fp8(x)
    # weights and activations each within half an e4m3 step (1/16) of their values, whose
    # errors do not cancel in a sum of products: measured 6.5% of the output's norm
    rel = (got - want).norm() / want.norm()
    assert 0 < rel < 0.1, rel


def test_the_gpu_product_and_the_cpu_emulation_give_the_same_numbers():
    """torch._scaled_mm with the arguments the CUDA path passes (it also runs on CPU
    in this torch) equals the dequantized float32 product: the layouts of the operands
    and scales are right."""
    torch.manual_seed(1)
    linear = Fp8Linear.from_linear(nn.Linear(96, 32, bias=False))
    xq, xs = quantize_tokens(torch.randn(7, 96))
    gpu = scaled_mm(xq, xs, linear.weight, linear.weight_scale, torch.bfloat16)
    cpu = emulated_mm(xq, xs, linear.weight, linear.weight_scale, torch.bfloat16)
    assert gpu.dtype == cpu.dtype == torch.bfloat16
    assert torch.allclose(gpu.float(), cpu.float(), rtol=1e-2, atol=1e-3)


def test_quantization_replaces_the_decoder_linears_and_keeps_the_head_and_embeddings(model):
    engine = make_engine(model, quantization="fp8")
    net = engine.runner.model
    fp8 = [n for n, m in net.named_modules() if isinstance(m, Fp8Linear)]
    layers = len(net.layers)
    assert len(fp8) == 4 * layers  # qkv, o, gate_up, down of each layer
    assert not any(isinstance(m, nn.Linear) for n, m in net.named_modules() if "layers." in n)
    assert net.embed_tokens.weight.dtype == torch.float32
    out = engine.generate([[11, 12, 13, 14]], SamplingParams(max_new_tokens=4, **GREEDY))
    assert len(out[0].token_ids) == 4


def test_fp8_weights_stay_close_to_the_unquantized_logits(model):
    prompt = random_prompts(1, 200, seed=3, min_len=30, max_len=30)[0]
    logits = {}
    for name, settings in {"ref": {}, "fp8": dict(quantization="fp8")}.items():
        engine = make_engine(model, **settings)
        logits[name] = _prefill_logits(engine, prompt)
    kl = F.kl_div(logits["fp8"].log_softmax(-1), logits["ref"].log_softmax(-1),
                  log_target=True, reduction="none").sum(-1)
    # measured 2026-12-02: mean KL 0.045 nats on this random model, whose std-0.2 weights
    # make sharp distributions (the real model's numbers: test_fp8_quality.py)
    assert 0 < kl.mean().item() < 0.1


def _prefill_logits(engine, prompt):
    return mf._tools_module("fp8_quality").text_logits(engine.runner, [prompt])[0]


def test_a_float8_pool_takes_one_byte_a_value_so_twice_the_tokens_of_bfloat16(model):
    args = (32, 8, 128)  # layers, kv heads, head_dim of Llama-3.1-8B
    assert KVPool.bytes_per_token(*args, torch.bfloat16) == 2 * 32 * 8 * 128 * 2
    assert KVPool.bytes_per_token(*args, FP8_DTYPE) == 2 * 32 * 8 * 128
    budget = 40 * 2**30  # a multiple of both: the token counts are exact
    assert (budget // KVPool.bytes_per_token(*args, FP8_DTYPE)
            == 2 * (budget // KVPool.bytes_per_token(*args, torch.bfloat16)))
    runners = {kv: make_engine(model, dtype="bfloat16", kv_cache_dtype=kv).runner
               for kv in ("auto", "fp8_e4m3")}
    per_token = {kv: r.kv_bytes_per_token for kv, r in runners.items()}
    assert per_token["auto"] == 2 * per_token["fp8_e4m3"]
    for kv, runner in runners.items():  # what the pool really holds, slot for slot
        pool = runner.kv_pool
        held = sum(b[0].numel() * b.element_size() for b in pool.k_buffer + pool.v_buffer)
        assert held == per_token[kv]
    assert runners["fp8_e4m3"].kv_pool.k_buffer[0].dtype == FP8_DTYPE


def test_fp8_kv_scales_are_calibrated_per_layer_and_head_or_unit(model):
    calibrated = make_engine(model, **FP8_KV).runner.kv_pool
    unit = make_engine(model, **FP8_KV, kv_cache_scales="unit").runner.kv_pool
    assert torch.equal(unit.k_scale, torch.ones_like(unit.k_scale))
    assert calibrated.k_scale.shape == (2, 2)  # 2 layers x 2 KV heads
    assert len(set(calibrated.k_scale.flatten().tolist())) == 4  # each its own
    assert (calibrated.v_scale > 0).all() and (calibrated.v_scale < 1).all()


def test_radix_cache_hits_over_a_float8_pool_give_the_same_tokens(model):
    engine = make_engine(model, **FP8_KV)
    prompt = random_prompts(1, engine.runner.vocab_size, seed=4, min_len=40, max_len=40)[0]
    params = SamplingParams(max_new_tokens=8, **GREEDY)
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == len(prompt) - 1
    assert second.token_ids == first.token_ids
    engine.check_integrity()


def test_the_host_tier_moves_float8_kv_as_one_byte_a_value_and_reloads_it(model):
    small = dict(max_total_tokens=64, max_prefill_tokens=64, host_cache_tokens=256,
                 radix_eviction_policy="lru", host_load_min_tokens=0, **FP8_KV)
    vocab = make_engine(model, **small).runner.vocab_size
    heads = random_prompts(4, vocab, seed=9, min_len=20, max_len=20)
    tails = random_prompts(8, vocab, seed=10, min_len=3, max_len=6)
    prompts = [heads[i % 4] + tails[i] for i in range(8)]  # a cycle larger than the pool
    params = SamplingParams(max_new_tokens=5, **GREEDY)
    results = {}
    for name, settings in {"host": small, "off": {**small, "enable_radix_cache": False}}.items():
        engine = make_engine(model, **settings)
        results[name] = [engine.generate([p], params)[0].token_ids for p in prompts]
        engine.check_integrity()
        if name == "host":
            stats = engine.stats()
            assert stats["cache_hit_tokens_host"] > 0, "nothing came from the host"
            layers, kv_heads, head_dim = 2, 2, 16
            assert (stats["kv_bytes_to_host"] // stats["host_saved_tokens"]
                    == 2 * layers * kv_heads * head_dim)
    assert results["host"] == results["off"]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_every_architecture_runs_with_fp8_weights_and_kv(tmp_path, arch):
    """Gemma 3 calls its QKV projection apart from its norm, Phi-3 loads fused
    projections as they are: each reaches the FP8 layers through the same seam."""
    folder = mf.build_tiny_model(tmp_path / arch, arch=arch)
    prompt = random_prompts(1, 200, seed=5, min_len=16, max_len=16)[0]
    ref = _prefill_logits(make_engine(folder), prompt)
    engine = make_engine(folder, quantization="fp8", **FP8_KV)
    assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    got = _prefill_logits(engine, prompt)
    kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)
    # measured mean KL: llama 0.037, gemma3 0.075, phi3 0.028 nats (sharp random models)
    assert 0 < kl.mean().item() < 0.15, kl.mean()
