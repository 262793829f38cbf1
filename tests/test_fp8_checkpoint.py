"""Checkpoints stored in FP8: compressed-tensors' float-quantized layout (one scale per
output channel) and transformers' fine-grained "fp8" layout (block scales), written here
from a tiny model, read by the engine; other quantizations refused up front."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.core.fp8 import quantize_rows
from backend.core.layers.fp8_linear import Fp8Linear
from backend.core.loaders import open_checkpoint
from backend.core.loaders.fp8_checkpoint import dequantize
from engine_helpers import make_engine, random_prompts, tiny_model

import model_factory as mf

CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True}}},
    "ignore": ["lm_head"],
}
BLOCK = 32
BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("fp8ckpt"), "llama")


def _rewrite(src, dst, quantization_config, convert):
    """A copy of model folder ``src`` whose projection weights went through ``convert``
    (name, weight) -> {name: tensor}, and whose config names the quantization."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    out = {}
    for name, tensor in state.items():
        out.update(convert(name, tensor) if "_proj.weight" in name else {name: tensor})
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _per_channel(name, weight):
    q, scale = quantize_rows(weight)
    base = name.removesuffix(".weight")
    return {name: q, f"{base}.weight_scale": scale,  # [out, 1]
            f"{base}.input_scale": torch.ones(1)}  # a static activation scale: not used


def _per_block(name, weight):
    rows, cols = weight.shape
    blocks = weight.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448  # [rows / 32, cols / 32]
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    q = (weight / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {name: q, name.replace(".weight", ".weight_scale_inv"): scale}


def test_a_per_channel_checkpoint_keeps_its_float8_weights(original, tmp_path):
    ckpt = _rewrite(original, tmp_path / "fp8", CHANNEL_CONFIG, _per_channel)
    stored = load_file(ckpt / "model.safetensors")
    engine = make_engine(ckpt, quantization="fp8")
    attn = engine.runner.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear)
    pieces = [stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    scales = [stored[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"]
    # the very float8 values of the checkpoint, their scales within float32 rounding
    assert torch.equal(attn.qkv_proj.weight.view(torch.uint8),
                       torch.cat(pieces).view(torch.uint8))
    assert torch.allclose(attn.qkv_proj.weight_scale.view(-1, 1), torch.cat(scales), rtol=1e-6)
    # and the same answers as quantizing the float32 original at load
    prompt = random_prompts(1, 200, seed=2, min_len=20, max_len=20)[0]
    from_original = make_engine(original, quantization="fp8")
    quality = mf._tools_module("fp8_quality")
    got = quality.text_logits(engine.runner, [prompt])[0]
    want = quality.text_logits(from_original.runner, [prompt])[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_block_scaled_checkpoint_is_read_dequantized(original, tmp_path):
    ckpt = _rewrite(original, tmp_path / "fp8block", BLOCK_CONFIG, _per_block)
    stored = load_file(ckpt / "model.safetensors")
    weights = dict(open_checkpoint(ckpt).weights())
    name = "model.layers.1.mlp.down_proj.weight"
    scale = stored[name.replace(".weight", ".weight_scale_inv")]
    assert scale.shape == (64 // BLOCK, 128 // BLOCK)
    assert not any(n.endswith("weight_scale_inv") for n in weights)
    block = (slice(BLOCK, 2 * BLOCK), slice(3 * BLOCK, 4 * BLOCK))  # one block, by hand
    assert torch.equal(weights[name][block], stored[name][block].float() * scale[1, 3])
    assert (weights[name] - load_file(original / "model.safetensors")[name]).abs().max() \
        <= load_file(original / "model.safetensors")[name].abs().max() / 16
    engine = make_engine(ckpt)  # served in float32 (quantization none): it runs
    assert len(engine.generate([[11, 12, 13]], dict(max_tokens=3, temperature=0))[0].token_ids) == 3


@pytest.mark.parametrize("qconfig, reason", [
    ({"quant_method": "gptq", "bits": 4}, "quantization 'gptq' is not supported"),
    ({**CHANNEL_CONFIG, "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int",
                                                            "strategy": "channel"}}}},
     "8-bit int are not supported"),
    ({**CHANNEL_CONFIG, "format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
])
def test_other_quantizations_are_refused_when_the_config_is_read(original, tmp_path, qconfig,
                                                                 reason):
    ckpt = _rewrite(original, tmp_path / "other", qconfig, lambda n, w: {n: w})
    with pytest.raises(ValueError, match=reason):
        make_engine(ckpt)


def test_a_float8_weight_without_its_scale_is_refused(original, tmp_path):
    ckpt = _rewrite(original, tmp_path / "noscale", CHANNEL_CONFIG,
                    lambda n, w: {n: quantize_rows(w)[0]})
    with pytest.raises(ValueError, match="weights without scales"):
        make_engine(ckpt, quantization="fp8")


def test_dequantize_takes_tensor_row_and_block_scales_and_refuses_others():
    q = torch.full((4, 6), 2.0).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize(q, torch.tensor([0.5]), (2, 2)), torch.ones(4, 6))
    rows = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert torch.equal(dequantize(q, rows, (2, 2))[:, 0], torch.tensor([2.0, 4, 6, 8]))
    blocks = torch.tensor([[1.0, 2, 3], [4, 5, 6]])  # 2x2 blocks of a 4x6 weight
    assert torch.equal(dequantize(q, blocks, (2, 2))[3], torch.tensor([8.0, 8, 10, 10, 12, 12]))
    with pytest.raises(ValueError, match="fits neither"):
        dequantize(q, torch.ones(3, 3), (2, 2))
