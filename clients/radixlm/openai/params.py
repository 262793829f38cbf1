"""OpenAI request -> what the engine is asked: the prompt and the wire sampling parameters.

The wire keys are those of ``radixlm.wire.SAMPLING_KEYS`` (the engine's
``sampling_parameters``); structured output goes through the engine's own
``response_format`` and ``json_schema`` constraints.
"""
from __future__ import annotations

import json
from typing import Any

import jinja2

from .engine import ModelInfo
from .errors import bad_request
from .protocol import (ChatCompletionRequest, CompletionRequest, ResponseFormat,
                       SamplingFields)
from .tools import ToolPlan, calls_as_text, tools_preamble

# The knobs that pass through unchanged (OpenAI's and vLLM's extensions of it share the
# engine's names).
_PASSED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "ignore_eos", "skip_special_tokens", "logit_bias",
           "min_tokens", "stop_token_ids", "include_stop_str_in_output",
           "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
           "truncate_prompt_tokens")


def sampling(request: SamplingFields, max_tokens: int | None, default_max_tokens: int | None,
             logprobs: int | None) -> dict[str, Any]:
    """Wire parameters of one engine request (one per prompt; ``n`` samples each)."""
    params: dict[str, Any] = {k: getattr(request, k) for k in _PASSED
                              if getattr(request, k) is not None}
    if isinstance(params.get("temperature"), int):
        params["temperature"] = float(params["temperature"])
    limit = max_tokens if max_tokens is not None else default_max_tokens
    if limit is not None:
        params["max_tokens"] = limit
    if request.stop is not None:
        params["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        if not all(params["stop"]):
            raise bad_request("stop strings must not be empty", "stop")
    params["n"] = request.n
    if logprobs is not None:
        params["logprobs"] = logprobs
    return params


def engine_logprobs(want: bool, top: int | None) -> int | None:
    """The engine's ``logprobs`` (vLLM's meaning): 0 gives the chosen token's logprob,
    k also the k best alternatives; None asks for none."""
    if not want:
        return None
    return top or 0


def response_format(fmt: ResponseFormat | None) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("response_format of type json_schema needs 'json_schema'",
                          "response_format.json_schema")
    return {"type": "json_schema", "json_schema": {"schema": fmt.json_schema.schema_}}


def completion_params(request: CompletionRequest, default_max_tokens: int | None) -> dict:
    """Wire parameters of a completion. ``echo`` with ``logprobs`` also asks for the
    prompt's (every position but the first, with as many alternatives); ``max_tokens`` 0
    (with ``echo`` only: the prompt is the whole answer) asks for one token, which the
    answer then leaves out."""
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")
    max_tokens = request.max_tokens
    if max_tokens == 0:
        if not request.echo:
            raise bad_request("max_tokens 0 needs echo (the answer is then the prompt)",
                              "max_tokens")
        max_tokens = 1
    params = sampling(request, max_tokens, default_max_tokens,
                      engine_logprobs(request.logprobs is not None, request.logprobs))
    if request.echo and request.logprobs is not None:
        params["prompt_logprobs"] = request.logprobs
    if request.best_of is not None:
        params["best_of"] = request.best_of
    fmt = response_format(request.response_format)
    if fmt is not None:
        params["response_format"] = fmt
    return params


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """One engine prompt per OpenAI prompt: a string, a list of strings, token ids, or a
    list of token-id lists."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if any(len(p) == 0 for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


def chat_params(request: ChatCompletionRequest, tool_plan: ToolPlan,
                default_max_tokens: int | None) -> dict:
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = request.max_completion_tokens or request.max_tokens
    params = sampling(request, max_tokens, default_max_tokens,
                      engine_logprobs(request.logprobs, request.top_logprobs))
    if tool_plan.schema is not None:  # a forced call: its schema is the whole output
        params["json_schema"] = json.dumps(tool_plan.schema)
    else:
        fmt = response_format(request.response_format)
        if fmt is not None:
            params["response_format"] = fmt
    return params


def chat_prompt(request: ChatCompletionRequest, info: ModelInfo) -> str:
    """The conversation rendered by the model's own chat template. Templates that do not
    render tools or tool calls get them written into the text (``tools.py``'s format)."""
    source = info.chat_template.source
    messages = [_message_dict(m, tool_calls_in_text="tool_calls" not in source)
                for m in request.messages]
    context: dict[str, Any] = {}
    if request.tools:
        tools = [t.model_dump(by_alias=True, exclude_none=True) for t in request.tools]
        if "tools" in source:
            context["tools"] = tools
        else:
            messages = _with_system_text(messages, tools_preamble(request.tools))
    try:
        return info.chat_template.render_jinja(messages, add_generation_prompt=True,
                                               eos_token=info.eos_token, **context)
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise bad_request(f"the model's chat template cannot render these messages: {exc}",
                          "messages") from exc


def _message_dict(message, tool_calls_in_text: bool) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.function.name,
                               "arguments": _json_or_text(c.function.arguments)}}
                 for c in message.tool_calls]
        if tool_calls_in_text:
            text = calls_as_text(calls)
            out["content"] = f"{out['content']}\n{text}" if out["content"] else text
        else:
            out["tool_calls"] = calls
    return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
