"""Incremental detokenization: streamed pieces that concatenate exactly to the full decode.

Why decoding token by token is wrong: byte-level BPE (Qwen2, Llama 3, GPT-2) and
SentencePiece byte fallback (<0xNN> tokens) split one multi-byte UTF-8 character over several
tokens, so a lone token decodes to U+FFFD; and SentencePiece decoders strip the leading space
of the first token they are given, so "▁world" alone decodes to "world", not " world".

The approach: decode a short *window* ids[prefix_offset:] that starts a little before the
new ids, and emit what it adds to the window's text up to read_offset (the ids already
consumed).  The window's first ids (the "anchor") absorb the leading-space stripping; text
that ends in an incomplete character (U+FFFD, or an unfinished run of <0xNN> byte tokens) is
held back until more bytes arrive.  Each step decodes only the window: O(1) per token.

With D(a, b) = decode(ids[a:b]) and final(t) = t less its still-changeable tail (an
incomplete character; with clean_up_tokenization_spaces also a trailing " ", " n", " '"...
that the clean-up could still join with the next text), the stream has emitted
final(D(0, k)) after k ids; flush()/final=True emits the rest.  A step emits
final(D(p, end)) - final(D(p, read)): the same text, whenever the window obeys this rule.

Window rule, i.e. what the Triton postprocessing model must be sent with each response: the
ids before the new ones, [p, read), must hold (after any partial character at their very
start, which is fine) one complete rendered character (not a skipped special token),
followed by all ids of the character still incomplete at read.  A token carries at least one
byte and a character at most 4, so that is at most 4 + 3 ids: the last
STATELESS_CONTEXT_IDS = 8 ids always suffice for valid UTF-8 output, plus one for each
skipped special token among them.  For the first response the context is the prompt's tail
(the text then continues the prompt: same as decoding the output alone for byte-level BPE,
but SentencePiece keeps the first word's space) or nothing (exactly decode(output)).  The
stream's last response must use final=True, which releases held-back text (e.g. a character
cut by the length limit).

Exactness: byte-level BPE, any ids (stateful; stateless for valid UTF-8).  Byte fallback:
valid UTF-8; a byte run that ends invalid is decoded by tokenizers as U+FFFD for *every*
byte of the run, retracting characters already final, which no stream can follow.
"""
from __future__ import annotations

STATELESS_CONTEXT_IDS = 8  # preceding ids a stateless decode_window call needs (see above)
_REPLACEMENT = "\ufffd"
# Suffixes that transformers' clean_up_tokenization could still merge with following text
# (" ." -> ".", " n't" -> "n't", ...): proper prefixes of its patterns, longest first.
_CLEANUP_HOLD = (" n'", " 'v", " 'r", " n", " '", " ")
_TRIM_AT = 256  # drop consumed ids once the anchor is this far in (bounded memory)


def _byte_fallback_ids(tokenizer) -> dict[int, int]:
    """{id: byte} of SentencePiece byte-fallback tokens ("<0xE6>"), when the decoder uses
    them.  Empty for byte-level BPE and for non-HF tokenizers."""
    found: dict[int, int] = {}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and "ByteFallback" in str(backend.decoder):
        for byte in range(256):
            tid = backend.token_to_id(f"<0x{byte:02X}>")
            if tid is not None:
                found[tid] = byte
    return found


def _decode_fn(tokenizer):
    """``tokenizer.decode`` without the Python wrapper's per-call overhead (about 4/5 of a
    short decode): the Rust tokenizer directly, plus the wrapper's space clean-up if the
    tokenizer asks for it. Falls back to ``decode`` for slow tokenizers."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        def fn(ids, skip):
            return tokenizer.decode(ids, skip_special_tokens=skip)
    elif getattr(tokenizer, "clean_up_tokenization_spaces", False):
        def fn(ids, skip):
            return tokenizer.clean_up_tokenization(backend.decode(ids, skip_special_tokens=skip))
    else:
        def fn(ids, skip):
            return backend.decode(ids, skip_special_tokens=skip)
    return fn


class TokenDecoder:
    """What decoding a window needs from a tokenizer, worked out once: build one per
    tokenizer and pass it wherever a tokenizer is asked for (a bare tokenizer works too,
    at the cost of redoing this every call)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_of = _byte_fallback_ids(tokenizer)
        self.cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.decode = _decode_fn(tokenizer)
        # at most two entries per vocabulary id (with and without special tokens)
        self._token_texts: dict[tuple[int, bool], str] = {}

    def token_text(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """One token decoded alone (as logprobs show it); a special token is "" when
        ``skip_special_tokens``, as the request's text leaves it out."""
        key = (token_id, skip_special_tokens)
        text = self._token_texts.get(key)
        if text is None:
            text = self._token_texts[key] = self.decode([token_id], skip_special_tokens)
        return text

    @classmethod
    def of(cls, tokenizer_or_decoder) -> "TokenDecoder":
        if isinstance(tokenizer_or_decoder, TokenDecoder):
            return tokenizer_or_decoder
        return cls(tokenizer_or_decoder)


def _is_continuation(byte: int | None) -> bool:
    return byte is not None and 0x80 <= byte <= 0xBF


class _Window:
    """Decodes slices of ``ids`` and tells which part of their text is final."""

    def __init__(self, decoder: TokenDecoder, ids: list[int], skip_special_tokens: bool) -> None:
        self.ids, self.skip = ids, skip_special_tokens
        self.cleanup = decoder.cleanup
        self.byte_of = decoder.byte_of
        self._decode = decoder.decode

    def decode(self, a: int, b: int) -> str:
        return self._decode(self.ids[a:b], self.skip) if b > a else ""

    def skip_partial(self, a: int, limit: int) -> int:
        """Move a window start off the continuation bytes of a character begun before it.
        Byte fallback decodes a whole run of byte tokens at once, so one stray leading byte
        would turn every character of the run into U+FFFD."""
        while a < limit and _is_continuation(self.byte_of.get(self.ids[a])):
            a += 1
        return a

    def _open_char(self, a: int, b: int) -> int:
        """Index of the byte token that starts an incomplete character at the end of
        ids[a:b], else b.  Needed for byte fallback: a run "complete char + partial char"
        decodes to all U+FFFD, which would hide the complete one."""
        i, conts = b - 1, 0
        while i >= a and conts < 3 and _is_continuation(self.byte_of.get(self.ids[i])):
            i, conts = i - 1, conts + 1
        lead = self.byte_of.get(self.ids[i]) if i >= a else None
        if lead is None:
            return b
        need = 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if lead >= 0xF0 else 1
        return i if conts + 1 < need else b

    def final(self, a: int, b: int) -> tuple[str, str]:
        """(text of ids[a:b], the part of it that no later id can change)."""
        text = self._decode(self.ids[a:b], self.skip) if b > a else ""
        if not self.byte_of:  # byte-level BPE: only a trailing U+FFFD or clean-up tail
            if not self.cleanup and (not text or text[-1] != _REPLACEMENT):
                return text, text
            return text, text[:_stable_len(text, self.cleanup)]
        cut = self._open_char(a, b) if b > a else b
        done = text if cut == b else self.decode(a, cut)
        return text, done[:_stable_len(done, self.cleanup)]


def _stable_len(text: str, cleanup: bool) -> int:
    """Length of the part of ``text`` that no later token can change."""
    end = len(text)
    while end and text[end - 1] == _REPLACEMENT:
        end -= 1
    if cleanup:
        for hold in _CLEANUP_HOLD:
            if text.endswith(hold, 0, end):
                return end - len(hold)
    return end


def decode_window(tokenizer, ids: list[int], prefix_offset: int, read_offset: int,
                  skip_special_tokens: bool = True, final: bool = False) -> tuple[str, int, int]:
    """One detokenization step over ``ids[prefix_offset:]``.

    ``ids[:read_offset]`` were consumed by earlier steps; ``ids[read_offset:]`` are new.
    Returns ``(new_text, new_prefix_offset, new_read_offset)``: the text that became final,
    and the offsets to pass with the same (grown) list next time.

    Stateless use (Triton postprocessing): ``ids = context + new`` with ``context`` chosen by
    the window rule in the module docstring, ``prefix_offset=0``,
    ``read_offset=len(context)``, ``final`` set on the stream's last response; the returned
    offsets are not needed.  Cost: a few decodes of the window, independent of the length
    of the sequence.
    """
    win = _Window(TokenDecoder.of(tokenizer), ids, skip_special_tokens)
    return _step(win, prefix_offset, read_offset, final, True)


def _step(win: _Window, prefix_offset: int, read_offset: int, final: bool,
          trim_start: bool) -> tuple[str, int, int]:
    ids = win.ids
    end = len(ids)
    # A stateless window may begin inside a character (emitted earlier, by the window
    # rule); the anchors this module picks never do, so there stray bytes are real text.
    start = win.skip_partial(prefix_offset, read_offset) if trim_start else prefix_offset
    prefix, prefix_done = win.final(start, read_offset)  # prefix_done: emitted earlier
    full, full_done = win.final(start, end)
    if final:
        return full[len(prefix_done):], start, end
    new_text = full_done[len(prefix_done):] if len(full_done) > len(prefix_done) else ""

    # Move the anchor forward so the window stays a few ids long.  A new anchor must be a
    # character boundary all of whose preceding text has been emitted, with at least one
    # rendered id between it and the next read offset (so a decoder that strips the
    # window's leading space still strips only an id that was already emitted).
    anchor = start
    if prefix_done == prefix and len(full) > len(prefix):
        anchor = read_offset
    elif full_done != full:
        # The text ends in an incomplete character: anchor just before its ids (valid
        # UTF-8 leaves at most 3, clean-up holds at most 3), so a stream that keeps ending
        # mid-character does not drag an ever longer window.
        for q in range(end - 1, max(start, end - 4), -1):
            head, head_done = win.final(start, q)
            if head and head_done == head and full_done.startswith(head):
                anchor = q
                break
    return new_text, anchor, end


class IncrementalDetokenizer:
    """Streaming text of one sequence; ``add`` returns only text that is final.

    Without ``prompt_ids`` the pieces concatenate (after ``flush``) to exactly
    ``tokenizer.decode(all_output_ids, skip_special_tokens=...)``.  With ``prompt_ids`` the
    text is the continuation of the prompt, ``decode(prompt + output)`` minus
    ``decode(prompt)``: identical for byte-level BPE, but a SentencePiece tokenizer keeps the
    space before the first output word (as the prompt is followed by " word", not "word").
    """

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        """``tokenizer``: a ``TokenDecoder`` (or a tokenizer, prepared here)."""
        decoder = TokenDecoder.of(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        # Only the prompt's tail matters: it is the first anchor (see the window rule).
        self._ids = list(prompt_ids[-STATELESS_CONTEXT_IDS:]) if prompt_ids else []
        self._read = len(self._ids)
        # the tail may begin inside a character: start the window after its stray bytes
        # one window over self._ids for the stream's life (the list only changes in place)
        self._win = _Window(decoder, self._ids, skip_special_tokens)
        self._prefix = self._win.skip_partial(0, self._read)
        self._pieces: list[str] = []
        self._finished = False

    def add(self, token_ids: list[int]) -> str:
        """Consume new ids; returns the text that is now final (possibly "")."""
        if self._finished:
            raise RuntimeError("add() after flush(): the stream has ended")
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        piece, self._prefix, self._read = _step(self._win, self._prefix, self._read, False,
                                                trim_start=False)
        if self._prefix >= _TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """End of the stream: whatever is still held back (e.g. a truncated character)."""
        if self._finished:
            return ""
        self._finished = True
        piece, _, self._read = _step(self._win, self._prefix, self._read, True,
                                     trim_start=False)
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
