"""Jinja chat templates (a checkpoint's own, or --chat-template FILE), rendered the way Hugging Face templates expect.

The environment follows what templates are written against (transformers' chat-template environment): a
sandbox with `trim_blocks` / `lstrip_blocks` and loop controls, a `tojson` filter that takes `ensure_ascii`,
`indent`, `separators` and `sort_keys` and does not HTML-escape, `raise_exception(message)`, `strftime_now(fmt)`,
and `{% generation %}` blocks (rendered as their body). Templates see `messages`, `tools` (OpenAI tool objects,
or None), `add_generation_prompt`, `bos_token`, `eos_token`, and every chat_template_kwargs key (e.g.
`enable_thinking`). Assistant tool calls reach them with `arguments` as an object, as GLM's and Qwen's
templates iterate it.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minidsa.chat.messages import ChatFormatError

RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators is not None else None, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised messages as templates read them: tool-call arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"],
                                                   "arguments": json.loads(tc["function"]["arguments"])}}
                               for tc in m["tool_calls"]]
        out.append(m)
    return out


def render(source: str, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
           add_generation_prompt: bool, bos_token: str, eos_token: str, variables: dict[str, Any]) -> str:
    clash = sorted(RESERVED_VARIABLES & set(variables))
    if clash:
        raise ChatFormatError(f"chat_template_kwargs cannot set {', '.join(clash)} (the request sets them)")
    try:
        return compile_template(source).render(**variables, messages=template_messages(messages), tools=tools,
                                               add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                                               eos_token=eos_token)
    except ChatFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - raise_exception, undefined fields, type errors in the template
        raise ChatFormatError(f"messages: the chat template rejected them: {type(e).__name__}: {e}") from None
