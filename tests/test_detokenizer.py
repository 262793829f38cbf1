"""Incremental detokenization: streamed pieces must concatenate exactly to the full decode.

Three real tokenizer families: the tiny byte-level BPE trained by the model factory,
Qwen2's byte-level BPE (151k vocabulary) and Llama 2's SentencePiece ("▁" word starts,
<0xNN> byte fallback, a decoder that strips the first leading space).
"""
from __future__ import annotations

import random

import pytest

from backend.core.detokenizer import STATELESS_CONTEXT_IDS, IncrementalDetokenizer, decode_window

try:
    import model_factory as mf
except ImportError:  # tests/ importable as a package
    from tests import model_factory as mf

TEXTS = [
    "Streaming text should arrive piece by piece, exactly as the full decode.",
    "Hôm qua tôi đã đọc xong cuốn sách về lịch sử Việt Nam, thật tuyệt vời!",
    "ตลาดน้ำยามเช้ามีผลไม้สดและขนมหวานหลายชนิด",
    "机器学习模型在生成文本时逐个输出词元，渲染需要正确处理多字节字符。",
    "rare: 龘 鬱 𠀀 ฿ ỹ ữ 😀🚀👍🏽 ok",
    "  two leading spaces,\ttabs\n\nnew lines   and trailing  ",
    "def f(x):\n    return {'k': [x, x ** 2]}  # naïve café",
    "Mixed: hello 你好 xin chào สวัสดี 123 — done.",
]
TOKENIZERS = {"tiny": mf.tiny_tokenizer, "qwen2": mf.qwen2_tokenizer, "spm": mf.spm_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i:i + n])
        i += n
    return out


def with_specials(tok, ids: list[int], rng: random.Random) -> list[int]:
    ids = list(ids)
    for special in rng.sample(tok.all_special_ids, 2):
        ids.insert(rng.randrange(len(ids) + 1), special)
    return ids


def stream(detok: IncrementalDetokenizer, parts: list[list[int]]) -> list[str]:
    return [detok.add(p) for p in parts] + [detok.flush()]


def stateless(tok, ids: list[int], parts: list[list[int]], skip: bool,
              context0: list[int] = ()) -> list[str]:
    """What the Triton postprocessing model does: each response carries the preceding
    STATELESS_CONTEXT_IDS ids (the prompt's tail for the first) and its new ids."""
    seen, pieces = list(context0), []
    for k, part in enumerate(parts):
        context = seen[-STATELESS_CONTEXT_IDS:]
        text, _, _ = decode_window(tok, context + part, 0, len(context), skip,
                                   final=k == len(parts) - 1)
        pieces.append(text)
        seen += part
    return pieces


@pytest.mark.parametrize("skip", [True, False])
def test_stream_concatenates_to_full_decode(tok, skip):
    rng = random.Random(1)
    for text in TEXTS:
        for _ in range(4):
            ids = with_specials(tok, tok.encode(text, add_special_tokens=False), rng)
            expected = tok.decode(ids, skip_special_tokens=skip)
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            pieces = stream(detok, chunks(ids, rng))
            assert "".join(pieces) == expected
            assert detok.text == expected
            # partial characters are held back, never streamed as U+FFFD (unless a
            # special token inserted mid-character really broke one)
            assert "\ufffd" in expected or not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_stateless_windows_concatenate_to_full_decode(tok, skip):
    rng = random.Random(2)
    for text in TEXTS:
        for _ in range(4):
            ids = tok.encode(text, add_special_tokens=False)
            parts = chunks(ids, rng) + [[]]  # the final response may carry no new id
            pieces = stateless(tok, ids, parts, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in p for p in pieces)


def test_prompt_context_continues_the_prompt(tok):
    rng = random.Random(3)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        cut = len(ids) // 3
        while tok.decode(ids[:cut]).endswith("\ufffd"):  # a prompt ends on a whole character
            cut -= 1
        prompt, out = ids[:cut], ids[cut:]
        expected = tok.decode(ids)[len(tok.decode(prompt)):]
        parts = chunks(out, rng)
        assert "".join(stream(IncrementalDetokenizer(tok, prompt), parts)) == expected
        assert "".join(stateless(tok, out, parts, True, context0=prompt)) == expected


def test_byte_level_character_split_over_tokens_is_held_back():
    for tok in (mf.tiny_tokenizer(), mf.qwen2_tokenizer()):
        ids = tok.encode("x 𠀀", add_special_tokens=False)  # a 4-byte character
        assert len(ids) >= 3, tok.convert_ids_to_tokens(ids)
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add([i]) for i in ids]
        assert pieces[0] == "x"
        assert pieces[-1].endswith("𠀀") and not any(pieces[1:-1][-1:] and "𠀀" in p for p in pieces[:-1])
        assert "".join(pieces) == "x 𠀀" and detok.flush() == ""


def test_sentencepiece_spaces_and_byte_fallback():
    tok = mf.spm_tokenizer()
    ids = tok.encode("Hello world 龘!", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[:3] == ["▁Hello", "▁world", "▁"]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    # "▁world" alone decodes to "world": the window keeps its space; the three <0xNN>
    # byte tokens of 龘 yield nothing until the last one completes the character.
    assert pieces == ["Hello", " world", " ", "", "", "龘", "!"]
    # after a prompt, the first output word keeps its space too
    prompt = tok.encode("Say:", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tok, prompt), [ids])) == " Hello world 龘!"


def test_flush_releases_a_truncated_character():
    tok = mf.tiny_tokenizer()
    ids = tok.encode("ab 龘", add_special_tokens=False)[:-1]  # cut inside 龘
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids) == "ab "
    assert detok.flush() == tok.decode(ids)[len("ab "):] != ""
    assert detok.text == tok.decode(ids)
    with pytest.raises(RuntimeError):
        detok.add([1])


@pytest.mark.parametrize("name", ["tiny", "qwen2"])
def test_random_token_ids_even_invalid_utf8(name):
    """Arbitrary ids (lone continuation bytes, truncated characters, specials, ids past the
    tokenizer's vocabulary) still stream to exactly the full decode with byte-level BPE.
    (Not with SentencePiece byte fallback: it turns a whole run of byte tokens into U+FFFD
    when the run ends invalid, retracting characters that were already final.)"""
    tok = TOKENIZERS[name]()
    rng = random.Random(4)
    for skip in (True, False):
        for _ in range(30):
            ids = [rng.randrange(len(tok) + 8) for _ in range(rng.randint(1, 40))]
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            assert "".join(stream(detok, chunks(ids, rng))) == tok.decode(ids, skip_special_tokens=skip)


class CountingTokenizer:
    """Records the longest id list the detokenizer asks to decode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __getattr__(self, name):  # backend_tokenizer, clean_up_tokenization_spaces, ...
        return getattr(self.tok, name)

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_window_stays_short_on_long_streams(tok):
    ids = tok.encode(" ".join(TEXTS * 12), add_special_tokens=False)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == tok.decode(ids)
    assert len(ids) > 1000 and counting.longest <= 8
    assert len(detok._ids) <= 260  # consumed ids are dropped


def test_clean_up_tokenization_spaces_is_respected():
    """With clean-up on, " ." / " n't" etc. are joined by decode; a trailing " " or " n"
    is held back until the next text shows whether clean-up applies."""
    tok = mf.tiny_tokenizer()
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    text = "I do n't know , do you ? It 's fine . We 're here ! They 've gone ' ok"
    ids = tok.encode(text, add_special_tokens=False)
    expected = tok.decode(ids)
    assert expected != text  # clean-up did change the text
    for seed in range(5):
        parts = chunks(ids, random.Random(seed))
        assert "".join(stream(IncrementalDetokenizer(tok), parts)) == expected
    assert "".join(stream(IncrementalDetokenizer(tok), [[i] for i in ids])) == expected


def test_decode_window_offsets_drive_a_growing_list():
    tok = mf.qwen2_tokenizer()
    ids = tok.encode(TEXTS[3])
    seen, prefix, read, out = [], 0, 0, []
    for i in ids:
        seen.append(i)
        text, prefix, read = decode_window(tok, seen, prefix, read)
        assert read == len(seen) and 0 <= prefix <= read and read - prefix <= 4
        out.append(text)
    out.append(decode_window(tok, seen, prefix, read, final=True)[0])
    assert "".join(out) == TEXTS[3]
