"""Text in and out of the ensemble, without Triton: prompt ids for the `preprocessing`
model and stateless detokenization of one engine response for `postprocessing`.

``preprocessing.py`` and ``postprocessing.py`` (next to this file) are the Triton glue;
this module is plain Python so tests import it directly.

Prompt (preprocessing), exactly one of:
  * ``text_input``                      -> ``tokenizer.encode(text)``, as the engine does;
  * ``text_input`` + ``apply_chat_template: true`` -> the text as one user message;
  * ``messages`` (JSON list of ``{"role": str, "content": str}``) -> the tokenizer's chat
    template with the generation prompt, then encoded without adding special tokens
    (the template writes them).

Text (postprocessing): one engine response carries its new ids and ``context_ids``, the
ids before them (see backend/core/detokenizer.py, "window rule"); ``decode_window`` over
``context + new`` yields exactly the engine's text for those ids, statelessly. Engine
rules mirrored so that the text is the engine's, not merely close to it:
  * an EOS id that ended the request (``finish_reason == "stop"``) is among the ids but
    its text is not returned (unless ``ignore_eos``);
  * the last response flushes held-back text (``final=True``), except after ``abort``,
    where the engine drops it.
What ids can't carry comes from the request's parameters (see ``TextOptions``):
``skip_special_tokens``, ``ignore_eos`` and ``stop``. Stop strings can't be applied
statelessly (the engine holds back text that might begin one, which needs the text
before the window), so with ``stop`` the engine's own ``text_output`` is passed on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from backend.core.detokenizer import decode_window
from backend.core.special_tokens import eos_token_ids  # noqa: F401  (re-exported)
from backend.model_config import PROJECT_ROOT, resolve_path


class RequestError(ValueError):
    """A malformed request; the message goes back to that client as is."""


# ---- configuration --------------------------------------------------------------------

def tokenizer_dir(parameters: Mapping[str, str], model_dir: Path) -> str:
    """The folder of the tokenizer: config.pbtxt parameter ``tokenizer_path`` (the engine
    model's ``model_path``; docker/entrypoint.py keeps them equal). Relative paths resolve
    as the engine's do: against the model's folder, the repository, the folder above it,
    then the project root."""
    value = parameters.get("tokenizer_path")
    if not value:
        raise ValueError("config.pbtxt must set the parameter 'tokenizer_path' "
                         "(the engine model's model_path)")
    search_dirs = [model_dir, model_dir.parent, model_dir.parent.parent, PROJECT_ROOT]
    return resolve_path(value, search_dirs)


def load_tokenizer(path: str):
    """The engine's tokenizer for this path. A folder's tokenizer files load as
    transformers' fast tokenizer: the same vocabulary and rules as the engine's
    ``AutoTokenizer``, without what ``AutoTokenizer`` imports to pick a model-specific
    class (torch among it: seconds and a few hundred MB for a text-only step). A GGUF file
    (or a folder holding one) gives its own tokenizer and chat template."""
    from backend.core.loaders import find_gguf

    gguf = find_gguf(path) if not (Path(path) / "tokenizer.json").exists() else None
    if gguf is not None:
        from backend.core.loaders import load_tokenizer as load  # as the engine does

        return load(gguf)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


# ---- preprocessing ----------------------------------------------------------------------

def parse_messages(text: str) -> list[dict[str, Any]]:
    """A chat as the ``messages`` input carries it; raises ``RequestError`` saying what is
    wrong. Keys other than role and content are passed to the template unchanged."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"'messages' is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty JSON list of "
                           '{"role": ..., "content": ...} objects')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"'messages'[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RequestError(f"'messages'[{i}] needs a non-empty string 'role'")
        if not isinstance(content, str):
            raise RequestError(f"'messages'[{i}] needs a string 'content'")
    return messages


def chat_prompt(tokenizer, messages: list[dict[str, Any]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("the served model's tokenizer has no chat template; "
                           "send 'text_input' without 'messages'")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # jinja2 errors, raise_exception() in the template
        raise RequestError(f"the chat template rejected 'messages': {exc}") from None


def prompt_ids(tokenizer, text: str | None = None, messages: str | None = None,
               apply_chat_template: bool = False) -> list[int]:
    """Token ids of one request's prompt (see the module docstring)."""
    if text is not None and messages is not None:
        raise RequestError("give either 'text_input' or 'messages', not both")
    if messages is not None:
        chat = parse_messages(messages)
    elif text is None:
        raise RequestError("missing input 'text_input' (or 'messages')")
    elif not text:
        raise RequestError("'text_input' is empty")
    elif apply_chat_template:
        chat = [{"role": "user", "content": text}]
    else:
        return tokenizer.encode(text)
    return tokenizer.encode(chat_prompt(tokenizer, chat), add_special_tokens=False)


# ---- postprocessing ---------------------------------------------------------------------

@dataclass(frozen=True)
class TextOptions:
    """What the text of a response depends on besides its ids.

    Triton lets an ensemble step take inputs from one decoupled model only, so the
    postprocessing step sees the engine's outputs and nothing of the request's
    ``sampling_parameters`` tensor. It does see the request's *parameters* (Triton
    forwards them to every step; the engine reads them as sampling parameters too), and
    its own config.pbtxt; options come from those."""

    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any],
                        skip_special_tokens: bool = True) -> "TextOptions":
        stop = parameters.get("stop") or ()
        return cls(skip_special_tokens=bool(parameters.get("skip_special_tokens",
                                                           skip_special_tokens)),
                   stop=(stop,) if isinstance(stop, str) else tuple(stop),
                   ignore_eos=bool(parameters.get("ignore_eos", False)))


def response_text(tokenizer, eos_ids: Iterable[int], output_ids: list[int],
                  context_ids: list[int], finish_reason: str, options: TextOptions,
                  engine_text: str | None = None) -> str:
    """The text of one engine response, from its ids alone (see the module docstring).

    ``output_ids`` are the response's new ids (streamed) or all of them (whole answer):
    the same rule serves both, since a whole answer is one final response whose context
    precedes the first output id. ``finish_reason`` is "" until the last response.
    ``engine_text`` (the engine's own text for the response) is used only with stop
    strings."""
    if options.stop:
        return engine_text or ""
    ids = list(output_ids)
    if finish_reason == "stop" and ids and not options.ignore_eos and ids[-1] in eos_ids:
        ids.pop()  # the engine returns no text for the token that stopped it
    window = list(context_ids) + ids
    flush = bool(finish_reason) and finish_reason != "abort"
    text, _, _ = decode_window(tokenizer, window, 0, len(context_ids),
                               options.skip_special_tokens, final=flush)
    return text
