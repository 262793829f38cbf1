"""Block-scaled FP8 weights (layers/fp8_block_linear.py, layers/fp8_install.py): the
block and group quantizers, ``quantization="fp8_block"`` at load, and FP8 checkpoints
(block, per-tensor) read as they are stored: the layers hold the checkpoint's very
float8 bytes and scales, and the model answers as the dequantized checkpoint does."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from backend.core import EngineConfig
from backend.core.fp8 import quantize_rows
from backend.core.layers.fp8_block_linear import (Fp8BlockLinear, dequantize_blocks,
                                                  quantize_blocks, quantize_groups)
from backend.core.layers.fp8_linear import Fp8Linear
from backend.core.loaders import open_checkpoint
from engine_helpers import make_engine, random_prompts, tiny_model

import model_factory as mf

quality = mf._tools_module("fp8_quality")

FP8 = torch.float8_e4m3fn


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    # hidden 64, 4 heads of 16 (q 64 rows, k and v 32 each), intermediate 128
    return tiny_model(tmp_path_factory.mktemp("fp8block"), "llama")


def _block_config(block):
    return {"quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [block, block]}


def _per_block(block, names=("_proj.weight",)):
    """Checkpoint conversion: each projection weight in float8 with its block grid as
    ``weight_scale_inv`` (ceil-div: partial blocks at the edges, as published)."""
    def convert(name, weight):
        if not any(n in name for n in names):
            return {name: weight}
        q, scale = quantize_blocks(weight, (block, block))
        return {name: q, name.replace(".weight", ".weight_scale_inv"): scale}
    return convert


def _checkpoint(src, dst, quantization_config, convert):
    """A copy of model folder ``src`` with every tensor through ``convert`` (name,
    tensor) -> {name: tensor}, its config naming the quantization."""
    shutil.copytree(src, dst)
    out = {}
    for name, tensor in load_file(dst / "model.safetensors").items():
        out.update(convert(name, tensor))
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


class _RoundedInput(nn.Module):
    """A layer of the dequantized checkpoint whose input is rounded to float8 as the
    float8 layers round theirs (per token and ``group`` columns; ``group`` >= K: per
    token), then multiplied in float32: the reference a float8 layer must equal."""

    def __init__(self, linear: nn.Linear, group: int) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x):
        rows = x.reshape(-1, self.linear.in_features)
        q, scale = quantize_groups(rows, self.group)
        rounded = dequantize_blocks(q, scale, (1, self.group))
        return self.linear(rounded).view(*x.shape[:-1], -1)


def _dequantized_reference(ckpt, group: int | None):
    """The checkpoint dequantized to float32 (quantization none), each decoder linear's
    input rounded per ``group`` (None: per token)."""
    engine = make_engine(ckpt)
    model = engine.runner.model
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    _RoundedInput(module, group or module.in_features))
    return engine


def _greedy(engine, prompts):
    out = engine.generate(prompts, dict(max_tokens=8, temperature=0, ignore_eos=True))
    return [o.token_ids for o in out]


def test_fp8_block_is_a_quantization_setting():
    assert EngineConfig(model_path="m", quantization="fp8_block").quantization == "fp8_block"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model_path="m", quantization="fp8_blocks")


def test_each_block_scale_is_its_blocks_absmax_over_448_partial_edges_included():
    w = torch.randn(130, 200, generator=torch.Generator().manual_seed(0))
    w[5, 7] = 100.0  # the first block's largest magnitude
    w[129, 199] = -50.0  # the corner block holds 2 x 72 values
    q, scale = quantize_blocks(w, (128, 128))
    assert q.dtype == FP8 and q.shape == w.shape and scale.shape == (2, 2)
    assert scale[0, 0] == torch.tensor(100.0) / 448
    assert scale[1, 1] == torch.tensor(50.0) / 448
    assert scale[0, 1] == w[:128, 128:].abs().max() / 448
    assert q[5, 7].float() == 448 and q[129, 199].float() == -448
    # each value within e4m3's half step (2^-4 relative) of its block's scale grid
    full = scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :200]
    assert ((q.float() * full - w).abs() <= w.abs() / 16 + full * 2 ** -9).all()


def test_each_token_group_of_activations_has_its_own_scale():
    x = torch.ones(2, 300)
    x[0, 0] = 896.0  # an outlier in the first group of token 0
    q, scale = quantize_groups(x, 128)
    assert scale.shape == (2, 3)
    assert torch.equal(scale[0], torch.tensor([2.0, 1 / 448, 1 / 448]))
    assert torch.equal(scale[1], torch.full((3,), 1 / 448))
    assert q[0, 0].float() == 448 and q[0, 1].float() == 0.5 and q[0, 128].float() == 448


def test_fp8_block_quantizes_the_decoder_linears_at_load_and_keeps_the_head(original):
    engine = make_engine(original, quantization="fp8_block")
    model = engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(layers) == 4 * len(model.layers)
    assert all(m.block == (128, 128) and m.weight.dtype == FP8 for m in layers)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight_scale.shape == (1, 1)  # 128 rows of 64 columns: one partial block
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    # next-token distributions near the unquantized model's (measured on 2026-12-03:
    # mean KL 0.035, per-channel FP8 0.036; this random model's logits are nearly flat,
    # so its argmax is no measure: test_fp8_quality.py measures a real model)
    prompts = random_prompts(3, 200, seed=1, min_len=20, max_len=20)
    got = quality.compare(quality.text_logits(make_engine(original).runner, prompts),
                          quality.text_logits(engine.runner, prompts))
    assert got.positions == 60 and 0.001 < got.mean_kl < 0.06


@pytest.mark.parametrize("block, qkv_block", [(32, (32, 32)), (128, (1, 128))])
def test_a_block_checkpoint_loads_its_float8_bytes_and_scales_as_stored(
        original, tmp_path, block, qkv_block):
    """32: every piece of a fused projection holds whole blocks, so the grids stack;
    128: q has 64 rows and k, v 32, none a whole block, so each QKV row keeps its own
    piece's scales (1-row blocks); gate and up (128 rows each) still stack."""
    ckpt = _checkpoint(original, tmp_path / "ckpt", _block_config(block), _per_block(block))
    stored = load_file(ckpt / "model.safetensors")
    engine = make_engine(ckpt, quantization="fp8")  # the checkpoint's form wins over "fp8"
    layer = engine.runner.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert isinstance(qkv, Fp8BlockLinear) and qkv.block == qkv_block
    assert isinstance(gate_up, Fp8BlockLinear) and gate_up.block == (block, block)
    prefix = "model.layers.1."
    pieces = [f"{prefix}self_attn.{p}_proj" for p in "qkv"]
    assert torch.equal(_bytes(qkv.weight),
                       _bytes(torch.cat([stored[f"{p}.weight"] for p in pieces])))
    q_scale = stored[f"{pieces[0]}.weight_scale_inv"]
    if qkv_block == (1, 128):  # q's 64 rows all take q's one block row of scales
        assert torch.equal(qkv.weight_scale[:64], q_scale.expand(64, -1))
    else:
        assert torch.equal(qkv.weight_scale[:64 // block], q_scale)
    gu = [f"{prefix}mlp.{p}_proj" for p in ("gate", "up")]
    assert torch.equal(_bytes(gate_up.weight),
                       _bytes(torch.cat([stored[f"{p}.weight"] for p in gu])))
    assert torch.equal(gate_up.weight_scale,
                       torch.cat([stored[f"{p}.weight_scale_inv"] for p in gu]))
    down = layer.mlp.down_proj
    assert torch.equal(_bytes(down.weight), _bytes(stored[f"{prefix}mlp.down_proj.weight"]))
    assert torch.equal(down.weight_scale, stored[f"{prefix}mlp.down_proj.weight_scale_inv"])
    # the same greedy tokens as the checkpoint dequantized to float32, with the
    # activations rounded in 1 x block groups
    prompts = random_prompts(4, 200, seed=3, min_len=5, max_len=20)
    assert _greedy(engine, prompts) == _greedy(_dequantized_reference(ckpt, block), prompts)


def test_a_per_tensor_checkpoint_loads_into_per_channel_layers_with_its_bytes(original,
                                                                              tmp_path):
    def per_tensor(name, weight):
        if "_proj.weight" not in name:
            return {name: weight}
        scale = weight.abs().max() / 448
        return {name: (weight / scale).to(FP8), name + "_scale": scale.reshape(1)}

    ckpt = _checkpoint(original, tmp_path / "tensor", {"quant_method": "fp8"}, per_tensor)
    stored = load_file(ckpt / "model.safetensors")
    engine = make_engine(ckpt, quantization="fp8_block")  # the checkpoint's form wins
    o_proj = engine.runner.model.layers[0].self_attn.o_proj
    name = "model.layers.0.self_attn.o_proj.weight"
    assert isinstance(o_proj, Fp8Linear)
    assert torch.equal(_bytes(o_proj.weight), _bytes(stored[name]))
    assert torch.equal(o_proj.weight_scale.view(-1), stored[name + "_scale"].expand(64))
    prompts = random_prompts(4, 200, seed=4, min_len=5, max_len=20)
    assert _greedy(engine, prompts) == _greedy(_dequantized_reference(ckpt, None), prompts)


def test_a_float8_lm_head_is_dequantized_in_place(original, tmp_path):
    convert = _per_block(32, names=("_proj.weight", "lm_head.weight"))
    ckpt = _checkpoint(original, tmp_path / "head", _block_config(32), convert)
    stored = load_file(ckpt / "model.safetensors")
    head = make_engine(ckpt, quantization="fp8_block").runner.model.lm_head
    assert type(head) is nn.Linear
    weight, scale = stored["lm_head.weight"], stored["lm_head.weight_scale_inv"]
    rows = weight.shape[0]  # the vocabulary, 1200: a partial last block of 16 rows
    assert scale.shape[0] == -(-rows // 32) and rows % 32 != 0
    full = scale.repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)
    assert torch.equal(head.weight, weight.float() * full)


def _mixed(block):
    """v_proj per channel, every other projection in blocks."""
    blocks = _per_block(block)

    def convert(name, weight):
        if "v_proj.weight" not in name:
            return blocks(name, weight)
        q, scale = quantize_rows(weight)
        return {name: q, name.replace(".weight", ".weight_scale"): scale}
    return convert


def test_a_fused_layer_whose_pieces_disagree_is_quantized_at_load_from_their_values(
        original, tmp_path):
    ckpt = _checkpoint(original, tmp_path / "mixed", _block_config(32), _mixed(32))
    engine = make_engine(ckpt, quantization="fp8")
    attn = engine.runner.model.layers[0].self_attn
    assert type(attn.qkv_proj) is Fp8Linear  # per channel, as quantization says
    assert isinstance(attn.o_proj, Fp8BlockLinear) and attn.o_proj.block == (32, 32)
    # quantized from the checkpoint's dequantized values: the checkpoint's weight within
    # a float8 step
    stored = dict(open_checkpoint(ckpt).weights())  # dequantized float32
    want = torch.cat([stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    got = attn.qkv_proj.dequantized()
    assert ((got - want).abs() <= want.abs().amax(1, keepdim=True) / 16).all()
    assert not torch.equal(got, want)


def test_a_fused_layer_with_only_some_pieces_in_float8_is_refused(original, tmp_path):
    blocks = _per_block(32)
    ckpt = _checkpoint(original, tmp_path / "partial", _block_config(32),
                       lambda n, w: {n: w} if "k_proj" in n else blocks(n, w))
    with pytest.raises(ValueError, match="only some of"):
        make_engine(ckpt, quantization="fp8_block")


def test_a_compressed_tensors_block_checkpoint_loads_as_stored(original, tmp_path):
    qconfig = {"quant_method": "compressed-tensors", "format": "float-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 8, "type": "float", "strategy": "block", "symmetric": True,
                   "dynamic": False, "block_structure": [32, 32]}}},
               "ignore": ["lm_head"]}
    blocks = _per_block(32)

    def convert(name, weight):  # compressed-tensors names the block grid weight_scale
        return {n.replace("weight_scale_inv", "weight_scale"): t
                for n, t in blocks(name, weight).items()}

    ckpt = _checkpoint(original, tmp_path / "ct", qconfig, convert)
    stored = load_file(ckpt / "model.safetensors")
    down = make_engine(ckpt, quantization="fp8_block").runner.model.layers[0].mlp.down_proj
    name = "model.layers.0.mlp.down_proj"
    assert isinstance(down, Fp8BlockLinear) and down.block == (32, 32)
    assert torch.equal(_bytes(down.weight), _bytes(stored[f"{name}.weight"]))
    assert torch.equal(down.weight_scale, stored[f"{name}.weight_scale"])
