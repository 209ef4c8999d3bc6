"""Tools: the request's tool list and tool_choice checked, the JSON schema that forces a call, and the JSON type
a parameter's schema gives its value.

`tool_choice` "required" and a named function are served with structured output: the answer is constrained to
JSON (the named function's arguments; for "required" an array of `{"name", "arguments"}` objects over the
tools, vLLM's shape) and the parser turns that JSON into tool calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from minidsa.chat.messages import ChatFormatError

AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # auto | none | required | named
    name: str | None = None  # the function, when named


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI tools ({"type": "function", "function": {"name", "description", "parameters"}}), names unique."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatFormatError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    seen = set()
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatFormatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c.isspace() or c in '<>"' for c in name):
            raise ChatFormatError(f"tools[{i}].function.name must be a non-empty name without spaces, quotes or "
                                  f"angle brackets, got {name!r}")
        if name in seen:
            raise ChatFormatError(f"tools[{i}].function.name {name!r} is used by two tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ChatFormatError(f"tools[{i}].function.parameters must be a JSON schema object")
        seen.add(name)
        out.append(tool)
    return out or None


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    if choice is None:
        choice = AUTO
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ChatFormatError("tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}")
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise ChatFormatError(f"tool_choice names the function {name!r}, which is not in tools")
        return ToolChoice(NAMED, name)
    if choice not in (AUTO, NONE, REQUIRED):
        raise ChatFormatError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}")
    if choice == REQUIRED and not tools:
        raise ChatFormatError("tool_choice 'required' needs tools")
    return ToolChoice(choice)


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_call_response_format(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
    """The response_format (OpenAI shape) that makes the answer the JSON of a forced call."""
    by_name = {t["function"]["name"]: t for t in tools}
    if choice.mode == NAMED:
        schema = parameters_schema(by_name[choice.name])
        name = choice.name
    else:
        call = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [name]}, "arguments": parameters_schema(tool)},
                 "required": ["name", "arguments"]} for name, tool in by_name.items()]
        schema = {"type": "array", "minItems": 1, "items": call[0] if len(call) == 1 else {"anyOf": call}}
        if not parallel:
            schema["maxItems"] = 1
        name = "tool_calls"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def parameter_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, frozenset[str]]]:
    """tool -> parameter -> the JSON types its schema allows (parameters without a plain `type` are left out)."""
    out: dict[str, dict[str, frozenset[str]]] = {}
    for tool in tools or ():
        props = parameters_schema(tool).get("properties")
        types: dict[str, frozenset[str]] = {}
        if isinstance(props, dict):
            for key, schema in props.items():
                t = schema.get("type") if isinstance(schema, dict) else None
                if isinstance(t, str):
                    types[key] = frozenset([t])
                elif isinstance(t, list) and all(isinstance(x, str) for x in t):
                    types[key] = frozenset(t)
        out[tool["function"]["name"]] = types
    return out


def typed_value(raw: str, types: frozenset[str] | None) -> Any:
    """A parameter value the model wrote as text (DSML string="false", a GLM arg_value): JSON if it parses and the
    schema does not make it a string, else the text itself."""
    if types is not None and types <= {"string"}:
        return raw
    try:
        return json.loads(raw.strip())
    except (json.JSONDecodeError, ValueError):
        return raw
