"""GGUF files as ``model_path``: llama.cpp's own converter writes them from tiny Hugging
Face models of every supported architecture, and the engine loads them back to the
original weights (llama.cpp's Q/K permutation and Gemma's norm offset undone), config and
tokenizer, with transformers' greedy tokens. Quantized tensors dequantize as transformers'
independent dequantizer does; what the loader cannot serve is refused at load with the
reason: another architecture, another tensor type, a truncated file, a pickled checkpoint.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from backend.core import SamplingParams
from backend.core.loaders import open_checkpoint, tokenizer_info
from backend.core.loaders.gguf_reader import read_header, read_tensor
from engine_helpers import hf_greedy, make_engine, random_prompts
from gguf_factory import to_gguf, write_gguf
from model_factory import CHAT_TEMPLATE, build_tiny_model, tiny_tokenizer
from radixlm.openai.tokenize import LocalTokenizer

NEW_TOKENS = 10
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0]}
# What a GGUF can say: Gemma 3's query scale is head_dim's and every sixth layer global
# (llama.cpp's assumptions), Phi-3's window covers every layer.
ARCHS = {
    "llama": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=12),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=24),
    "gemma3": dict(num_hidden_layers=6, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "phi3": dict(rope_parameters=LONGROPE, max_position_embeddings=1024,
                 original_max_position_embeddings=32, sliding_window=9),
}
CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                 "tie_word_embeddings", "sliding_window", "layer_types", "query_pre_attn_scalar")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


_BUILT: dict[str, tuple[Path, Path]] = {}


def converted(root: Path, arch: str, outtype: str = "f32") -> tuple[Path, Path]:
    """(the Hugging Face folder, llama.cpp's GGUF of it)."""
    key = f"{arch}-{outtype}"
    if key not in _BUILT:
        folder = root / arch
        if not folder.exists():
            build_tiny_model(folder, arch=arch, **ARCHS[arch])
        _BUILT[key] = folder, to_gguf(folder, root / f"{key}.gguf", outtype)
    return _BUILT[key]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_llama_cpp_files_load_to_the_original_model(root, arch):
    folder, gguf = converted(root, arch)
    checkpoint = open_checkpoint(gguf)
    ours, original = dict(checkpoint.weights()), load_file(folder / "model.safetensors")
    assert set(ours) == set(original)
    # exact, but Gemma's norms went through 1 + w and back in float32
    tol = 2.5e-7 if arch == "gemma3" else 0.0
    assert all((ours[k] - original[k]).abs().max() <= tol for k in original)
    hf = json.loads((folder / "config.json").read_text())
    got = checkpoint.config.to_dict()
    assert {k: got.get(k) for k in CONFIG_FIELDS if k in hf} == \
        {k: hf[k] for k in CONFIG_FIELDS if k in hf}
    # and it serves transformers' tokens (Phi-3: prompts past 32 tokens, long factors)
    lengths = (33, 45) if arch == "phi3" else (10, 40)
    prompts = random_prompts(6, 1200, seed=3, min_len=lengths[0], max_len=lengths[1])
    engine = make_engine(gguf, max_prefill_tokens=16)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(folder, prompts, NEW_TOKENS)


def test_the_tokenizer_and_chat_template_come_from_the_file(root):
    folder, gguf = converted(root, "qwen2")
    engine = make_engine(gguf)
    tiny = tiny_tokenizer()
    for text in ("Xin chào thế giới! 你好", "def add(a, b):\n    return a + b", "<|im_end|>"):
        assert engine.tokenizer.encode(text) == tiny.encode(text)
    assert engine.tokenizer.chat_template == CHAT_TEMPLATE
    assert tiny.eos_token_id in engine.eos_token_ids
    info = tokenizer_info(gguf)
    assert (info.chat_template, info.eos_token) == (CHAT_TEMPLATE, "<|im_end|>")
    # radixlm-openai --tokenizer <the file> counts tokens as the engine does
    local = LocalTokenizer(str(gguf))
    for text in ("Xin chào thế giới! 你好", "def add(a, b):\n    return a + b"):
        assert local.encode(text, add_special_tokens=True) == engine.tokenizer.encode(text)


def test_a_folder_holding_one_gguf_is_a_model_path_and_two_are_ambiguous(root):
    _, gguf = converted(root, "qwen2")
    folder = root / "one-gguf"
    folder.mkdir(exist_ok=True)
    shutil.copy(gguf, folder / "model.gguf")
    assert open_checkpoint(folder).config.architectures == ["Qwen2ForCausalLM"]
    shutil.copy(gguf, folder / "other.gguf")
    with pytest.raises(ValueError, match="holds 2 GGUF files; set model_path to one of them"):
        open_checkpoint(folder)


@pytest.mark.parametrize("outtype, tol", [("f16", 2e-3), ("bf16", 1.6e-2), ("q8_0", 1.2e-2)])
def test_half_and_8_bit_files_dequantize_to_the_configured_dtype(root, outtype, tol):
    folder, gguf = converted(root, "llama", outtype)
    original = load_file(folder / "model.safetensors")
    ours = dict(open_checkpoint(gguf).weights())
    for name, t in ours.items():
        assert t.dtype == torch.float32
        scale = original[name].abs().max()
        assert (t - original[name]).abs().max() <= tol * scale, name
    engine = make_engine(gguf, dtype="bfloat16")
    assert engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16


# byte offsets of each block's float16 fields (scales), set to sane values in random blocks
_HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("kind", list(_HALF_FIELDS))
def test_quantized_blocks_dequantize_as_transformers_does(tmp_path, kind):
    """Random blocks of every type: our values equal transformers' own dequantizer
    (a separate torch implementation) exactly."""
    import gguf
    from transformers.integrations.gguf.dequant import dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * 256
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[kind]:
        raw[:, offset:offset + 2] = rng.uniform(-1, 1, len(raw)).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    path = write_gguf(tmp_path / "q.gguf", "llama", {}, {"w": (raw.reshape(rows, -1), kind)})
    header = read_header(path)
    assert header.tensors["w"].shape == (rows, cols)
    ours = torch.from_numpy(read_tensor(header, "w"))
    theirs = dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype)).reshape(rows, cols)
    assert torch.isfinite(ours).all() and torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantized_values_round_trip_within_one_step(tmp_path, kind):
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    values = np.random.default_rng(5).normal(size=(4, 256)).astype(np.float32)
    path = write_gguf(tmp_path / "q.gguf", "llama", {},
                      {"w": (gguf.quants.quantize(values, qtype), kind)})
    got = read_tensor(read_header(path), "w")
    # one quantization step of each 32-value block, at most: symmetric types map the
    # largest magnitude to the end of the range and may clip the other side by a step
    steps = {"Q4_0": 8, "Q4_1": 7.5, "Q5_0": 16, "Q5_1": 15.5, "Q8_0": 127}[kind]
    step = np.abs(values.reshape(-1, 32)).max(axis=1) / steps
    assert np.all(np.abs(got - values).reshape(-1, 32) <= step[:, None] * 1.01)
    assert np.abs(got - values).mean() < np.abs(values).mean() / steps  # not merely bounded


# ----------------------------------------------------------------------- refused at load

def test_an_unsupported_architecture_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "mamba", {"mamba.block_count": 1},
                      {"token_embd.weight": (np.zeros((8, 4), np.float32), "F32")})
    with pytest.raises(ValueError, match=r"GGUF architecture 'mamba' is not supported; "
                                         r"supported: gemma3, llama, phi3, qwen2, qwen3"):
        make_engine(path)


def test_an_unsupported_tensor_type_is_refused(tmp_path):
    raw = np.zeros((1, 66), dtype=np.uint8)  # one IQ2_XXS block
    path = write_gguf(tmp_path / "m.gguf", "llama", {}, {"blk.0.attn_q.weight": (raw, "IQ2_XXS")})
    with pytest.raises(ValueError, match=r"tensor types IQ2_XXS are not supported; supported: "
                                         r"F32, F16, BF16, Q8_0, Q4_0"):
        open_checkpoint(path)


@pytest.mark.parametrize("keep", [0.5, 0.0003])
def test_a_truncated_file_is_refused(root, tmp_path, keep):
    _, gguf = converted(root, "llama")
    data = gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ValueError, match="is truncated"):
        make_engine(cut)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 certainly not a GGUF header")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        make_engine(path)


class _Payload:
    """Stands for the arbitrary objects a pickled checkpoint can carry."""


def _bin_folder(root: Path, name: str, state: dict) -> Path:
    folder, _ = converted(root, "llama")
    out = root / name
    out.mkdir(exist_ok=True)
    for item in folder.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)
    torch.save(state, out / "pytorch_model.bin")
    return out


def test_a_pytorch_bin_state_dict_loads_without_unpickling_code(root):
    folder, _ = converted(root, "llama")
    state = load_file(folder / "model.safetensors")
    out = _bin_folder(root, "bin-ok", state)
    prompts = random_prompts(3, 1200, seed=9)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in make_engine(out).generate(prompts, params)] == \
        [o.token_ids for o in make_engine(folder).generate(prompts, params)]


def test_a_pickle_only_checkpoint_is_refused(root):
    folder, _ = converted(root, "llama")
    state = dict(load_file(folder / "model.safetensors"), extra=_Payload())
    out = _bin_folder(root, "bin-pickled", state)
    with pytest.raises(ValueError, match=r"pytorch_model.bin cannot be loaded as plain tensors "
                                         r"\(torch.load with weights_only=True refused it: .*"
                                         r"_Payload.*convert it to safetensors"):
        make_engine(out)
