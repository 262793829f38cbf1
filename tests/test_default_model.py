"""The default model builder: deterministic weights, the real Qwen2 tokenizer, ChatML.

The reference build is models/default when it is current, else one cached under build/
(the first run there downloads the llama-cpp-python sdist from PyPI, later runs reuse it).
"""
from __future__ import annotations

import hashlib
import json
import time

import pytest
import torch
from safetensors import safe_open

try:
    import model_factory as mf
except ImportError:  # tests/ importable as a package
    from tests import model_factory as mf

dm = mf.default_model_module()

TEXTS = {
    "en": "The quick brown fox jumps over the lazy dog.",
    "vi": "Tiếng Việt có dấu: Hôm nay trời đẹp, chúng ta đi dạo nhé!",
    "th": "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "zh": "大型语言模型的推理服务需要高效的缓存。",
}


@pytest.fixture(scope="module")
def model_dir():
    return mf.default_model_dir()


@pytest.fixture(scope="module")
def tok():
    return mf.qwen2_tokenizer()


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_weights_are_byte_identical_across_builds(tmp_path, model_dir):
    torch.manual_seed(999)  # the build must not depend on (or disturb) the global RNG
    before = torch.get_rng_state()
    dm.write_weights(tmp_path)
    assert torch.equal(torch.get_rng_state(), before)
    fresh = sha256(tmp_path / "model.safetensors")
    assert fresh == sha256(model_dir / "model.safetensors")
    assert fresh == dm.read_marker(model_dir)["files"]["model.safetensors"]["sha256"]
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (model_dir / name).read_bytes()


def test_config_is_qwen2_with_the_stated_shapes(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    expected = dict(vocab_size=151936, hidden_size=256, intermediate_size=704,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=4096, tie_word_embeddings=True, dtype="float32",
                    bos_token_id=151643, eos_token_id=151645)
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rope_parameters"]["rope_theta"] == 1_000_000.0
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643] and gen["pad_token_id"] == 151643


def test_safetensors_hold_float32_tied_qwen2_weights(model_dir):
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        q_bias = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
        norm = f.get_tensor("model.norm.weight")
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in shapes  # tied to the embedding
    assert len(shapes) == 2 + 4 * 12
    assert shapes["model.embed_tokens.weight"] == (151936, 256)
    layer = {k.split("layers.3.")[1]: v for k, v in shapes.items() if "layers.3." in k}
    assert layer == {
        "input_layernorm.weight": (256,), "post_attention_layernorm.weight": (256,),
        "self_attn.q_proj.weight": (256, 256), "self_attn.q_proj.bias": (256,),
        "self_attn.k_proj.weight": (128, 256), "self_attn.k_proj.bias": (128,),
        "self_attn.v_proj.weight": (128, 256), "self_attn.v_proj.bias": (128,),
        "self_attn.o_proj.weight": (256, 256), "mlp.gate_proj.weight": (704, 256),
        "mlp.up_proj.weight": (704, 256), "mlp.down_proj.weight": (256, 704),
    }
    # biases and norm scales are random too, so a loader that drops them is caught
    assert 0.1 < float(q_bias.std()) < 0.2 and abs(float(norm.mean()) - 1.0) < 0.05


def test_tokenizer_round_trips_and_matches_qwen2(tok):
    for text in TEXTS.values():
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("Hello world") == [9707, 1879]  # Qwen2's own ids
    assert tok.encode("你好") == [108386]
    assert len(tok) == 151646  # < 151936 embedding rows, as in Qwen2
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
    assert tok.bos_token is None
    assert tok.decode([151700, 9707]) == "Hello"  # ids past the tokenizer render nothing


def test_chat_template_renders_chatml(tok, model_dir):
    messages = [{"role": "user", "content": "Xin chào"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nXin chào<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "system", "content": "Be brief."}] + messages
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == 151644 and ids.count(151645) == 2
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                               "<|im_start|>user\nXin chào<|im_end|>\n<|im_start|>assistant\n")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (model_dir / "chat_template.jinja").read_text()


def test_build_is_idempotent(model_dir, capsys):
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    start = time.monotonic()
    assert dm.main(["--out", str(model_dir)]) == 0
    assert time.monotonic() - start < 2.0
    assert capsys.readouterr().out.strip() == str(model_dir)
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_incomplete_or_other_recipe_is_rebuilt(tmp_path, model_dir):
    marker = json.loads((model_dir / dm.MARKER).read_text())
    (tmp_path / dm.MARKER).write_text(json.dumps(marker))
    assert dm.read_marker(tmp_path) is None  # the files themselves are missing
    marker["recipe"] = "older"
    assert marker != dm.read_marker(model_dir) is not None


def test_refuses_to_replace_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="not made by this builder"):
        dm.build_default_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_missing_vocabulary_source_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv(dm.SDIST_ENV, str(tmp_path / "absent.tar.gz"))
    with pytest.raises(RuntimeError, match="no usable ggml-vocab-qwen2.gguf"):
        dm.fetch_vocab_gguf("qwen2", tmp_path / "cache")


def test_gguf_metadata_reader():
    meta = dm.read_gguf_metadata(dm.fetch_vocab_gguf("qwen2"))
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == 151936
    assert meta["tokenizer.ggml.tokens"][151645] == "<|im_end|>"
    assert meta["tokenizer.ggml.merges"][0] == "Ġ Ġ"


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_tiny_factory_models_are_deterministic(tmp_path, arch):
    """The shared tiny test models: same arguments, same bytes; the stated shapes."""
    extra = {"rope_scaling": "llama3"} if arch == "llama" else {}
    a = mf.build_tiny_model(tmp_path / "a", arch, **extra)
    b = mf.build_tiny_model(tmp_path / "b", arch, **extra)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == [mf.ARCHS[arch]]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"]) == (64, 4, 2, 16, 1200)
    if arch == "llama":
        assert cfg["rope_parameters"]["rope_type"] == "llama3"
    with safe_open(a / "model.safetensors", framework="pt") as f:
        assert ("model.layers.0.self_attn.q_proj.bias" in f.keys()) == (arch == "qwen2")
