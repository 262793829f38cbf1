"""Splitting a reasoning model's output into its reasoning and its answer."""
from __future__ import annotations

from typing import NamedTuple


class ReasoningFormat(NamedTuple):
    start: str
    end: str
    # The chat template already opened the reasoning block: the output starts inside it,
    # usually without the start marker.
    starts_inside: bool


FORMATS = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", True),
    "deepseek-v3": ReasoningFormat("<think>", "</think>", False),
    "qwen3": ReasoningFormat("<think>", "</think>", False),
    "qwen3-thinking": ReasoningFormat("<think>", "</think>", True),
    "glm45": ReasoningFormat("<think>", "</think>", False),
    "step3": ReasoningFormat("<think>", "</think>", True),
    "kimi": ReasoningFormat("\u25c1think\u25b7", "\u25c1/think\u25b7", False),
}


def check_model_type(model_type: str | None) -> ReasoningFormat:
    if model_type not in FORMATS:
        raise ValueError(f"separate_reasoning: unknown model_type {model_type!r}; known: "
                         f"{', '.join(sorted(FORMATS))}")
    return FORMATS[model_type]


def split(text: str, model_type: str | None) -> tuple[str, str]:
    """(reasoning, answer). Output that never enters a reasoning block is all answer;
    output whose block never closes is all reasoning."""
    fmt = check_model_type(model_type)
    if not (fmt.starts_inside or fmt.start in text):
        return "", text
    body = text.replace(fmt.start, "", 1).strip() if fmt.start in text else text.strip()
    if fmt.end not in body:
        return body, ""
    reasoning, answer = body.split(fmt.end, 1)
    return reasoning.strip(), answer.strip()
