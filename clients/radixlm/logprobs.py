"""Token log-probabilities as the language hands them to programs: one ``(logprob,
token_id, text)`` tuple per token, and per position a list of the top alternatives.

The server's ``logprobs`` JSON has one entry per generated token, in the vLLM backend's
shape (the chosen token and the asked alternatives):

    {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}, "9": {...}}

Prompt positions (``prompt_logprobs``) carry the token itself, since the client does not
know the prompt's ids (the first position has no logprob: null):

    {"token_id": 5, "logprob": -0.1, "rank": 1, "text": "a",
     "top_logprobs": {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}, ...}}

(``top_logprobs`` values may also be bare floats.) Token text is optional; without it
the text slot is None, and a program that asked for text (``return_text_in_logprobs``)
gets an error instead.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence


class TokenLogprob(NamedTuple):
    logprob: float | None
    token_id: int | None
    text: str | None


class ParsedLogprobs(NamedTuple):
    tokens: list[TokenLogprob]
    top: list[list[TokenLogprob]]  # per position, best first, at most the asked number


class MissingTokenText(ValueError):
    """Token text was asked for but the server's logprobs carry none."""


def _float(value) -> float | None:
    return None if value is None else float(value)


def _top_entries(entry: dict[str, Any]) -> list[TokenLogprob]:
    """All alternatives of one position, best first."""
    if "token_id" in entry or "logprob" in entry:  # a prompt position
        top = entry.get("top_logprobs") or {}
        items = [TokenLogprob(_float(v.get("logprob")), int(tid), v.get("decoded_token"))
                 if isinstance(v, dict) else TokenLogprob(_float(v), int(tid), None)
                 for tid, v in top.items()]
    else:  # vLLM's: token id -> {logprob, rank, decoded_token}
        items = [TokenLogprob(_float(v.get("logprob")), int(tid), v.get("decoded_token"))
                 for tid, v in entry.items()]
    return sorted(items, key=lambda t: float("-inf") if t.logprob is None else -t.logprob)


def _chosen(entry: dict[str, Any] | None, token_id: int | None) -> TokenLogprob:
    if entry is None:
        return TokenLogprob(None, token_id, None)
    if "token_id" in entry or "logprob" in entry:
        tid = entry.get("token_id", token_id)
        return TokenLogprob(_float(entry.get("logprob")), None if tid is None else int(tid),
                            entry.get("text"))
    found = entry.get(str(token_id))
    if found is None:
        raise ValueError(f"logprobs of position with token {token_id} do not include it")
    return TokenLogprob(_float(found.get("logprob")), token_id, found.get("decoded_token"))


def parse(entries: Sequence[dict | None] | None, token_ids: Sequence[int | None],
          top_n: int, want_text: bool, what: str) -> ParsedLogprobs:
    """Tuples for ``entries`` (aligned with ``token_ids`` where the shape needs them).

    ``what`` names the list in errors (``output_token_logprobs``, ...).
    """
    entries = list(entries or [])
    if len(token_ids) < len(entries):
        token_ids = list(token_ids) + [None] * (len(entries) - len(token_ids))
    tokens, top = [], []
    for entry, token_id in zip(entries, token_ids):
        tokens.append(_chosen(entry, token_id))
        top.append(_top_entries(entry)[:top_n] if entry and top_n > 0 else [])
    if want_text:
        first = 1 if what.startswith("input") else 0  # a prompt's first token may lack all
        missing = [t for t in tokens[first:] if t.text is None]
        missing += [t for row in top for t in row if t.text is None]
        if missing:
            raise MissingTokenText(
                f"{what}: return_text_in_logprobs needs token text, and the server's "
                "logprobs carry none (no 'text' / 'decoded_token')")
    return ParsedLogprobs(tokens, top)


def mean_logprob(tokens: Sequence[TokenLogprob]) -> float | None:
    """Mean over the tokens that have a logprob (a prompt's first token has none)."""
    values = [t.logprob for t in tokens if t.logprob is not None]
    return sum(values) / len(values) if values else None
