"""/tokenize, /detokenize and /tokenizer_info, in vLLM's shapes, from a local copy of the
served model's tokenizer (``radixlm-openai --tokenizer PATH``: the engine's model folder).

Token-counting clients and evaluation harnesses (lm-evaluation-harness finds these routes
and then needs no tokenizer of its own) use them. Without ``--tokenizer`` the routes are
not there (404), and such clients fall back to a tokenizer of their own.

A text prompt is encoded as the engine encodes one (special tokens added unless
``add_special_tokens`` is false); a chat is first rendered with the served model's chat
template, as /v1/chat/completions renders it, and encoded without special tokens by
default (the template writes them), as vLLM does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import bad_request
from .protocol import ChatCompletionRequest, TokenizeRequest

# the tokenizer's model_max_length when its files set none (transformers' placeholder)
_UNSET_LENGTH = 10**12


class LocalTokenizer:
    """The served model's tokenizer files, loaded as transformers' fast tokenizer (the
    same rules as the engine's ``AutoTokenizer``, without torch): a folder's
    tokenizer.json, else the tokenizer a GGUF file (or a folder's one) carries."""

    def __init__(self, path: str):
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError as exc:
            raise SystemExit("--tokenizer needs the transformers package "
                             "(pip install transformers)") from exc
        folder, gguf = _gguf_file(Path(path))
        try:
            self._tokenizer = PreTrainedTokenizerFast.from_pretrained(
                str(folder), **({"gguf_file": gguf} if gguf else {}))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--tokenizer {path}: no tokenizer files there ({exc})") from exc

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        if ids and max(ids) >= len(self._tokenizer):
            raise bad_request(f"token id {max(ids)} is outside the vocabulary "
                              f"({len(self._tokenizer)} tokens)", "tokens")
        return self._tokenizer.decode(ids)

    def max_model_len(self) -> int | None:
        length = self._tokenizer.model_max_length
        return int(length) if isinstance(length, int) and length < _UNSET_LENGTH else None

    def info(self) -> dict[str, Any]:
        t = self._tokenizer
        return {"tokenizer_class": type(t).__name__, "eos_token": t.eos_token,
                "bos_token": t.bos_token, "pad_token": t.pad_token, "unk_token": t.unk_token,
                "chat_template": t.chat_template, "model_max_length": self.max_model_len(),
                "vocab_size": len(t)}


def _gguf_file(path: Path) -> tuple[Path, str | None]:
    """(folder, GGUF file name) when the tokenizer comes from a GGUF file."""
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and not (path / "tokenizer.json").exists():
        found = sorted(path.glob("*.gguf"))
        if found:
            return path, found[0].name
    return path, None


def tokenize(tokenizer: LocalTokenizer, body: TokenizeRequest, chat_text) -> dict[str, Any]:
    """``chat_text(request)``: a chat's prompt as the chat endpoint renders it."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either 'prompt' or 'messages'", "prompt")
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer.encode(body.prompt, add)
    else:
        if not body.messages:
            raise bad_request("'messages' must not be empty", "messages")
        text = chat_text(ChatCompletionRequest(model=body.model or "", messages=body.messages))
        ids = tokenizer.encode(text, bool(body.add_special_tokens))
    return {"count": len(ids), "max_model_len": tokenizer.max_model_len(), "tokens": ids}
