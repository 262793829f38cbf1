"""The ensemble's text rules (ensemble/textproc.py) without a server: preprocessing's
prompt ids and postprocessing's stateless text, checked against the engine's own
tokenization and streamed text. The served ensemble is tested in test_ensemble_server.py."""
from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from conftest import MODEL_REPOSITORY, ensure_default_model, model_parameters

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ensemble"))
import textproc  # noqa: E402

PROMPTS = {
    "en": "The quick brown fox jumps over the lazy dog because",
    "vi": "Hà Nội là thủ đô của Việt Nam, nổi tiếng với phở và",
    "th": "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย และมี",
    "zh": "北京是中国的首都，也是一座历史悠久的城市，",
}
IM_END = 2  # <|im_end|>, the EOS id of the default model (SmolLM2)


@pytest.fixture(scope="module")
def default_model() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return textproc.load_tokenizer(str(default_model))


@pytest.fixture(scope="module")
def eos_ids(tokenizer, default_model):
    return textproc.eos_token_ids(str(default_model), tokenizer)


def run_engine(engine, prompt, params: dict, stream: bool = True):
    """The StepOutputs of one request, stepping the in-process engine."""
    rid = engine.add_request(prompt, params, request_id=uuid.uuid4().hex, stream=stream)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == rid]
    assert outputs and outputs[-1].finished
    return outputs


def postprocess(tokenizer, eos_ids, out, options=textproc.TextOptions(), ids=None, context=None):
    return textproc.response_text(tokenizer, eos_ids,
                                  out.new_token_ids if ids is None else ids,
                                  out.context_token_ids if context is None else context,
                                  out.finish_reason or "", options, engine_text=out.new_text)


# ---- configuration ------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["preprocessing", "postprocessing"])
def test_tokenizer_path_is_the_engine_models_model_path(model, default_model):
    llm = model_parameters("llm")
    assert model_parameters(model)["tokenizer_path"] == llm.get("tokenizer_path", llm["model_path"])
    resolved = textproc.tokenizer_dir(model_parameters(model), MODEL_REPOSITORY / model)
    assert resolved == str(default_model.resolve())


def test_the_container_entrypoint_points_every_tokenizer_at_the_served_model(tmp_path):
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("radixlm_entrypoint_ens",
                                                  ROOT / "docker" / "entrypoint.py")
    entrypoint = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = entrypoint
    spec.loader.exec_module(entrypoint)
    repository = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY, repository, symlinks=True)
    entrypoint.apply(repository, {"RADIXLM_MODEL_PATH": "/mnt/model"})
    read = lambda m: entrypoint.read_parameters((repository / m / "config.pbtxt").read_text())  # noqa: E731
    assert read("llm")["model_path"] == "/mnt/model"
    assert read("preprocessing")["tokenizer_path"] == read("postprocessing")["tokenizer_path"] \
        == "/mnt/model"


def test_a_model_without_tokenizer_path_fails_to_load_with_a_clear_message():
    with pytest.raises(ValueError, match="tokenizer_path"):
        textproc.tokenizer_dir({}, MODEL_REPOSITORY / "preprocessing")


def test_eos_ids_are_the_engines(reference_engine, eos_ids):
    assert eos_ids == frozenset(reference_engine.eos_token_ids)


# ---- preprocessing ------------------------------------------------------------------------

@pytest.mark.parametrize("language", sorted(PROMPTS))
def test_text_is_tokenized_as_the_engine_does(tokenizer, reference_engine, language):
    ids = textproc.prompt_ids(tokenizer, text=PROMPTS[language])
    assert ids == reference_engine.tokenizer.encode(PROMPTS[language])
    out = run_engine(reference_engine, ids, {"max_tokens": 1, "temperature": 0})[-1]
    assert out.num_prompt_tokens == len(ids)


def test_messages_are_rendered_with_the_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Xin chào"}]
    ids = textproc.prompt_ids(tokenizer, messages=json.dumps(messages))
    rendered = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nXin chào<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tokenizer.decode(ids) == rendered
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_apply_chat_template_makes_the_text_one_user_message(tokenizer):
    as_flag = textproc.prompt_ids(tokenizer, text="你好", apply_chat_template=True)
    as_messages = textproc.prompt_ids(tokenizer, messages='[{"role": "user", "content": "你好"}]')
    assert as_flag == as_messages
    assert tokenizer.decode(as_flag).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("kwargs, message", [
    ({"messages": '[{"role": "user", "content": "hi"'}, "'messages' is not valid JSON"),
    ({"messages": '{"role": "user", "content": "hi"}'}, "must be a non-empty JSON list"),
    ({"messages": "[]"}, "must be a non-empty JSON list"),
    ({"messages": '["hi"]'}, r"'messages'\[0\] must be an object"),
    ({"messages": '[{"content": "hi"}]'}, r"'messages'\[0\] needs a non-empty string 'role'"),
    ({"messages": '[{"role": "user", "content": "a"}, {"role": "user", "content": 3}]'},
     r"'messages'\[1\] needs a string 'content'"),
    ({"messages": '[{"role": "user", "content": "a"}]', "text": "b"}, "not both"),
    ({}, "missing input 'text_input'"),
    ({"text": ""}, "'text_input' is empty"),
])
def test_malformed_prompts_get_a_clear_error(tokenizer, kwargs, message):
    with pytest.raises(textproc.RequestError, match=message):
        textproc.prompt_ids(tokenizer, **kwargs)


def test_a_tokenizer_without_chat_template_says_so(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(textproc.RequestError, match="no chat template"):
        textproc.chat_prompt(NoTemplate(), [{"role": "user", "content": "hi"}])


def test_a_template_that_raises_is_a_request_error(tokenizer):
    class Strict:
        chat_template = "x"

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Conversation roles must alternate user/assistant")

    with pytest.raises(textproc.RequestError, match="rejected 'messages': Conversation roles"):
        textproc.chat_prompt(Strict(), [{"role": "user", "content": "hi"}])


# ---- postprocessing ---------------------------------------------------------------------

@pytest.mark.parametrize("language", sorted(PROMPTS))
def test_each_streamed_response_decodes_to_the_engines_text(tokenizer, eos_ids,
                                                           reference_engine, language):
    outputs = run_engine(reference_engine, PROMPTS[language],
                         {"max_tokens": 24, "temperature": 0})
    pieces = [postprocess(tokenizer, eos_ids, out) for out in outputs]
    assert pieces == [out.new_text for out in outputs]
    assert "".join(pieces)


@pytest.mark.parametrize("language", sorted(PROMPTS))
def test_a_whole_answer_decodes_from_its_ids_and_first_context(tokenizer, eos_ids,
                                                              reference_engine, language):
    params = {"max_tokens": 24, "temperature": 0}
    streamed = run_engine(reference_engine, PROMPTS[language], params)
    ids = [t for out in streamed for t in out.new_token_ids]
    text = postprocess(tokenizer, eos_ids, streamed[-1], ids=ids,
                       context=streamed[0].context_token_ids)
    assert text == "".join(out.new_text for out in streamed)
    (whole,) = run_engine(reference_engine, PROMPTS[language], params, stream=False)[-1:]
    assert text == whole.new_text


def test_an_eos_that_stopped_the_request_has_no_text(tokenizer, eos_ids, reference_engine):
    """Make the 4th greedy token an EOS id: the engine stops there and returns no text for
    it, even with special tokens shown; postprocessing drops it too."""
    prompt, params = PROMPTS["en"], {"max_tokens": 12, "temperature": 0,
                                     "skip_special_tokens": False}
    free = run_engine(reference_engine, prompt, params)
    fourth = [t for out in free for t in out.new_token_ids][3]
    reference_engine.eos_token_ids.add(fourth)
    try:
        stopped = run_engine(reference_engine, prompt, params)
    finally:
        reference_engine.eos_token_ids.discard(fourth)
    assert stopped[-1].finish_reason == "stop" and stopped[-1].new_token_ids[-1] == fourth
    options = textproc.TextOptions(skip_special_tokens=False)
    pieces = [postprocess(tokenizer, eos_ids | {fourth}, out, options) for out in stopped]
    assert pieces == [out.new_text for out in stopped]
    with_eos = postprocess(tokenizer, eos_ids | {fourth}, stopped[-1],
                           textproc.TextOptions(skip_special_tokens=False, ignore_eos=True))
    assert with_eos == stopped[-1].new_text + tokenizer.decode([fourth])


def test_special_tokens_show_only_when_asked(tokenizer, eos_ids):
    ids = tokenizer.encode("Hi") + [IM_END]
    shown = textproc.TextOptions(skip_special_tokens=False)
    assert textproc.response_text(tokenizer, eos_ids, ids, [], "length", shown) == "Hi<|im_end|>"
    assert textproc.response_text(tokenizer, eos_ids, ids, [], "length",
                                  textproc.TextOptions()) == "Hi"
    # ended by that EOS: no text for it either way
    assert textproc.response_text(tokenizer, eos_ids, ids, [], "stop", shown) == "Hi"


def test_the_last_response_releases_a_cut_character_unless_aborted(tokenizer, eos_ids):
    ids = tokenizer.encode("龘")
    assert len(ids) > 1, "needs a character split over several tokens"
    first = ids[:1]
    assert textproc.response_text(tokenizer, eos_ids, first, [], "", textproc.TextOptions()) == ""
    assert textproc.response_text(tokenizer, eos_ids, first, [], "length",
                                  textproc.TextOptions()) == "\ufffd"
    assert textproc.response_text(tokenizer, eos_ids, first, [], "abort",
                                  textproc.TextOptions()) == ""


def test_with_stop_strings_the_engines_text_is_passed_on(tokenizer, eos_ids, reference_engine):
    free = run_engine(reference_engine, PROMPTS["vi"], {"max_tokens": 8, "temperature": 0})
    text = "".join(o.new_text for o in free)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    outputs = run_engine(reference_engine, PROMPTS["vi"],
                         {"max_tokens": 8, "temperature": 0, "stop": [stop]})
    options = textproc.TextOptions.from_parameters({"stop": stop})
    pieces = [postprocess(tokenizer, eos_ids, out, options) for out in outputs]
    assert "".join(pieces) == text[:text.index(stop)]


def test_text_options_come_from_request_parameters_and_the_config_default():
    assert textproc.TextOptions.from_parameters({}) == textproc.TextOptions()
    assert textproc.TextOptions.from_parameters({}, skip_special_tokens=False) \
        == textproc.TextOptions(skip_special_tokens=False)
    options = textproc.TextOptions.from_parameters(
        {"skip_special_tokens": True, "stop": "\n\n", "ignore_eos": True, "temperature": 0},
        skip_special_tokens=False)
    assert options == textproc.TextOptions(skip_special_tokens=True, stop=("\n\n",),
                                           ignore_eos=True)
