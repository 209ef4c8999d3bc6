"""DeepSeek-V3.2's prompt encoding (the model ships no jinja template; DeepSeek publishes an encoder instead).

Written from the format DeepSeek documents in `encoding/encoding_dsv32.py` of the model repository; the strings
below are the model's prompt format and must match it token for token.

- The prompt starts with BOS; a system message is its content, followed by the tools section (when the request
  has tools) and the response-format section (when it asks for a JSON schema).
- A user turn is `<｜User｜>{content}<｜Assistant｜>` followed by `<think>` when it is the last user turn in
  thinking mode (the model thinks first), else `</think>` (chat mode, and every earlier turn).
- An assistant turn is `{reasoning}</think>` (thinking mode, after the last user turn only: earlier turns'
  reasoning is dropped), the content, its tool calls as a DSML block, then EOS.
- Tool results after an assistant's calls are grouped in `<function_results>`, one `<result>` each; the group is
  followed by `<think>` (thinking mode, after the last user turn) or `</think>`.
"""

from __future__ import annotations

import json
from typing import Any

from minidsa.chat.messages import ChatFormatError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
FUNCTION_CALLS = f"<{DSML}function_calls>"
FUNCTION_CALLS_END = f"</{DSML}function_calls>"
INVOKE = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER = f"<{DSML}parameter"
PARAMETER_END = f"</{DSML}parameter>"

_TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "{FUNCTION_CALLS}" block like the following as part of your reply to '
    "the user:\n"
    f"{FUNCTION_CALLS}\n"
    f'{INVOKE} name="$FUNCTION_NAME">\n'
    f'{PARAMETER} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_END}\n'
    "...\n"
    f"{INVOKE_END}\n"
    f'{INVOKE} name="$FUNCTION_NAME2">\n'
    "...\n"
    f"{INVOKE_END}\n"
    f"{FUNCTION_CALLS_END}\n\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and "
    'objects should use JSON format. The "string" attribute should be set to "true" for string type parameters '
    'and "false" for other types (numbers, booleans, arrays, objects).\n\n'
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a "
    "thinking block. Here is an example:\n\n"
    f"{FUNCTION_CALLS}\n"
    "...\n"
    f"{FUNCTION_CALLS_END}\n\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n\n"
    f"{THINK}...thinking about results{END_THINK}\n\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    "{functions}\n"
    "</functions>\n"
)
_RESPONSE_FORMAT_SECTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The system prompt's tools section: each OpenAI tool's `function` object as one line of JSON."""
    return _TOOLS_SECTION.replace("{functions}", "\n".join(_json(t["function"]) for t in tools))


def dsml_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant's calls as the DSML block the model writes: strings as they are, other values as JSON."""
    invokes = []
    for call in tool_calls:
        args = json.loads(call["function"]["arguments"])
        params = "\n".join(
            f'{PARAMETER} name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}{PARAMETER_END}" for key, v in args.items())
        invokes.append(f'{INVOKE} name="{call["function"]["name"]}">\n{params}\n{INVOKE_END}')
    return f"{FUNCTION_CALLS}\n" + "\n".join(invokes) + f"\n{FUNCTION_CALLS_END}"


def encode(messages: list[dict[str, Any]], *, thinking: bool, tools: list[dict[str, Any]] | None = None,
           response_schema: dict[str, Any] | None = None) -> str:
    """The prompt of a conversation (normalised messages, see chat.messages). A conversation that ends with a
    user turn or with tool results ends with the generation prompt; one that ends with an assistant turn ends
    with that turn's EOS."""
    msgs = list(messages)
    system_at = None
    shift = 0  # messages[i] of the caller is msgs[i + shift]
    if tools or response_schema is not None:
        if not msgs or msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
            shift = 1
        system_at = 0
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    out = [BOS]
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            out.append(m["content"])
            if i == system_at and tools:
                out.append("\n\n" + tools_section(tools))
            if i == system_at and response_schema is not None:
                out.append("\n\n" + _RESPONSE_FORMAT_SECTION.replace("{schema}", _json(response_schema)))
        elif role == "user":
            out.append(f"{USER}{m['content']}{ASSISTANT}")
            out.append(THINK if thinking and i == last_user else END_THINK)
        elif role == "assistant":
            if thinking and i > last_user:
                out.append(m.get("reasoning_content", "") + END_THINK)
            out.append(m["content"])
            if m.get("tool_calls"):
                out.append("\n\n" + dsml_tool_calls(m["tool_calls"]))
            out.append(EOS)
        else:  # tool
            order, calls = _tool_result_order(msgs, i, shift)
            if order == 1:
                out.append("\n\n<function_results>")
            out.append(f"\n<result>{m['content']}</result>")
            if order == calls or i + 1 == len(msgs) or msgs[i + 1]["role"] != "tool":
                out.append("\n</function_results>\n\n")
                out.append(THINK if thinking and i >= last_user else END_THINK)
    return "".join(out)


def _tool_result_order(msgs: list[dict[str, Any]], i: int, shift: int) -> tuple[int, int]:
    """(which result of its assistant's calls message i is, 1-based; how many calls that assistant made)."""
    j = i - 1
    while j >= 0 and msgs[j]["role"] == "tool":
        j -= 1
    calls = len(msgs[j].get("tool_calls") or ()) if j >= 0 and msgs[j]["role"] == "assistant" else 0
    if calls == 0:
        raise ChatFormatError(f"messages[{i - shift}]: a tool result must follow an assistant message with "
                              "tool_calls")
    if i - j > calls:
        raise ChatFormatError(f"messages[{i - shift}]: more tool results than the assistant's {calls} tool "
                              "call(s)")
    return i - j, calls
