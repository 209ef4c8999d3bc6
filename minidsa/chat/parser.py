"""The model's output, parsed back: reasoning, content and tool calls, fed as text arrives.

`ChatOutputParser.feed(text)` takes each piece of generated text (any chunking: whole, per token, per
character) and `finish()` ends it; `reasoning`, `content` and `tool_calls` only ever grow, and the final values
do not depend on how the text was cut. Two stages:

1. Reasoning: the text up to `</think>` is reasoning when the prompt opened it (it ends with `<think>`), or when
   the output itself starts with `<think>` and the format allows that; the rest is the answer.
2. The answer: plain content, or content with tool calls written in the format's syntax (tool_choice auto),
   or JSON the grammar forced (tool_choice required / a named function) turned into tool calls.
   - DSML (DeepSeek-V3.2): `<｜DSML｜function_calls>` then `<｜DSML｜invoke name="f">` with
     `<｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>` (or a JSON object body) per call.
   - GLM: `<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`.

A call is reported (id and name) once its name is complete, then its arguments as JSON text in fragments: string
values stream as they are written, other values when complete (typed: DSML's string="false" values and GLM's
values whose schema type is not string are parsed as JSON). Arguments are always a complete JSON object once
the call ends, also when the output was cut off. Markup that does not follow the syntax (an unknown function, a
malformed tag) stays content: nothing committed is taken back, and no markup of a call that was reported leaks
into the content. Whitespace around a block of tool calls is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from minidsa.chat import dsv32
from minidsa.chat.tools import typed_value
from minidsa.common.request import ToolCall

REASONING, MAYBE_REASONING, CONTENT = "reasoning", "maybe", "content"  # how the output starts
THINK, END_THINK = "<think>", "</think>"
DSML, GLM = "dsml", "glm"  # tool-call syntaxes
NAMED, REQUIRED = "named", "required"  # tool calls as forced JSON
GLM_CALL, GLM_CALL_END = "<tool_call>", "</tool_call>"
GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
SYNTAX_MARKUP = {  # strings a syntax's parser must see in the text (a tokenizer may make them special tokens)
    DSML: (dsv32.FUNCTION_CALLS, dsv32.FUNCTION_CALLS_END, dsv32.INVOKE_END, dsv32.PARAMETER_END),
    GLM: (GLM_CALL, GLM_CALL_END, GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END),
}
_TAG_LIMIT = 1024  # a tag (or GLM name / key) longer than this is not markup
_DSML_INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"]+)"\s*>')
_DSML_PARAMETER = re.compile(r'<｜DSML｜parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>')


@dataclass(frozen=True)
class OutputSpec:
    """How to read one request's output (plain data, decided when the prompt is rendered)."""

    reasoning: str = CONTENT  # REASONING: the prompt opened <think>; MAYBE_REASONING: the output may open it
    tool_syntax: str | None = None  # DSML | GLM: tool calls written in the text; None: none are parsed
    json_tool_calls: str | None = None  # NAMED | REQUIRED: the answer is forced JSON to turn into tool calls
    named_tool: str | None = None
    tool_types: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)  # tool -> param -> types
    max_tool_calls: int | None = None  # 1 with parallel_tool_calls false: later calls are dropped
    keep_special_ids: frozenset[int] = frozenset()  # special tokens the detokeniser must keep (the markup)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (text that may still become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ChatOutputParser:
    def __init__(self, spec: OutputSpec, new_id: Callable[[], str] = new_call_id):
        self.spec = spec
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.has_reasoning = spec.reasoning == REASONING  # the output has a reasoning part (maybe empty)
        self.finished = False
        self._new_id = new_id
        self._stage = spec.reasoning
        self._buf = ""  # stage-1 text not yet decided
        self._at_start = True  # nothing of the reasoning consumed yet (a repeated <think> is skipped)
        self._degraded = False
        if spec.json_tool_calls == NAMED:
            self._answer: _Answer = _NamedJson(self)
        elif spec.json_tool_calls == REQUIRED:
            self._answer = _RequiredJson(self)
        elif spec.tool_syntax in (DSML, GLM):
            self._answer = _Markup(self, spec.tool_syntax)
        else:
            self._answer = _Plain(self)

    # -- input -----------------------------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        if self._degraded:
            self.content += text
            return
        self._buf += text
        self._advance(final=False)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._degraded:
            return
        self._advance(final=True)

    def degrade(self, text: str) -> None:
        """After a parser failure (a bug): the rest of the output, starting with `text`, is plain content."""
        self._degraded = True
        self.content += text

    # -- stage 1: reasoning ------------------------------------------------------------------------------------
    def _advance(self, final: bool) -> None:
        if self._stage == MAYBE_REASONING:
            head = self._buf.lstrip()
            if head.startswith(THINK):
                self._buf = head[len(THINK):]
                self._stage, self.has_reasoning, self._at_start = REASONING, True, False
            elif THINK.startswith(head) and not final:
                return
            else:
                self._stage = CONTENT
        if self._stage == REASONING:
            if self._at_start:
                if THINK.startswith(self._buf) and not final:
                    return
                if self._buf.startswith(THINK):
                    self._buf = self._buf[len(THINK):]
                self._at_start = False
            end = self._buf.find(END_THINK)
            if end < 0:
                keep = 0 if final else _held(self._buf, END_THINK)
                self.reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                if final:  # cut off while thinking: there is no answer
                    self._answer.feed("", final=True)
                return
            self.reasoning += self._buf[:end]
            self._buf = self._buf[end + len(END_THINK):]
            self._stage = CONTENT
        text, self._buf = self._buf, ""
        self._answer.feed(text, final)

    # -- what the answer stages report -------------------------------------------------------------------------
    def _open_call(self, name: str) -> int | None:
        """Start a tool call; None when parallel_tool_calls is off and one was made already (it is dropped)."""
        if self.spec.max_tool_calls is not None and len(self.tool_calls) >= self.spec.max_tool_calls:
            return None
        self.tool_calls.append(ToolCall(self._new_id(), name, ""))
        return len(self.tool_calls) - 1

    def _arguments(self, call: int | None, text: str) -> None:
        if call is not None and text:
            self.tool_calls[call].arguments += text

    def _known_tool(self, name: str) -> bool:
        return name in self.spec.tool_types


class _Answer:
    """Stage 2: reads the answer's text (after any reasoning) into the parser's content and tool calls."""

    def __init__(self, parser: ChatOutputParser):
        self.p = parser

    def feed(self, text: str, final: bool) -> None:
        raise NotImplementedError


class _Plain(_Answer):
    def feed(self, text: str, final: bool) -> None:
        self.p.content += text


class _NamedJson(_Answer):
    """tool_choice names a function: the answer is its arguments (JSON the grammar forced)."""

    def __init__(self, parser: ChatOutputParser):
        super().__init__(parser)
        self.call: int | None = None
        self.opened = False
        self.space = ""  # leading whitespace, before the JSON starts

    def feed(self, text: str, final: bool) -> None:
        if not self.opened:
            text = self.space + text
            body = text.lstrip()
            self.space = text[:len(text) - len(body)]
            if not body:
                if final:
                    self.p.content += self.space
                return
            self.opened = True
            self.call = self.p._open_call(self.p.spec.named_tool)
            text = body
        self.p._arguments(self.call, text)


class _RequiredJson(_Answer):
    """tool_choice "required": the answer is a JSON array of {"name", "arguments"} objects; each becomes a call as
    soon as its object is complete. An answer that is not that array stays content (none of it becomes a call)."""

    def __init__(self, parser: ChatOutputParser):
        super().__init__(parser)
        self.buf = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = self.escaped = False
        self.element_start = -1
        self.failed = False
        self.calls = 0

    def feed(self, text: str, final: bool) -> None:
        self.buf += text
        while not self.failed and self.pos < len(self.buf):
            c = self.buf[self.pos]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "[{":
                if self.depth == 0 and c != "[" or self.depth == 1 and c != "{":
                    self.failed = True
                self.depth += 1
                if self.depth == 2:
                    self.element_start = self.pos
            elif c in "]}":
                self.depth -= 1
                if self.depth == 1 and c == "}":
                    self._element(self.buf[self.element_start:self.pos + 1])
            elif self.depth == 0 and not c.isspace():
                self.failed = True
            self.pos += 1
        if final and self.calls == 0:
            self.p.content += self.buf

    def _element(self, text: str) -> None:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not self.p._known_tool(name) or not isinstance(args, dict):
            self.failed = True
            return
        self.calls += 1
        call = self.p._open_call(name)
        self.p._arguments(call, json.dumps(args, ensure_ascii=False))


class _Markup(_Answer):
    """Content with tool calls written in the DSML or GLM syntax: a state machine over a buffer of undecided text.

    Each state's step either consumes a prefix of the buffer (and reports what it means), waits for more text,
    or finds the text malformed. A block (DSML: one function_calls; GLM: one tool_call) that fails before any
    call was reported is handed back as content; one that fails later ends its open call, and the text from the
    failing element on is read again as content.
    """

    WAIT, FAIL, GO = 0, 1, 2

    def __init__(self, parser: ChatOutputParser, syntax: str):
        super().__init__(parser)
        self.syntax = syntax
        self.start = dsv32.FUNCTION_CALLS if syntax == DSML else GLM_CALL
        self.buf = ""
        self.state = "text"
        self.block_raw = ""  # what the current block consumed (handed back if it fails before a call)
        self.block_calls = 0
        self.after_block = False  # a block of calls just ended: whitespace after it is dropped too
        self.call: int | None = None  # the open call (None when dropped by max_tool_calls)
        self.call_open = False
        self.call_has_args = False
        self.tool = ""  # the open call's function
        self.key = ""  # the parameter whose value is being read
        self.value_is_string = False
        self.value_pending = ""  # a non-string value's text so far

    def feed(self, text: str, final: bool) -> None:
        self.buf += text
        while True:
            result = getattr(self, "_" + self.state)(final)
            if result == self.GO:
                continue
            if result == self.FAIL or (final and self.state != "text"):
                self._fail(final)
                continue
            return

    def _consume(self, n: int) -> str:
        taken, self.buf = self.buf[:n], self.buf[n:]
        if self.state != "text":
            self.block_raw += taken
        return taken

    def _skip_space(self) -> None:
        n = len(self.buf) - len(self.buf.lstrip())
        if n:
            self._consume(n)

    def _tag(self, opener: str, final: bool) -> str | int:
        """The complete tag at the start of the buffer that begins with `opener` (up to its '>'), or WAIT / FAIL."""
        b = self.buf
        if not b.startswith(opener):
            return self.WAIT if opener.startswith(b) and not final else self.FAIL
        end = b.find(">")
        if end < 0:
            return self.WAIT if len(b) < _TAG_LIMIT and not final else self.FAIL
        return b[:end + 1]

    def _exact(self, tag: str, final: bool) -> int:
        if self.buf.startswith(tag):
            return self.GO
        return self.WAIT if tag.startswith(self.buf) and not final else self.FAIL

    @staticmethod
    def _first(*results: int) -> int:
        """Of alternatives that did not match: wait if any could still match, else fail."""
        return _Markup.WAIT if _Markup.WAIT in results else _Markup.FAIL

    # -- reporting ---------------------------------------------------------------------------------------------
    def _open(self, name: str) -> int:
        if not self.p._known_tool(name):
            return self.FAIL
        self.call = self.p._open_call(name)
        self.call_open, self.call_has_args, self.tool = True, False, name
        self.block_calls += 1
        return self.GO

    def _begin_value(self, key: str, is_string: bool) -> None:
        self.key, self.value_is_string, self.value_pending = key, is_string, ""
        if is_string:
            self.p._arguments(self.call, self._key_prefix() + '"')

    def _key_prefix(self) -> str:
        prefix = (", " if self.call_has_args else "{") + json.dumps(self.key, ensure_ascii=False) + ": "
        self.call_has_args = True
        return prefix

    def _value_text(self, text: str) -> None:
        if self.value_is_string:
            self.p._arguments(self.call, json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self.value_pending += text

    def _end_value(self) -> None:
        if self.value_is_string:
            self.p._arguments(self.call, '"')
        else:
            types = self.p.spec.tool_types.get(self.tool, {}).get(self.key)
            value = json.dumps(typed_value(self.value_pending, types), ensure_ascii=False)
            self.p._arguments(self.call, self._key_prefix() + value)
        self.key = ""

    def _close_call(self) -> None:
        self.p._arguments(self.call, "}" if self.call_has_args else "{}")
        self.call_open = False

    def _end_block(self) -> None:
        self.after_block = self.block_calls > 0
        self.state, self.block_raw, self.block_calls = "text", "", 0

    def _fail(self, final: bool) -> None:
        if self.state == "value":  # an unterminated value (the output was cut): it ends where the text ends
            self._value_text(self.buf)
            self.buf = ""
            self._end_value()
        if self.call_open:
            if self.state == "json_body":
                self.p._arguments(self.call, "{}")
                self.call_open = False
            else:
                self._close_call()
        if self.block_calls == 0:
            self.p.content += self.block_raw
        self._end_block()

    # -- states ------------------------------------------------------------------------------------------------
    def _text(self, final: bool) -> int:
        if self.after_block:
            self.buf = self.buf.lstrip()
            if not self.buf and not final:
                return self.WAIT
            self.after_block = False
        b = self.buf
        i = b.find(self.start)
        if i >= 0:
            before = b[:i].rstrip()
            self.p.content += before
            self.buf = b[i + len(self.start):]
            self.block_raw = b[len(before):i + len(self.start)]
            self.block_calls = 0
            self.state = "block" if self.syntax == DSML else "name"
            return self.GO
        if final:
            self.p.content += b.rstrip() if self.p.tool_calls else b
            self.buf = ""
            return self.WAIT
        cut = len(b) - _held(b, self.start)
        while cut > 0 and b[cut - 1].isspace():  # whitespace that may precede a block waits
            cut -= 1
        self.p.content += b[:cut]
        self.buf = b[cut:]
        return self.WAIT

    # DSML
    def _block(self, final: bool) -> int:
        self._skip_space()
        end = self._exact(dsv32.FUNCTION_CALLS_END, final)
        if end == self.GO:
            self._consume(len(dsv32.FUNCTION_CALLS_END))
            self._end_block()
            return self.GO
        tag = self._tag(dsv32.INVOKE, final)
        if isinstance(tag, int):
            return self._first(end, tag)
        m = _DSML_INVOKE.fullmatch(tag)
        if m is None or self._open(m.group(1)) == self.FAIL:
            return self.FAIL
        self._consume(len(tag))
        self.state = "invoke"
        return self.GO

    def _invoke(self, final: bool) -> int:
        self._skip_space()
        end = self._exact(dsv32.INVOKE_END, final)
        if end == self.GO:
            self._consume(len(dsv32.INVOKE_END))
            self._close_call()
            self.state = "block"
            return self.GO
        if self.buf.startswith("{") and not self.call_has_args:
            self.state = "json_body"
            return self.GO
        tag = self._tag(dsv32.PARAMETER, final)
        if isinstance(tag, int):
            return self._first(end, tag)
        m = _DSML_PARAMETER.fullmatch(tag)
        if m is None:
            return self.FAIL
        self._consume(len(tag))
        key, string = m.group(1), m.group(2) == "true"
        types = self.p.spec.tool_types.get(self.tool, {}).get(key)
        self.state = "value"
        self._begin_value(key, string or (types is not None and types <= {"string"}))
        return self.GO

    def _json_body(self, final: bool) -> int:
        end = self.buf.find(dsv32.INVOKE_END)
        if end < 0:
            return self.WAIT
        try:
            args = json.loads(self.buf[:end])
        except json.JSONDecodeError:
            return self.FAIL
        if not isinstance(args, dict):
            return self.FAIL
        self._consume(end + len(dsv32.INVOKE_END))
        self.p._arguments(self.call, json.dumps(args, ensure_ascii=False))
        self.call_open = False
        self.state = "block"
        return self.GO

    def _value(self, final: bool) -> int:
        close = dsv32.PARAMETER_END if self.syntax == DSML else GLM_VALUE_END
        end = self.buf.find(close)
        if end < 0:
            keep = _held(self.buf, close)
            self._value_text(self._consume(len(self.buf) - keep))
            return self.WAIT
        self._value_text(self._consume(end))
        self._consume(len(close))
        self._end_value()
        self.state = "invoke" if self.syntax == DSML else "args"
        return self.GO

    # GLM
    def _name(self, final: bool) -> int:
        b = self.buf
        ends = [i for i in (b.find("<"), b.find("\n")) if i >= 0]
        if not ends:
            return self.WAIT if len(b) < _TAG_LIMIT and not final else self.FAIL
        name = b[:min(ends)].strip()
        if not name or self._open(name) == self.FAIL:
            return self.FAIL
        self._consume(min(ends))
        self.state = "args"
        return self.GO

    def _args(self, final: bool) -> int:
        self._skip_space()
        end = self._exact(GLM_CALL_END, final)
        if end == self.GO:
            self._consume(len(GLM_CALL_END))
            self._close_call()
            self._end_block()
            return self.GO
        key = self._exact(GLM_KEY, final)
        if key != self.GO:
            return self._first(end, key)
        close = self.buf.find(GLM_KEY_END)
        if close < 0:
            return self.WAIT if len(self.buf) < _TAG_LIMIT else self.FAIL
        name = self.buf[len(GLM_KEY):close].strip()
        if not name:
            return self.FAIL
        self._consume(close + len(GLM_KEY_END))
        self.key = name
        self.state = "arg_value"
        return self.GO

    def _arg_value(self, final: bool) -> int:
        self._skip_space()
        opened = self._exact(GLM_VALUE, final)
        if opened != self.GO:
            return opened
        self._consume(len(GLM_VALUE))
        types = self.p.spec.tool_types.get(self.tool, {}).get(self.key)
        self.state = "value"
        self._begin_value(self.key, types is not None and types <= {"string"})
        return self.GO

