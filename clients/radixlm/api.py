"""The language's public functions, with SGLang's names and signatures (``sglang.api``)."""
from __future__ import annotations

from typing import Any, Sequence

from .backend import BaseBackend
from .choices import ChoicesSamplingMethod, token_length_normalized
from .endpoint import RuntimeEndpoint
from .ir import (Concat, Expr, Gen, GenParams, RoleBegin, RoleEnd, Select, SeparateReasoning,
                 named_outputs, role_expr)
from .program import function, get_default_backend, set_default_backend
from .reasoning import check_model_type

_DTYPES = (int, float, bool, str, "int", "float", "bool", "str")


def _strings(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        stop_regex: str | Sequence[str] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: Any = None,
        choices: Sequence[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        json_schema: Any = None, *, ebnf: str | None = None,
        repetition_penalty: float | None = None, seed: int | None = None,
        max_new_tokens: int | None = None) -> Expr:
    """Generate into variable ``name``; with ``choices`` it is a ``select``.

    ``dtype`` (int, float, bool or str) constrains the text to that type's ``REGEX_*``.
    """
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"gen {name!r}: dtype must be int, float, bool or str, got {dtype!r}")
    params = GenParams(
        max_new_tokens=max_tokens if max_tokens is not None else max_new_tokens,
        min_new_tokens=min_tokens, n=n, stop=_strings(stop),
        stop_token_ids=None if stop_token_ids is None else tuple(stop_token_ids),
        stop_regex=_strings(stop_regex), temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty, ignore_eos=ignore_eos, seed=seed,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
        dtype=dtype, regex=regex, json_schema=json_schema, ebnf=ebnf)
    return Gen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs) -> Expr:
    """``gen(dtype=int)``: an integer."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs) -> Expr:
    """``gen(dtype=str)``: a double-quoted string."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(name: str | None = None, choices: Sequence[str] | None = None,
           temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Expr:
    """Append whichever of ``choices`` the model finds most likely, by ``choices_method``
    (default: the highest mean token logprob)."""
    choices = tuple(choices or ())
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select {name!r}: choices must be a non-empty list of non-empty "
                         "strings")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise TypeError(f"select {name!r}: choices_method must be a ChoicesSamplingMethod "
                        "(radixlm.token_length_normalized, greedy_token_selection, "
                        "unconditional_likelihood_normalized)")
    if temperature > 1e-5:
        raise ValueError(f"select {name!r}: choices are scored, not sampled; temperature "
                         f"must be 0, got {temperature}")
    return Select(name, choices, choices_method)


def system(expr: Expr | str | None = None) -> Expr:
    return role_expr("system", expr)


def user(expr: Expr | str | None = None) -> Expr:
    return role_expr("user", expr)


def assistant(expr: Expr | str | None = None) -> Expr:
    return role_expr("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def separate_reasoning(expr: Expr | None = None, model_type: str | None = None) -> Expr:
    """Run ``expr``; then each named gen in it holds only the answer, and
    ``<name>_reasoning_content`` the model's reasoning (the text of the state keeps only
    the answer)."""
    check_model_type(model_type)
    names = named_outputs(expr) if expr is not None else ()
    if not names:
        raise ValueError("separate_reasoning needs a named gen or select to separate")
    return Concat((expr, SeparateReasoning(model_type, names)))


def image(expr: Any) -> Expr:
    raise NotImplementedError("image(): the llm model is text-only; images are not supported")


def video(path: str, num_frames: int) -> Expr:
    raise NotImplementedError("video(): the llm model is text-only; videos are not supported")


def flush_cache(backend: BaseBackend | None = None) -> bool:
    """Empty the server's prefix cache (False without a backend)."""
    backend = backend or get_default_backend()
    if backend is None:
        return False
    return backend.flush_cache()


def get_server_info(backend: BaseBackend | None = None) -> dict[str, Any] | None:
    backend = backend or get_default_backend()
    return None if backend is None else backend.get_server_info()


def Runtime(*args, **kwargs):  # noqa: N802 (SGLang's name)
    raise RuntimeError("radixlm does not start a server inside the program: start "
                       "tritonserver (`make serve`, or `radixlm-serve`) and use "
                       "radixlm.RuntimeEndpoint('http://localhost:8000')")


def Engine(*args, **kwargs):  # noqa: N802 (SGLang's name)
    return Runtime(*args, **kwargs)


def _api_model(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name}: API-model backends are not part of radixlm; "
                                  "name the server with radixlm.RuntimeEndpoint(url)")
    refuse.__name__ = name
    return refuse


OpenAI = _api_model("OpenAI")
Anthropic = _api_model("Anthropic")
VertexAI = _api_model("VertexAI")
LiteLLM = _api_model("LiteLLM")


__all__ = [
    "Anthropic", "Engine", "LiteLLM", "OpenAI", "Runtime", "VertexAI", "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end",
    "flush_cache", "function", "gen", "gen_int", "gen_string", "get_default_backend",
    "get_server_info", "image", "select", "separate_reasoning", "set_default_backend",
    "system", "system_begin", "system_end", "user", "user_begin", "user_end", "video",
]
