"""Role prefixes and suffixes derived from a model's Jinja chat template (ChatML if none).

The language appends a role's prefix when ``with s.user():`` opens and its suffix when it
closes, so a program's text grows token-exactly as the template would render the whole
conversation. The pieces are found by rendering conversations that end in a sentinel:

    render([system: A, user: <S>])  =  render([system: A]) + user_prefix + <S> + user_suffix
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant")
_SENTINEL = "\u2063RADIXLM-CONTENT\u2063"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise(message: str):
    raise jinja2.TemplateError(message)


@dataclass(frozen=True)
class ChatTemplate:
    prefixes: dict[str, str]
    suffixes: dict[str, str]
    # Text the template puts first when a conversation does not open with a system message
    # (for example Qwen2's default system prompt); "" for most templates.
    preamble: str = ""
    source: str = CHATML_TEMPLATE

    def prefix(self, role: str) -> str:
        return self.prefixes[_check_role(role)]

    def suffix(self, role: str) -> str:
        return self.suffixes[_check_role(role)]

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The conversation as the language would build it, role by role."""
        parts = [] if not messages or messages[0]["role"] == "system" else [self.preamble]
        for message in messages:
            role = message["role"]
            parts += [self.prefix(role), message["content"], self.suffix(role)]
        if add_generation_prompt:
            parts.append(self.prefix("assistant"))
        return "".join(parts)

    def render_jinja(self, messages: list[dict], add_generation_prompt: bool = True,
                     eos_token: str = "", **context) -> str:
        """Render the template itself, as Hugging Face's ``apply_chat_template`` does:
        messages may carry any role and fields the template knows (``tool_calls``,
        ``tool_call_id``), and ``context`` passes e.g. ``tools``. Raises
        ``jinja2.TemplateError`` when the template refuses the conversation."""
        return _compile(self.source).render(messages=messages,
                                            add_generation_prompt=add_generation_prompt,
                                            bos_token="", eos_token=eos_token, **context)

    @classmethod
    def chatml(cls) -> "ChatTemplate":
        return cls.from_jinja(CHATML_TEMPLATE)

    @classmethod
    def from_jinja(cls, source: str | None, bos_token: str = "",
                   eos_token: str = "") -> "ChatTemplate":
        """Derive role pieces from a Hugging Face chat template; ChatML when it cannot be used.

        ``bos_token`` is normally left empty: the server's tokenizer adds BOS itself, and a
        literal BOS in the text would be encoded a second time.
        """
        if not source:
            return cls.from_jinja(CHATML_TEMPLATE)
        try:
            template = _compile(source)

            def render(messages, add_generation_prompt=False):
                return template.render(messages=messages, bos_token=bos_token,
                                       eos_token=eos_token,
                                       add_generation_prompt=add_generation_prompt)

            return cls._derive(render, source)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError):
            if source == CHATML_TEMPLATE:
                raise
            return cls.from_jinja(CHATML_TEMPLATE)

    @classmethod
    def _derive(cls, render, source: str) -> "ChatTemplate":
        system = {"role": "system", "content": "A"}
        user = {"role": "user", "content": "B"}
        contexts = {"system": [], "user": [system], "assistant": [system, user]}
        prefixes, suffixes = {}, {}
        for role, before in contexts.items():
            base = render(before)
            full = render(before + [{"role": role, "content": _SENTINEL}])
            if not full.startswith(base) or full.count(_SENTINEL) != 1:
                raise ValueError(f"template does not render {role} turns incrementally")
            prefixes[role], suffixes[role] = full[len(base):].split(_SENTINEL)
        lone_user = render([{"role": "user", "content": _SENTINEL}]).split(_SENTINEL)[0]
        if not lone_user.endswith(prefixes["user"]):
            raise ValueError("template renders a first user turn differently")
        preamble = lone_user[: len(lone_user) - len(prefixes["user"])]
        return cls(prefixes=prefixes, suffixes=suffixes, preamble=preamble, source=source)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    """Templates are compiled once per source (rendering is cheap, compiling is not)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    return role
