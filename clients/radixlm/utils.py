"""``sglang.utils``: the file helpers SGLang's benchmark scripts import."""
from __future__ import annotations

import json
import os
import tempfile
import urllib.request
from typing import Any, Iterable

from .state import ProgramState


def read_jsonl(filename: str) -> list[Any]:
    """One JSON value per line (lines starting with ``#`` are skipped)."""
    with open(filename, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip() and not line.startswith("#")]


def dump_state_text(filename: str, states: Iterable[Any], mode: str = "w") -> None:
    """Write each program state's text (or any other value's ``str``), numbered."""
    with open(filename, mode, encoding="utf-8") as f:
        for i, state in enumerate(states):
            text = state.text() if isinstance(state, ProgramState) else str(state)
            f.write(f"{'=' * 20} {i} {'=' * 20}\n{text}\n")


def download_and_cache_file(url: str, filename: str | None = None) -> str:
    """``url`` saved under the temporary directory (once); returns the file's path."""
    path = filename or os.path.join(tempfile.gettempdir(), os.path.basename(url))
    if not os.path.exists(path):
        partial = path + ".partial"
        urllib.request.urlretrieve(url, partial)
        os.replace(partial, path)
    return path
