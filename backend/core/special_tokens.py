"""Which token ids end a sequence for a model (shared by the engine and the ensemble's
stateless detokenizer, which must agree on what is never shown as text)."""
from __future__ import annotations

import json
from pathlib import Path


def eos_token_ids(model_path: str, tokenizer) -> frozenset[int]:
    """generation_config.json's ``eos_token_id`` (one or a list) plus the tokenizer's; for a
    GGUF file, the file's end-of-sequence and end-of-turn tokens."""
    from .loaders.checkpoint import find_gguf

    ids: set[int] = set()
    config = Path(model_path) / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    gguf = find_gguf(model_path)
    if gguf is not None:
        from .loaders.gguf_model import eos_token_ids as gguf_eos_ids
        from .loaders.gguf_reader import read_header

        ids.update(gguf_eos_ids(read_header(gguf)))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
