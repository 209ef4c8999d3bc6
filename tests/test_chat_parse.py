"""Parsing the model's output back (minidsa.chat.parser) against hand-written completions.

Every completion is parsed whole and streamed in every chunking that matters: character by character, every
split in two, seeded random cuts, token by token and byte by byte through the engine's OutputProcessor (the
DeepSeek tokenizer's byte tokens: multi-byte characters arrive in pieces). The streamed result must equal the
whole one, every intermediate state must be a prefix of the final one (nothing is taken back), and no markup of
a reported call may ever appear in the content (the streamed content is always a prefix of the hand-checked
final one).
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from minidsa.chat.parser import (CONTENT, DSML, GLM, MAYBE_REASONING, NAMED, REASONING, REQUIRED,
                                 ChatOutputParser, OutputSpec)
from minidsa.chat.tools import parameter_types
from minidsa.engine.outputs import OutputProcessor
from minidsa.common.request import Request, SamplingParams
from minidsa.common.tokenizer import load_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": ["string", "null"]},
        "when": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "tags": {"type": "array"},
        "exact": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "now"}},
]
TYPES = parameter_types(TOOLS)

D = "｜DSML｜"


def dsml(*invokes: str) -> str:
    return f"<{D}function_calls>\n" + "\n".join(invokes) + f"\n</{D}function_calls>"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "\n".join(f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>' for k, s, v in params)
    return f'<{D}invoke name="{name}">\n{body}\n</{D}invoke>'


# (name, spec, completion, expected reasoning (None: no reasoning part), content, [(name, arguments JSON text)])
CASES = [
    ("dsml-thinking-two-calls", OutputSpec(REASONING, DSML, tool_types=TYPES),
     "The user wants weather & a search. <b>bold</b></think>Let me look these up.\n\n" + dsml(
         invoke("get_weather", ("city", "true", '北京 "north"\nline2'), ("days", "false", "3"),
                ("units", "false", "null")),
         invoke("search", ("query", "true", "a<b & </x>"), ("filters", "false", '{"lang": "en", "n": [1, 2]}'),
                ("tags", "false", '["x", "y"]'), ("exact", "false", "true"))),
     "The user wants weather & a search. <b>bold</b>", "Let me look these up.",
     [("get_weather", '{"city": "北京 \\"north\\"\\nline2", "days": 3, "units": null}'),
      ("search", '{"query": "a<b & </x>", "filters": {"lang": "en", "n": [1, 2]}, "tags": ["x", "y"], '
                 '"exact": true}')]),
    ("dsml-chat-no-args-and-json-body", OutputSpec(CONTENT, DSML, tool_types=TYPES),
     dsml(invoke("now"), f'<{D}invoke name="search">\n{{"query": "q", "exact": false}}\n</{D}invoke>'),
     None, "", [("now", "{}"), ("search", '{"query": "q", "exact": false}')]),
    ("dsml-text-that-looks-like-markup", OutputSpec(CONTENT, DSML, tool_types=TYPES),
     f"a < b, <｜DSML｜other> and <{D}function_call are plain text; so is <think> here.  ",
     None, f"a < b, <｜DSML｜other> and <{D}function_call are plain text; so is <think> here.  ", []),
    ("dsml-unknown-function-stays-content", OutputSpec(CONTENT, DSML, tool_types=TYPES),
     "Calling.\n\n" + dsml(invoke("rm_rf", ("path", "true", "/"))),
     None, "Calling.\n\n" + dsml(invoke("rm_rf", ("path", "true", "/"))), []),
    ("dsml-malformed-after-a-call", OutputSpec(CONTENT, DSML, tool_types=TYPES),
     dsml(invoke("now")).replace(f"\n</{D}function_calls>", f'\n<{D}invoke nam="x">oops'),
     None, f'<{D}invoke nam="x">oops', [("now", "{}")]),
    ("dsml-cut-off-inside-a-string", OutputSpec(CONTENT, DSML, tool_types=TYPES),
     f'Hm.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par',
     None, "Hm.", [("get_weather", '{"city": "Par"}')]),
    ("dsml-string-false-for-a-string-schema", OutputSpec(CONTENT, DSML, tool_types=TYPES),
     dsml(invoke("get_weather", ("when", "false", "2024-01-01"), ("city", "false", "Paris"))),
     None, "", [("get_weather", '{"when": "2024-01-01", "city": "Paris"}')]),
    ("dsml-one-call-only", OutputSpec(CONTENT, DSML, tool_types=TYPES, max_tool_calls=1),
     dsml(invoke("now"), invoke("search", ("query", "true", "x"))) + "\nDone.",
     None, "Done.", [("now", "{}")]),
    ("dsml-cut-off-while-thinking", OutputSpec(REASONING, DSML, tool_types=TYPES),
     "Still thinking about </thi", "Still thinking about </thi", "", []),
    ("maybe-opens-think", OutputSpec(MAYBE_REASONING, DSML, tool_types=TYPES),
     "\n<think>plan</think>\nanswer", "plan", "\nanswer", []),
    ("maybe-without-think", OutputSpec(MAYBE_REASONING),
     "  <thin but not a tag", None, "  <thin but not a tag", []),
    ("reasoning-repeated-think-tag", OutputSpec(REASONING),
     "<think>deep</think>ok", "deep", "ok", []),
    ("glm47-thinking", OutputSpec(REASONING, GLM, tool_types=TYPES),
     "I should check.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>上海</arg_value>"
     "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>search<arg_key>filters</arg_key>"
     '<arg_value>{"a": 1}</arg_value><arg_key>query</arg_key><arg_value>123</arg_value></tool_call>',
     "I should check.", "Checking.",
     [("get_weather", '{"city": "上海", "days": 2}'), ("search", '{"filters": {"a": 1}, "query": "123"}')]),
    ("glm45-newlines", OutputSpec(MAYBE_REASONING, GLM, tool_types=TYPES),
     "<think>x</think>\n<tool_call>search\n<arg_key>exact</arg_key>\n<arg_value>false</arg_value>\n"
     "<arg_key>extra</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>",
     "x", "", [("search", '{"exact": false, "extra": [1, 2]}')]),
    ("glm-unknown-tool-stays-content", OutputSpec(CONTENT, GLM, tool_types=TYPES),
     "x <tool_call>nope<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
     None, "x <tool_call>nope<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", []),
    ("glm-bad-arg-markup", OutputSpec(CONTENT, GLM, tool_types=TYPES),
     "<tool_call>now<arg_value>1</arg_value></tool_call> after",
     None, "<arg_value>1</arg_value></tool_call> after", [("now", "{}")]),
    ("named-json", OutputSpec(REASONING, json_tool_calls=NAMED, named_tool="get_weather", tool_types=TYPES),
     'think</think> \n{"city": "Paris", "days": 2}', "think", "", [("get_weather", '{"city": "Paris", "days": 2}')]),
    ("required-json", OutputSpec(CONTENT, json_tool_calls=REQUIRED, tool_types=TYPES),
     '[{"name": "get_weather", "arguments": {"city": "a]}\\"b"}}, {"name": "now", "arguments": {}}]',
     None, "", [("get_weather", '{"city": "a]}\\"b"}'), ("now", "{}")]),
    ("required-json-not-calls", OutputSpec(CONTENT, json_tool_calls=REQUIRED, tool_types=TYPES),
     '[{"name": "unknown", "arguments": {}}]', None, '[{"name": "unknown", "arguments": {}}]', []),
    ("plain", OutputSpec(), f"<{D}function_calls> is just text without tools", None,
     f"<{D}function_calls> is just text without tools", []),
]
IDS = [c[0] for c in CASES]


def parse(spec: OutputSpec, chunks: list[str], check_stream: bool = True):
    p = ChatOutputParser(spec, new_id=iter(f"call_{i}" for i in range(100)).__next__)
    states = []
    for chunk in chunks:
        p.feed(chunk)
        states.append((p.reasoning, p.content, [(c.name, c.arguments) for c in p.tool_calls]))
    p.finish()
    final = (p.reasoning if p.has_reasoning else None, p.content, [(c.name, c.arguments) for c in p.tool_calls])
    if check_stream:
        for reasoning, content, calls in states:
            assert (final[0] or "").startswith(reasoning) and final[1].startswith(content)
            assert len(calls) <= len(final[2])
            for (name, args), (fname, fargs) in zip(calls, final[2]):
                assert name == fname and fargs.startswith(args)
    return final


def expected(case):
    _, _, _, reasoning, content, calls = case
    return reasoning, content, calls


@pytest.mark.smoke
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole(case):
    assert parse(case[1], [case[2]]) == expected(case)
    for _, arguments in expected(case)[2]:
        json.loads(arguments)  # every finished call's arguments are JSON


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_chunking(case):
    _, spec, text, *_ = case
    want = expected(case)
    assert parse(spec, list(text)) == want  # character by character
    for cut in range(1, len(text)):
        assert parse(spec, [text[:cut], text[cut:]]) == want, cut
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert parse(spec, chunks) == want, cuts


def _byte_tokens(tokenizer) -> list[int]:
    """The DeepSeek tokenizer's 256 single-byte tokens (GPT-2's byte-to-character table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [tokenizer.token_to_id(chars[b]) for b in range(256)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def through_output_processor(tokenizer, spec: OutputSpec, ids: list[int], eos: int = 1):
    """The engine's path: tokens appended one at a time, text detokenised incrementally and handed to the parser."""
    outputs = OutputProcessor(lambda: tokenizer, frozenset({eos}), 10**6)
    req = Request(request_id="r", prompt_ids=[0], params=SamplingParams(max_tokens=10**5).validate())
    outputs.parse_chat(req, spec)
    req.chat._new_id = iter(f"call_{i}" for i in range(100)).__next__
    out = None
    for t in ids + [eos]:
        outputs.append_tokens(req, [t])
        out = outputs.make_output(req, [t], "")
    assert out.finished and out.finish_reason in ("stop", "tool_calls")
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_token_by_token_and_byte_by_byte(case, tokenizer):
    _, spec, text, *_ = case
    reasoning, content, calls = expected(case)
    byte_ids = _byte_tokens(tokenizer)
    for ids in (tokenizer.encode(text, add_special_tokens=False), [byte_ids[b] for b in text.encode()]):
        out = through_output_processor(tokenizer, spec, ids)
        assert out.text == text
        assert (out.reasoning_content, out.content, [(c.name, c.arguments) for c in out.tool_calls]) == \
            (reasoning, content, calls)
        assert out.finish_reason == ("tool_calls" if calls else "stop")


def test_special_markup_tokens_reach_the_parser(tokenizer, tmp_path):
    """A tokenizer whose markup tokens are special (GLM's are): decode drops special tokens, except the ones the
    request's chat format reads."""
    import shutil

    from minidsa.common.tokenizer import Tokenizer, default_tokenizer_dir

    with open(f"{default_tokenizer_dir()}/tokenizer.json", encoding="utf-8") as f:
        data = json.load(f)
    markup = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|user|>"]
    first = max(t["id"] for t in data["added_tokens"]) + 1
    data["added_tokens"] += [{"id": first + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, s in enumerate(markup)]
    with open(tmp_path / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(data, f)
    shutil.copy(f"{default_tokenizer_dir()}/tokenizer_config.json", tmp_path / "tokenizer_config.json")
    tok = Tokenizer(str(tmp_path))
    text = "Sure<tool_call>now</tool_call>"
    ids = tok.encode(text, add_special_tokens=False)
    assert first in ids and tok.decode(ids) == "Surenow"  # special: dropped by a plain decode
    keep = frozenset(tok.token_to_id(s) for s in markup[:6])
    out = through_output_processor(tok, OutputSpec(CONTENT, GLM, tool_types=TYPES, keep_special_ids=keep), ids)
    assert (out.content, [(c.name, c.arguments) for c in out.tool_calls]) == ("Sure", [("now", "{}")])
    assert tok.decode(ids + [first + 6], keep_special=keep) == text  # <|user|> is not kept


def test_parser_failure_degrades_to_content(tokenizer, monkeypatch):
    """A bug in a parser must not fail the engine step: that request's text goes on as plain content."""
    outputs = OutputProcessor(lambda: tokenizer, frozenset({1}), 10**6)
    req = Request(request_id="r", prompt_ids=[0], params=SamplingParams(max_tokens=100).validate())
    outputs.parse_chat(req, OutputSpec(CONTENT, DSML, tool_types=TYPES))
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    outputs.append_tokens(req, ids[:1])

    def broken(*_):
        raise RuntimeError("parser bug")

    monkeypatch.setattr(type(req.chat._answer), "feed", broken)
    for t in ids[1:] + [1]:
        outputs.append_tokens(req, [t])
    out = outputs.make_output(req, [], "")
    assert out.finished and out.content == "hello world" and out.tool_calls == []


def test_ids_are_unique_and_openai_shaped():
    p = ChatOutputParser(OutputSpec(CONTENT, DSML, tool_types=TYPES))
    p.feed(dsml(invoke("now"), invoke("now")))
    p.finish()
    ids = [c.id for c in p.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_whole_and_streamed_agree_on_random_mixtures():
    """Random interleavings of text, markup fragments and calls (malformed ones included): any chunking of a
    text parses exactly as the whole text does, and never raises."""
    pieces = ["Hi ", " ", "\n\n", "<", "</", f"<{D}", f"<{D}function_calls>", f"</{D}function_calls>",
              f'<{D}invoke name="now">', f'<{D}invoke name="search">', f"</{D}invoke>",
              f'<{D}parameter name="query" string="true">', f'<{D}parameter name="tags" string="false">',
              f"</{D}parameter>", "[1]", '{"a": 1}', "x", "</think>", "<think>", "<tool_call>", "search",
              "<arg_key>", "query", "</arg_key>", "<arg_value>", "v", "</arg_value>", "</tool_call>", "北京"]
    rng = random.Random(0)
    for syntax, start in itertools.product((DSML, GLM), (CONTENT, REASONING, MAYBE_REASONING)):
        spec = OutputSpec(start, syntax, tool_types=TYPES)
        for _ in range(60):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 25)))
            whole = parse(spec, [text])
            cuts = sorted(set(rng.randint(1, max(1, len(text) - 1)) for _ in range(rng.randint(1, 10))))
            chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)]) if text[a:b]]
            assert parse(spec, chunks) == whole, (text, cuts)
            assert parse(spec, list(text)) == whole, text
            for _, args in whole[2]:
                json.loads(args)
