"""Tool calling: the constraint a ``tool_choice`` puts on the output, and the calls read back.

  tool_choice            output is constrained to               read back as
  ---------------------  -------------------------------------  ---------------------------
  {"function": {name}}   the function's parameters schema       one call of that function
  "required"             one call object {"name", "arguments"}  one call (a list of calls
                         (a list of them with parallel calls)   with parallel calls)
  "auto" (the default    nothing: the model writes text, and    calls found as <tool_call>
  when tools are given)  calls in the Hermes format it is       {"name", "arguments"}
                         asked for                              </tool_call> blocks
  "none"                 nothing                                no calls

The first two are guaranteed by structured decoding to parse and to match the schema;
"auto" depends on the model following the format.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .protocol import ChatCompletionRequest, NamedToolChoice, Tool

_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    schema: dict | None  # the output constraint (None: unconstrained)
    named: str | None = None
    parallel: bool = True


def plan(request: ChatCompletionRequest) -> ToolPlan:
    tools = request.tools or []
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        tool = _find(tools, choice.function.name)
        return ToolPlan("named", tool.function.parameters, named=tool.function.name)
    if choice == "required":
        call = {"anyOf": [_call_schema(t) for t in tools]}
        schema = ({"type": "array", "items": call, "minItems": 1}
                  if request.parallel_tool_calls else call)
        return ToolPlan("required", schema, parallel=request.parallel_tool_calls)
    return ToolPlan(choice, None)


def _find(tools: list[Tool], name: str) -> Tool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise bad_request(f"tool_choice names the function '{name}', which is not among the tools",
                      "tool_choice")


def _call_schema(tool: Tool) -> dict:
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "arguments": tool.function.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def new_call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


def read_calls(plan_: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished answer."""
    if plan_.mode == "named":
        return None, [new_call(plan_.named, text)]
    if plan_.mode == "required":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (finish_reason "length"): give the text back as is
        calls = value if isinstance(value, list) else [value]
        return None, [new_call(c["name"], c["arguments"]) for c in calls]
    if plan_.mode == "auto":
        calls = []
        for match in _HERMES_CALL.finditer(text):
            try:
                value = json.loads(match.group(1))
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict) and isinstance(value.get("name"), str):
                calls.append(new_call(value["name"], value.get("arguments", {})))
        if calls:
            rest = _HERMES_CALL.sub("", text).strip()
            return rest or None, calls
    return text, []


# ---- how tools reach the prompt ------------------------------------------------------

def tools_preamble(tools: list[Tool]) -> str:
    """Tool descriptions for templates that do not render ``tools`` themselves, in the
    Hermes format that "auto" reads back."""
    lines = "\n".join(json.dumps(t.model_dump(by_alias=True, exclude_none=True), ensure_ascii=False)
                      for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions "
            f"are listed within <tools></tools>:\n<tools>\n{lines}\n</tools>\nFor each call, "
            "return a JSON object with the function name and arguments within <tool_call>"
            "</tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def calls_as_text(tool_calls: list[dict]) -> str:
    """An assistant turn's calls written out, for templates that do not render them."""
    parts = []
    for call in tool_calls:
        function = call["function"]
        parts.append("<tool_call>\n" + json.dumps(
            {"name": function["name"], "arguments": function["arguments"]},
            ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(parts)
