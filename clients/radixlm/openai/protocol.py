"""Typed request bodies of the OpenAI endpoints (pydantic).

Types and ranges are checked here, so a malformed request is refused with a 400 naming the
field before anything reaches the engine. Unknown fields are ignored, as OpenAI-compatible
servers do: routers in front of us add fields of their own (``no_stop_trim``,
``separate_reasoning``, ...).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# What the engine accepts (backend/core/sampling_params.py); OpenAI's own limits are these
# or wider (temperature up to 2, n up to 128).
MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: StrictBool = False


class JsonSchemaSpec(_Model):
    name: StrictStr = "response"
    description: StrictStr | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class FunctionSpec(_Model):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: StrictBool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Model):
    name: StrictStr


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Model):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Model):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


Content = Union[StrictStr, list[TextPart], None]


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


Stop = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=16)], None]
Number = Union[StrictInt, float]


class SamplingFields(_Model):
    """Fields both endpoints share."""

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: StrictInt | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    seed: StrictInt | None = None
    stop: Stop = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    user: StrictStr | None = None
    # OpenAI's token id (as a string) -> bias added to its logit
    logit_bias: dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    # vLLM's extensions of the OpenAI API, passed to the engine's keys of the same names
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    include_stop_str_in_output: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    allowed_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    bad_words: list[StrictStr] | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None


Prompt = Union[
    StrictStr,
    Annotated[list[StrictStr], Field(min_length=1)],
    Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)],
    Annotated[list[Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]],
              Field(min_length=1)],
]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # 0 (with echo) asks for the prompt's logprobs only, as evaluation harnesses do
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    echo: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: StrictStr | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(_Model):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for prompt, false for messages


class DetokenizeRequest(_Model):
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool = True
