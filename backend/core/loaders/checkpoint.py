"""What ``model_path`` names, opened: a Hugging Face folder or a GGUF file.

    model_path = /models/Qwen2.5-7B-Instruct        config.json + *.safetensors (or *.bin)
    model_path = /models/smollm2.Q4_1.gguf          one GGUF file
    model_path = /models/smollm2/                   a folder holding one GGUF and no config.json

Everything a model needs is checked when the checkpoint is opened (architecture,
tensor types, a readable header), so a server fails at start-up with the reason rather
than later with a half-loaded model.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # the loaders import torch only where they read weights
    import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class TokenizerInfo:
    """What clients read from the served model's config: the chat template and the tokens
    it writes (``eos_token`` ends a turn)."""

    chat_template: str | None = None
    eos_token: str | None = None
    bos_token: str | None = None

    def as_parameters(self) -> dict[str, str]:
        return {k: v for k, v in (("chat_template", self.chat_template),
                                  ("eos_token", self.eos_token),
                                  ("bos_token", self.bos_token)) if v is not None}


class Checkpoint(ABC):
    """A model's config, weights and tokenizer, wherever they are stored."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    @abstractmethod
    def config(self):
        """The transformers config (``architectures`` picks our model class)."""

    @abstractmethod
    def weights(self, float8: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face parameter name, tensor) for every stored tensor, in float32 or
        the stored dtype. A float8 checkpoint's weights come dequantized, or with
        ``float8`` as stored, each with its scale tensor (``fp8_checkpoint.py``)."""

    @abstractmethod
    def tokenizer(self):
        """The tokenizer stored with the weights."""

    @abstractmethod
    def tokenizer_info(self) -> TokenizerInfo:
        """Chat template and special tokens, read without building the tokenizer."""


class HFFolder(Checkpoint):
    @cached_property
    def config(self):
        from transformers import AutoConfig

        from .fp8_checkpoint import fp8_scheme

        config = AutoConfig.from_pretrained(str(self.path))
        fp8_scheme(config)  # refuses a quantization the loader cannot read, up front
        return config

    def weights(self, float8: bool = False):
        from .fp8_checkpoint import dequantized, fp8_scheme
        from .torch_files import iter_weights, weight_files

        weights = iter_weights(weight_files(self.path))
        scheme = fp8_scheme(self.config)
        return weights if scheme is None or float8 else dequantized(weights, scheme)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))

    def tokenizer_info(self) -> TokenizerInfo:
        try:
            config = json.loads((self.path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return TokenizerInfo()
        template_file = self.path / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config.get("chat_template")

        def token(key: str) -> str | None:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            return value if isinstance(value, str) else None

        return TokenizerInfo(template if isinstance(template, str) else None,
                             token("eos_token"), token("bos_token"))


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        from .gguf_model import check_supported
        from .gguf_reader import read_header

        super().__init__(path)
        self.header = read_header(path)
        check_supported(self.header)

    @cached_property
    def config(self):
        from .gguf_model import hf_config

        return hf_config(self.header)

    def weights(self, float8: bool = False):  # GGUF holds no float8 weights
        from .gguf_model import hf_weights

        return hf_weights(self.header, self.config)

    def tokenizer(self):
        from .gguf_model import load_tokenizer

        return load_tokenizer(self.path)

    def tokenizer_info(self) -> TokenizerInfo:
        meta = self.header.metadata
        tokens = meta.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str | None:
            i = meta.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        return TokenizerInfo(meta.get("tokenizer.chat_template"),
                             token("tokenizer.ggml.eos_token_id"),
                             token("tokenizer.ggml.bos_token_id"))


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one GGUF in a folder without
    a config.json; None for anything else."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files; set model_path to one of "
                         f"them: {', '.join(p.name for p in found)}")
    return found[0] if found else None


def open_checkpoint(model_path: str | Path) -> Checkpoint:
    path = Path(model_path)
    if not path.exists():
        raise ValueError(f"model_path {path} does not exist")
    gguf = find_gguf(path)
    if gguf is not None:
        return GGUFCheckpoint(gguf)
    if path.is_file():
        raise ValueError(f"model_path {path} is a file but not a .gguf; point it at a "
                         "Hugging Face model folder or a GGUF file")
    if not (path / "config.json").exists():
        raise ValueError(f"{path} holds neither config.json (a Hugging Face model folder) "
                         "nor a .gguf file")
    return HFFolder(path)


def load_tokenizer(path: str | Path):
    """The tokenizer at ``path`` (``tokenizer_path``, else ``model_path``): tokenizer files
    of a folder when it has them, else the GGUF file's own tokenizer."""
    path = Path(path)
    if path.is_dir() and any((path / name).exists() for name in TOKENIZER_FILES):
        return HFFolder(path).tokenizer()
    gguf = find_gguf(path)
    if gguf is not None:
        from .gguf_model import load_tokenizer as gguf_tokenizer

        return gguf_tokenizer(gguf)
    return HFFolder(path).tokenizer()  # transformers says what is missing


def tokenizer_info(path: str | Path) -> TokenizerInfo:
    """Chat template and special tokens at ``path`` (as ``load_tokenizer`` finds them)."""
    path = Path(path)
    if path.is_dir() and (path / "tokenizer_config.json").exists():
        return HFFolder(path).tokenizer_info()
    gguf = find_gguf(path)
    return GGUFCheckpoint(gguf).tokenizer_info() if gguf is not None else TokenizerInfo()
