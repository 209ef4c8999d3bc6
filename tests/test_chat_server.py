"""Chat through the server on tiny checkpoints of both families (CPU, 127.0.0.1): a DeepSeek-V3.2 checkpoint
without a chat template (DeepSeek's encoding) and a GLM-5 checkpoint with a GLM-style template
(tests/chat_checkpoints.py), both with the DeepSeek tokenizer.

Random weights never write tool calls, so the answers of the round trips are scripted: the worker's sampled
tokens are replaced by a hand-written completion's (chat_checkpoints.ScriptedCompletions); the prompt, the
engine, the output parsing and the HTTP layer are all the real ones. The tests at the end need the grammar
(structured outputs): there the random model writes the answer, constrained to JSON.
"""

from __future__ import annotations

import json
import logging

import jsonschema
import openai
import pytest
from chat_checkpoints import ScriptedCompletions, dsv32_checkpoint, glm5_checkpoint
from test_server import LiveServer, _assert_error, _post

from minidsa import LLM
from minidsa.chat.formats import DeepSeekV32Format, TemplateFormat

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
D = "｜DSML｜"


class Family:
    def __init__(self, path: str):
        self.path = path
        self.llm = LLM(model=path, device="cpu", dtype="float32", progress=False, max_total_tokens=16384)
        self.script = ScriptedCompletions(self.llm.engine)
        self.server = LiveServer(self.llm.engine)
        self.model = self.server.ae.model_name

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    f = Family(dsv32_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-dsv32")))
    yield f
    f.close()


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    f = Family(glm5_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-glm5")))
    yield f
    f.close()


def post(f: Family, path: str, body: dict) -> dict:
    status, _, data = _post(f.server, path, body, key=None)
    assert status == 200, data
    return json.loads(data)


def stream_events(f: Family, body: dict) -> list[dict]:
    status, _, data = _post(f.server, "/v1/chat/completions", {**body, "stream": True}, key=None)
    assert status == 200, data
    assert data.endswith(b"data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: {")]


def assemble(events: list[dict]) -> dict:
    """A streamed answer put together, checking it is streamed as OpenAI does: per call, a first delta with its
    id, type and name and empty arguments, then argument fragments only."""
    msg = {"reasoning_content": "", "content": "", "tool_calls": []}
    finish = []
    for e in events:
        for ch in e["choices"]:
            d = ch["delta"]
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            msg["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                i = tc["index"]
                if i == len(msg["tool_calls"]):
                    assert tc["id"].startswith("call_") and tc["type"] == "function", tc
                    assert tc["function"]["name"] and tc["function"]["arguments"] == "", tc
                    msg["tool_calls"].append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                    msg["tool_calls"][i]["arguments"] += tc["function"]["arguments"]
            if ch["finish_reason"]:
                finish.append(ch["finish_reason"])
    assert len(finish) == 1, finish
    msg["finish_reason"] = finish[0]
    return msg


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


def tokenize(f: Family, body: dict) -> list[int]:
    out = post(f, "/tokenize", body)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == f.server.ae.max_model_len
    return out["tokens"]


def round_trip(f: Family, messages: list[dict], extra: dict, completion: str, want_reasoning: str | None,
               want_content: str | None, want_calls: list[tuple[str, dict]]) -> dict:
    """The same scripted answer non-streamed, through the openai client, and streamed: the same message each time;
    the prompt the engine got is what /tokenize says."""
    body = {"model": f.model, "messages": messages, "max_tokens": 200, **extra}
    f.script.queue(completion)
    out = post(f, "/v1/chat/completions", body)
    rid = list(f.script.prompts)[-1]
    assert f.script.prompts[rid] == tokenize(f, {k: v for k, v in body.items() if k != "max_tokens"})
    msg = out["choices"][0]["message"]
    assert msg.get("reasoning_content") == want_reasoning and msg["content"] == want_content
    assert calls_of(msg) == want_calls
    assert out["choices"][0]["finish_reason"] == ("tool_calls" if want_calls else "stop")
    assert out["usage"]["prompt_tokens"] == len(f.script.prompts[rid])

    f.script.queue(completion)
    client = openai.OpenAI(base_url=f.server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    sdk = client.chat.completions.create(**{k: v for k, v in body.items() if k != "chat_template_kwargs"},
                                         extra_body={"chat_template_kwargs": body.get("chat_template_kwargs", {})})
    m = sdk.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []] == want_calls
    assert m.content == want_content and getattr(m, "reasoning_content", None) == want_reasoning

    f.script.queue(completion)
    streamed = assemble(stream_events(f, body))
    assert streamed["reasoning_content"] == (want_reasoning or "")
    assert streamed["content"] == (want_content or "")
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    assert streamed["finish_reason"] == out["choices"][0]["finish_reason"]
    f.server.assert_no_leaks()
    return msg


# -- DeepSeek-V3.2 ---------------------------------------------------------------------------------------------

def test_dsv32_checkpoint_without_template_chats_through_deepseeks_encoding(ds):
    assert isinstance(ds.llm.chat_format, DeepSeekV32Format)
    tok = ds.llm.tokenizer
    hi = [{"role": "user", "content": "Hi"}]
    ids = tokenize(ds, {"messages": hi})
    bos = "<｜begin▁of▁sentence｜>"
    assert tok.decode(ids, skip_special_tokens=False) == f"{bos}<｜User｜>Hi<｜Assistant｜></think>"
    assert ids == ds.llm.chat_prompt(hi) and ids[0] == 0  # BOS is the special token, not its text
    thinking = tokenize(ds, {"messages": hi, "tools": [WEATHER], "chat_template_kwargs": {"thinking": True}})
    text = tok.decode(thinking, skip_special_tokens=False)
    assert text.startswith(f"{bos}\n\n## Tools\n") and text.endswith("Hi<｜Assistant｜><think>")
    assert tokenize(ds, {"prompt": "Hello there"}) == tok.encode("Hello there")
    assert post(ds, "/detokenize", {"tokens": ids})["prompt"] == tok.decode(ids, skip_special_tokens=False)
    # a chat without tools answers as before: the content is the text
    ds.script.queue("Hello! 你好")
    out = post(ds, "/v1/chat/completions", {"messages": hi, "max_tokens": 20})
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hello! 你好"}


def test_chat_template_flag_overrides_deepseeks_encoding(ds, tmp_path):
    from minidsa.config import ConfigError

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<bot>")
    llm = LLM(model=ds.path, device="cpu", dtype="float32", progress=False, max_total_tokens=1024,
              chat_template=str(template))
    assert isinstance(llm.chat_format, TemplateFormat) and llm.chat_format.origin == f"--chat-template {template}"
    ids = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    assert llm.tokenizer.decode(ids) == "<user>Hi<bot>"
    out = llm.chat([{"role": "user", "content": "Hi"}], None)
    assert out.prompt_token_ids == ids and out.content == out.text
    with pytest.raises(ConfigError, match="chat_template"):
        LLM(model=ds.path, device="cpu", chat_template=str(tmp_path / "missing.jinja"))


def test_dsv32_tool_round_trip_thinking(ds):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and 北京?"}]
    extra = {"tools": [WEATHER], "chat_template_kwargs": {"thinking": True}}
    calls = (f"\n\n<{D}function_calls>\n"
             f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
             f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">北京 "north"</{D}parameter>\n'
             f"</{D}invoke>\n</{D}function_calls>")
    msg = round_trip(ds, messages, extra, "Two cities: two calls.</think>Checking." + calls,
                     "Two cities: two calls.", "Checking.",
                     [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": '北京 "north"'})])
    # the answer goes back with the results: DeepSeek's encoding renders the calls and groups the results
    follow = messages + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "sunny"},
                         {"role": "tool", "tool_call_id": msg["tool_calls"][1]["id"], "content": "rain"}]
    prompt = ds.llm.tokenizer.decode(tokenize(ds, {"messages": follow, **extra}), skip_special_tokens=False)
    assert prompt.endswith("<think>Two cities: two calls.</think>Checking." + calls + "<｜end▁of▁sentence｜>\n\n"
                           "<function_results>\n<result>sunny</result>\n<result>rain</result>\n</function_results>"
                           "\n\n<think>")
    round_trip(ds, follow, extra, "Both known.</think>Paris: sunny. 北京: rain.", "Both known.",
               "Paris: sunny. 北京: rain.", [])


def test_dsv32_markup_written_wrongly_stays_content(ds):
    wrong = f'Sure.\n\n<{D}function_calls>\n<{D}invoke name="delete_everything">\n</{D}invoke>\n</{D}function_calls>'
    round_trip(ds, [{"role": "user", "content": "x"}], {"tools": [WEATHER]}, wrong, None, wrong, [])
    cut = f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">1'
    ds.script.queue(cut)
    out = post(ds, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                           "max_tokens": 200})
    assert calls_of(out["choices"][0]["message"]) == [("get_weather", {"days": 1})]  # closed JSON, never a 500


def test_bad_fields_are_400_and_harmless_ones_are_ignored(ds, caplog):
    ok = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    tool = {"tools": [WEATHER]}
    cases = [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({**tool, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({**tool, "tool_choice": "sometimes"}, "tool_choice"),
        ({**tool, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"type": "function", "function": {"name": "f"}}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages"),
    ]
    for extra, param in cases:
        status, _, data = _post(ds.server, "/v1/chat/completions", {**ok, **extra}, key=None)
        _assert_error(status, data, 400, param)
    for extra, param in (({"audio": {"voice": "x"}}, "audio"), ({"modalities": ["text", "audio"]}, "modalities"),
                         ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"),
                         ({"verbosity": "low"}, "verbosity"), ({"web_search_options": {}}, "web_search_options")):
        status, _, data = _post(ds.server, "/v1/chat/completions", {**ok, **extra}, key=None)
        err = _assert_error(status, data, 400, param)
        assert err["code"] == "unsupported_parameter" and err["message"].startswith(f"'{param}' is not supported")
    for path, body in (("/tokenize", {"messages": ok["messages"], "prompt": "x"}), ("/tokenize", {}),
                       ("/detokenize", {"tokens": [10**7]}), ("/tokenize", {"prompt": "x", "bogus": 1})):
        status, _, data = _post(ds.server, path, body, key=None)
        _assert_error(status, data, 400)
    harmless = {"store": True, "metadata": {"k": "v"}, "user": "u", "service_tier": "auto", "prompt_cache_key": "p",
                "safety_identifier": "s", "parallel_tool_calls": False,
                "prediction": {"type": "content", "content": "x"},
                "stream_options": {"include_obfuscation": False}, "response_format": {"type": "text"},
                "verbosity": "medium", "modalities": ["text"], "tool_choice": "none", "reasoning_effort": "none"}
    caplog.set_level(logging.DEBUG, logger="minidsa.server.protocol")
    post(ds, "/v1/chat/completions", {**ok, **harmless, "messages": [
        {"role": "developer", "content": "d"}, {"role": "user", "content": "x"},
        {"role": "assistant", "content": "a", "refusal": None, "reasoning": "r"}, {"role": "user", "content": "y"}]})
    assert "ignoring request fields that change nothing here: user, store, metadata, service_tier" in caplog.text
    post(ds, "/v1/completions", {"prompt": "x", "max_tokens": 2, "store": True, "metadata": {},
                                 "response_format": {"type": "text"}})
    ds.server.assert_no_leaks()


# -- GLM-5 -------------------------------------------------------------------------------------------------------

def test_glm5_checkpoint_tool_round_trip(glm):
    assert isinstance(glm.llm.chat_format, TemplateFormat) and glm.llm.chat_format.tool_syntax == "glm"
    messages = [{"role": "user", "content": "Weather in 北京 for 3 days?"}]
    extra = {"tools": [WEATHER]}  # GLM-5 thinks by default
    completion = ("Use the tool.</think>On it.<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京"
                  "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
    msg = round_trip(glm, messages, extra, completion, "Use the tool.", "On it.",
                     [("get_weather", {"city": "北京", "days": 3})])
    follow = messages + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "sunny"}]
    prompt = glm.llm.tokenizer.decode(tokenize(glm, {"messages": follow, **extra}), skip_special_tokens=False)
    assert prompt.endswith("<|assistant|><think>Use the tool.</think>On it.<tool_call>get_weather<arg_key>city"
                           "</arg_key><arg_value>北京</arg_value><arg_key>days</arg_key><arg_value>3</arg_value>"
                           "</tool_call><|observation|><tool_response>sunny</tool_response><|assistant|><think>")
    round_trip(glm, follow, extra, "Sunny.</think>It is sunny in 北京.", "Sunny.", "It is sunny in 北京.", [])
    # thinking off: the prompt closes the thinking, the answer is all content
    round_trip(glm, messages, {**extra, "chat_template_kwargs": {"enable_thinking": False}},
               "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", None, None,
               [("get_weather", {"city": "Paris"})])


# -- structured outputs: need the grammar (SamplingParams.response_format in the engine) ---------------------------

CITY = {"type": "function", "function": {"name": "pick_city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "北京", "Lima"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}
FLAG = {"type": "function", "function": {"name": "set_flag", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_on_random_weights(ds, stream):
    """tool_choice named / required: the random model's answer is valid calls only because of the grammar."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, FLAG)}
    for choice in ({"type": "function", "function": {"name": "pick_city"}}, "required"):
        body = {"messages": [{"role": "user", "content": "Pick."}], "tools": [CITY, FLAG], "tool_choice": choice,
                "max_tokens": 256, "temperature": 0.8, "seed": 3}
        if stream:
            msg = assemble(stream_events(ds, body))
            calls = [(c["name"], json.loads(c["arguments"])) for c in msg["tool_calls"]]
        else:
            out = post(ds, "/v1/chat/completions", body)
            msg = out["choices"][0]["message"]
            calls = calls_of(msg)
            assert out["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] is None
        assert calls and (choice == "required" or [name for name, _ in calls] == ["pick_city"])
        for name, args in calls:
            jsonschema.validate(args, schemas[name])
    ds.server.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer_on_random_weights(ds, stream):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                                               "n": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3}},
              "required": ["ok", "color", "n"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 256, "temperature": 0.8,
            "seed": 5, "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                                  "strict": True}}}
    content = assemble(stream_events(ds, body))["content"] if stream else \
        post(ds, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), schema)
