"""Checkpoints on disk -> config, weights (Hugging Face names, dequantized) and tokenizer.

``checkpoint.py`` decides what ``model_path`` names; ``torch_files.py`` reads safetensors
and PyTorch files; ``gguf_reader.py`` and ``gguf_model.py`` read GGUF files."""
from .checkpoint import (Checkpoint, TokenizerInfo, find_gguf, load_tokenizer, open_checkpoint,
                         tokenizer_info)

__all__ = ["Checkpoint", "TokenizerInfo", "find_gguf", "load_tokenizer", "open_checkpoint",
           "tokenizer_info"]
