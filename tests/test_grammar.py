"""Structured decoding: compilation cache, masking, choices escaping and jump-forward."""
from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from backend.core import grammar
from backend.core.grammar import GrammarBackend, JumpForward, apply_bitmask

PAD = 37  # model vocab = tokenizer vocab + PAD, as with padded embedding tables
CORPUS = ['{"name": "alice", "age": 30}', '{"name": "bob", "age": 41, "tags": ["x", "y"]}',
          "hello world cat-12 dog-34", "yes no maybe yesterday"] * 50
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def _trained_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _factory_tokenizer(out_dir: Path):
    """The shared tiny-model tokenizer, when tests/model_factory.py exists and builds."""
    path = Path(__file__).with_name("model_factory.py")
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("_grammar_model_factory", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        module.build_tiny_model(out_dir, "llama")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(out_dir)
    except Exception:  # a factory still being written must not break these tests
        return None


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _factory_tokenizer(tmp_path_factory.mktemp("tiny")) or _trained_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    b = GrammarBackend(tok, len(tok) + PAD)
    yield b
    b.shutdown()


def _compile(backend, kind, text):
    return backend.submit(kind, text).result(timeout=30)


def _decode(backend, state, seed, max_steps=300):
    """Random logits + grammar mask + argmax until the grammar terminates; returns ids."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = backend.allocate_bitmask(2)
    out = []
    for _ in range(max_steps):
        if state.is_terminated():
            break
        state.fill_bitmask(bitmask, 1)
        logits = torch.randn(2, backend.vocab_size, generator=gen)
        backend.apply_bitmask(logits, bitmask, [1])
        token = int(logits[1].argmax())
        assert state.accept(token)
        out.append(token)
    assert state.is_terminated(), "constrained decoding did not finish"
    assert out[-1] in state.stop_token_ids
    return out[:-1]


def test_compile_cache_counts_one_compilation_per_key(tok):
    b = GrammarBackend(tok, len(tok))
    futures = [b.submit("regex", "[a-z]{3}") for _ in range(5)]
    assert all(f is futures[0] for f in futures)
    assert b.num_compilations == 1
    first = futures[0].result(timeout=30)
    assert b.submit("regex", "[a-z]{3}").result() is first
    b.submit("regex", "[a-z]{4}").result(timeout=30)
    b.submit("ebnf", "[a-z]{3}")  # same text, other kind: another key
    assert b.num_compilations == 3
    b.shutdown()


def test_submit_does_not_block_and_concurrent_submits_share(tok, monkeypatch):
    b = GrammarBackend(tok, len(tok))
    gate, calls = threading.Event(), []
    real = b._compile

    def slow_compile(kind, text):
        calls.append(kind)
        assert gate.wait(10)
        return real(kind, text)

    monkeypatch.setattr(b, "_compile", slow_compile)
    start = time.perf_counter()
    f1 = b.submit("json_schema", json.dumps(PERSON))
    f2 = b.submit("json_schema", json.dumps(PERSON))
    assert time.perf_counter() - start < 0.5
    assert f1 is f2 and not f1.done()
    gate.set()
    assert f1.result(timeout=30) is not None and calls == ["json_schema"]
    b.shutdown()


@pytest.mark.parametrize("kind,text,needle", [
    ("regex", "a(b", "invalid regex constraint: Regex parsing error"),
    ("json_schema", "{nope", "invalid json_schema constraint: not valid JSON"),
    ("json_schema", '{"type": "foo"}', 'invalid json_schema constraint: Unsupported type "foo"'),
    ("ebnf", "root ::= missing", 'invalid ebnf constraint: EBNF parser error'),
    ("choices", '["a", 3]', "invalid choices constraint: choices must be a non-empty list"),
    ("choices", "[]", "invalid choices constraint: choices must be a non-empty list"),
    ("xml", "<a/>", "unknown constraint kind 'xml'"),
])
def test_invalid_constraints_raise_value_error(backend, kind, text, needle):
    with pytest.raises(ValueError) as info:
        _compile(backend, kind, text)
    assert needle in str(info.value)
    assert "/project/cpp" not in str(info.value)  # C++ log prefix stripped


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_masked_decoding_fullmatches(backend, tok, seed):
    pattern = r"[a-z]{2,5}-[0-9]{2}"
    state = backend.create_state(_compile(backend, "regex", pattern))
    text = tok.decode(_decode(backend, state, seed))
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_masked_decoding_validates(backend, tok, seed):
    state = backend.create_state(_compile(backend, "json_schema", json.dumps(PERSON)))
    text = tok.decode(_decode(backend, state, seed))
    # strict=False: xgrammar 0.2.9 lets a maxLength string hold raw control characters.
    jsonschema.validate(json.loads(text, strict=False), PERSON)
    assert text.startswith('{"name": "')  # bounded: fixed separators, no free whitespace


def test_choices_escaping_and_decoding(backend, tok):
    choices = ['say "hi"', "back\\slash", "a.b*", "line\nbreak", "yes", "yesterday", "café"]
    compiled = _compile(backend, "choices", json.dumps(choices))
    for choice in choices:  # every choice, special characters included, is accepted...
        state = backend.create_state(compiled)
        assert state.accept_tokens(tok.encode(choice, add_special_tokens=False)), choice
        assert state.can_stop()
    state = backend.create_state(compiled)
    assert not state.accept_tokens(tok.encode("a", add_special_tokens=False) * 2)  # ...not "aa"
    seen = {tok.decode(_decode(backend, backend.create_state(compiled), s)) for s in range(6)}
    assert seen and seen <= set(choices)


def test_padded_vocab_is_masked_and_torch_path_matches_kernel(backend, tok):
    state = backend.create_state(_compile(backend, "json_object", ""))
    bitmask = backend.allocate_bitmask(3)
    state.fill_bitmask(bitmask, 0)
    state.fill_bitmask(bitmask, 2)
    logits = torch.randn(3, backend.vocab_size + 5)  # even wider than the model vocab
    ref = logits.clone()
    backend.apply_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(logits[1], ref[1])  # unconstrained row untouched
    assert torch.isinf(logits[[0, 2], len(tok):]).all()  # padding / extra columns masked
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert tok.encode("{", add_special_tokens=False)[0] in allowed
    assert tok.encode("}", add_special_tokens=False)[0] not in allowed
    wide = ref.double()  # float64 has no xgrammar kernel: goes through the torch unpacking
    apply_bitmask(wide, bitmask, [0, 2], backend.vocab_size)
    assert torch.equal(torch.isinf(wide), torch.isinf(logits))


def test_terminated_state_allows_only_stop_tokens(backend, tok):
    state = backend.create_state(_compile(backend, "regex", "ab"))
    assert state.accept_tokens(tok.encode("ab", add_special_tokens=False))
    assert state.can_stop() and not state.is_terminated()
    assert state.accept(tok.eos_token_id) and state.is_terminated()
    assert state.jump_forward_text() == ""
    bitmask = backend.allocate_bitmask(1)
    state.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, backend.vocab_size)
    backend.apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == state.stop_token_ids


def test_jump_forward_text_and_copy(backend, tok):
    state = backend.create_state(_compile(backend, "json_schema", json.dumps(PERSON)))
    assert state.jump_forward_text() == '{"name": "'
    twin = state.copy()
    assert twin.accept_tokens(tok.encode('{"name": "al"', add_special_tokens=False))
    assert twin.jump_forward_text() == ', "age": '
    assert state.jump_forward_text() == '{"name": "' and state.num_tokens == 0


def _byte_tokens(backend, text):
    """Each byte of ``text`` as its own single-byte token (every byte-level BPE has them)."""
    by_bytes = {b: i for i, b in enumerate(backend._token_bytes) if len(b) == 1}
    return [by_bytes[bytes([c])] for c in text.encode()]


def test_jump_forward_retokenizes_across_the_boundary(backend, tok):
    full = '{"name": "'
    # Cut the output inside the first multi-byte token of the natural encoding, so that the
    # re-encoding must replace the cut token with the merged one.
    pos = 0
    for t in tok.encode(full, add_special_tokens=False):
        if len(backend._token_bytes[t]) > 1:
            break
        pos += len(backend._token_bytes[t])
    cut = pos + 1
    state = backend.create_state(_compile(backend, "json_schema", json.dumps(PERSON)))
    output = _byte_tokens(backend, full[:cut])
    assert state.accept_tokens(output)
    assert state.jump_forward_text() == full[cut:]
    result = backend.jump_forward(state, output)
    assert isinstance(result, JumpForward) and result.num_tokens_to_drop >= 1
    merged = output[:len(output) - result.num_tokens_to_drop] + result.new_token_ids
    assert merged == tok.encode(full, add_special_tokens=False)
    assert tok.decode(merged) == full and state.num_tokens == len(merged)
    assert state.jump_forward_text() == ""  # the matcher is past the forced text
    assert state.accept_tokens(tok.encode('ann", "age": 7}', add_special_tokens=False))
    assert state.can_stop()


def test_jump_forward_in_a_decode_loop(backend, tok):
    """Sample where free, jump where forced; the result validates and the matcher agrees."""
    state = backend.create_state(_compile(backend, "json_schema", json.dumps(PERSON)))
    gen, bitmask, output, jumps = torch.Generator().manual_seed(3), backend.allocate_bitmask(1), [], 0
    for _ in range(200):
        if state.is_terminated():
            break
        before = tok.decode(output)
        forced = state.jump_forward_text()
        drop, new = backend.jump_forward(state, output)
        if new:
            jumps += 1
            output = output[:len(output) - drop] + new
            assert tok.decode(output) == before + forced  # streamed text never retracted
            assert state.num_tokens == len(output)
            continue
        state.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, backend.vocab_size, generator=gen)
        backend.apply_bitmask(logits, bitmask)
        token = int(logits.argmax())
        assert state.accept(token)
        output.append(token)
    assert state.is_terminated() and jumps >= 2  # '{"name": "' and ', "age": '
    jsonschema.validate(json.loads(tok.decode(output[:-1]), strict=False), PERSON)


def test_jump_forward_respects_budget_and_empty_force(backend, tok):
    state = backend.create_state(_compile(backend, "json_schema", json.dumps(PERSON)))
    assert backend.jump_forward(state, [], max_added=1) == JumpForward(0, [])
    assert state.num_tokens == 0 and state.jump_forward_text() == '{"name": "'
    regex_state = backend.create_state(_compile(backend, "regex", "[a-z]+"))
    assert backend.jump_forward(regex_state, []) == JumpForward(0, [])
    assert grammar.ebnf_literal('a"\\\n\x01') == '"a\\"\\\\\\n\\x01"'


def test_jump_forward_tail_starting_mid_character(backend, tok):
    state = backend.create_state(_compile(backend, "ebnf", 'root ::= "ééé" "xyz" [a-z]'))
    output = _byte_tokens(backend, "ééé")  # 6 single-byte tokens
    assert state.accept_tokens(output) and state.jump_forward_text() == "xyz"
    # A 3-token tail would start inside the second "é"; the helper must shrink it.
    drop, new = backend.jump_forward(state, output, lookback=3)
    merged = output[:len(output) - drop] + new
    assert drop <= 2 and tok.decode(merged) == "éééxyz" and state.num_tokens == len(merged)


def test_jump_forward_falls_back_when_tokenizer_does_not_round_trip(backend, tok, monkeypatch):
    class PrefixSpace:  # like sentencepiece's dummy prefix: encode(t) != bytes of t
        def encode(self, text, add_special_tokens=False):
            return tok.encode(" " + text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(backend, "tokenizer", PrefixSpace())
    state = backend.create_state(_compile(backend, "json_schema", json.dumps(PERSON)))
    drop, new = backend.jump_forward(state, [])
    assert drop == 0 and new and '{"name": "'.startswith(tok.decode(new))
    assert state.num_tokens == len(new)


@pytest.mark.parametrize("seed", range(6))
def test_length_bounded_strings_hold_no_raw_control_characters(backend, tok, seed):
    """JSON forbids raw control characters in strings; bounded strings must not admit them
    (xgrammar's own conversion does), so a strict parser accepts every output."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 12}},
              "required": ["s"]}
    state = backend.create_state(_compile(backend, "json_schema", json.dumps(schema)))
    text = tok.decode(_decode(backend, state, seed))
    assert not any(ord(c) < 0x20 for c in text), repr(text)
    assert len(json.loads(text)["s"]) <= 12


def test_batched_mask_fill_equals_one_row_at_a_time(backend, tok):
    """fill_bitmasks (one multi-threaded xgrammar call) writes exactly what per-row fills
    write: several grammars at different positions, a terminated state, rows left alone."""
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                          "n": {"type": "integer"}},
                         "required": ["name", "n"]})
    states = []
    for kind, text, prefix in [("json_schema", schema, '{"name": "a'), ("json_schema", schema, ""),
                               ("regex", "[0-9]{3}-x", "12"), ("json_object", "", '{"k": [1, '),
                               ("choices", json.dumps(["yes", "no way"]), "no")]:
        state = backend.create_state(_compile(backend, kind, text))
        assert state.accept_tokens(tok.encode(prefix, add_special_tokens=False)) or not prefix
        states.append(state)
    done = backend.create_state(_compile(backend, "regex", "ab"))
    assert done.accept_tokens(tok.encode("ab", add_special_tokens=False) + [tok.eos_token_id])
    assert done.is_terminated()
    states.append(done)
    rows = [0, 2, 3, 5, 6, 7]  # rows 1 and 4 unconstrained
    expected = backend.allocate_bitmask(8)
    expected.fill_(7)
    for state, row in zip(states, rows):
        state.fill_bitmask(expected, row)
    got = backend.allocate_bitmask(8)
    got.fill_(7)
    backend.fill_bitmasks(got, list(zip(states, rows)))
    assert torch.equal(got, expected)
    assert (got[1] == 7).all() and (got[4] == 7).all()
    assert not torch.equal(got[0], got[2])  # the masks differ by position, so this compares
