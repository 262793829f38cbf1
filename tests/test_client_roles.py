"""Chat roles in the language: prefixes and suffixes derived from the model's chat template."""
from __future__ import annotations

import sys
from pathlib import Path

import jinja2

try:
    import radixlm
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm

from radixlm import assistant, gen, system, user
from radixlm.chat_template import ChatTemplate
from radixlm.testing import FakeBackend

LLAMA3_STYLE = (
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def test_roles_render_with_the_models_chat_template_and_build_messages():
    template = ChatTemplate.from_jinja(LLAMA3_STYLE)
    backend = FakeBackend(reply=lambda prompt, params: "Paris", template=template)

    @radixlm.function
    def prog(s, question):
        s += system("Be brief.")
        with s.user():
            s += question
        s += assistant(gen("answer"))

    state = prog.run(question="Capital of France?", backend=backend)
    assert state.text() == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nParis<|eot_id|>")
    assert backend.calls[0][1].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ]


def test_a_template_default_system_prompt_is_added_when_the_program_has_none():
    qwen_style = (
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
        "{{ '<|im_start|>system\nDefault.<|im_end|>\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}")
    backend = FakeBackend(template=ChatTemplate.from_jinja(qwen_style))

    @radixlm.function
    def prog(s):
        s += user("hi") + assistant(gen("a"))

    assert prog.run(backend=backend).text() == (
        "<|im_start|>system\nDefault.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n")


def test_the_role_context_manager_and_the_role_functions_build_the_same_text():
    backend = FakeBackend(reply=lambda prompt, params: "fine")

    @radixlm.function
    def with_blocks(s):
        with s.system():
            s += "Sys."
        with s.user():
            s += "How are you?"
        with s.assistant():
            s += gen("reply")

    @radixlm.function
    def with_functions(s):
        s += system("Sys.") + user("How are you?") + assistant(gen("reply"))

    a, b = with_blocks.run(backend=backend), with_functions.run(backend=backend)
    assert a.text() == b.text() == (
        "<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\nfine<|im_end|>\n")
    assert a.messages() == b.messages()


def test_a_template_that_cannot_render_turn_by_turn_falls_back_to_chatml():
    # Folds the system prompt into the first user turn, so a lone system turn renders nothing.
    folded = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
              "[/INST]{% elif m['role'] == 'assistant' %}{{ m['content'] }}</s>{% endif %}"
              "{% endfor %}")
    assert ChatTemplate.from_jinja(folded) == ChatTemplate.chatml()
    assert ChatTemplate.from_jinja(None) == ChatTemplate.chatml()


def test_rendering_a_conversation_matches_the_jinja_template_itself():
    template = ChatTemplate.from_jinja(LLAMA3_STYLE)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    expected = jinja2.Environment().from_string(LLAMA3_STYLE).render(
        messages=messages, add_generation_prompt=True)
    assert template.render(messages, add_generation_prompt=True) == expected
