"""Which token ids end a sequence for a model folder (shared by the engine and the
ensemble's stateless detokenizer, which must agree on what is never shown as text)."""
from __future__ import annotations

import json
from pathlib import Path


def eos_token_ids(model_dir: str, tokenizer) -> frozenset[int]:
    """generation_config.json's ``eos_token_id`` (one or a list) plus the tokenizer's."""
    ids: set[int] = set()
    config = Path(model_dir) / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
