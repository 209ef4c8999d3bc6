"""Conversations as the chat formats read them: OpenAI messages checked and normalised once.

Every format renders the same plain dicts: `role` (system / user / assistant / tool; OpenAI's "developer" is a
system message), `content` (text; content parts joined), and where present `reasoning_content`, `tool_calls`
(`{"id", "type": "function", "function": {"name", "arguments"}}` with `arguments` as JSON text of an object),
`tool_call_id` and `name`. A message a format cannot render is a `ChatFormatError` naming it.
"""

from __future__ import annotations

import json
from typing import Any

from minidsa.common.request import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatFormatError(InvalidRequest):
    """A conversation, tool list or chat option the model's chat format cannot render (HTTP 400)."""


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, None (""), or OpenAI content parts of type "text"."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}.content[{i}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                      "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatFormatError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def arguments_object(arguments: Any, where: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text, or already an object) as a dict."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise ChatFormatError(f"{where}.function.arguments must be a JSON object, got {arguments!r}")
    return arguments


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": text_of(m.get("content"), where)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise ChatFormatError(f"{where}.reasoning_content must be a string")
                msg["reasoning_content"] = reasoning
            if m.get("tool_calls"):
                msg["tool_calls"] = [_tool_call(tc, f"{where}.tool_calls[{j}]")
                                     for j, tc in enumerate(m["tool_calls"])]
        elif m.get("tool_calls"):
            raise ChatFormatError(f"{where}: only assistant messages carry tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out


def _tool_call(tc: Any, where: str) -> dict[str, Any]:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatFormatError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    args = arguments_object(fn.get("arguments", "{}"), where)
    return {"id": str(tc.get("id") or ""), "type": "function",
            "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
