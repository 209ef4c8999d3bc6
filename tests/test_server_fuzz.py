"""Property-based fuzzing of request bodies against a live server: never a 5xx, always a well-formed answer,
and the server healthy (no leaked KV) afterwards."""

from __future__ import annotations

import http.client
import json
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from test_server import LLM, LiveServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)

VOCAB = 129280

json_scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12)
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


# max_tokens stays tiny: a fuzzed request must not generate thousands of tokens on CPU
token_ids = st.lists(st.integers(0, VOCAB + 5), min_size=0, max_size=6)
text = st.text(max_size=24) | st.sampled_from(["", " ", "\x00", "\ud83d\ude00", "a" * 300,
                                              "<｜end▁of▁sentence｜>"])
sampling = {
    "model": st.sampled_from(["minidsa-tiny", "gpt-4", ""]),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-2, 50),
    "min_p": st.floats(0, 1),
    "n": st.integers(0, 4),
    "seed": st.integers(-5, 2**64),
    "stop": st.none() | text | st.lists(text, max_size=5),
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.just(0.0),
    "user": st.text(max_size=5),
}
completion = st.fixed_dictionaries(
    {"prompt": text | token_ids | st.lists(text, min_size=1, max_size=3) | st.lists(token_ids, min_size=1, max_size=2),
     "max_tokens": st.integers(1, 4)},
    optional={**sampling, "logprobs": st.sampled_from([0, 1, None]), "echo": st.booleans()})
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
tool_call = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "x"]), "arguments": st.sampled_from(['{"city": "Paris"}', "{}", "[1]",
                                                                                 "{oops"]) | text})},
    optional={"id": text})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
     "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)},
    optional={"name": text, "tool_calls": st.lists(tool_call, max_size=2), "tool_call_id": text,
              "reasoning_content": text})
chat_options = {
    "tools": st.just([TOOL]) | st.lists(json_value, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required",
                                    {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "nope"}}]) | json_value,
    "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"thinking": st.booleans() | json_scalar,
                                                                "enable_thinking": st.booleans()}),
    "reasoning_effort": st.sampled_from(["none", "low", "high", "bogus"]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                                        {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                                            "type": "object", "properties": {"b": {"type": "boolean"}}}}}]),
    "store": st.booleans(),
    "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
}
chat = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=0, max_size=3), "max_tokens": st.integers(1, 4)},
    optional={**sampling, **chat_options, "logprobs": st.booleans(), "top_logprobs": st.just(0)})
tokenize = st.fixed_dictionaries({}, optional={"prompt": text, "messages": st.lists(message, min_size=0, max_size=3),
                                               "tools": chat_options["tools"],
                                               "chat_template_kwargs": chat_options["chat_template_kwargs"],
                                               "add_generation_prompt": st.booleans()})


@st.composite
def mutated(draw, body: st.SearchStrategy) -> bytes:
    """A plausible body, then maybe one mutation: a field set to any JSON value, an unknown field, a field dropped.
    (max_tokens is never dropped, and only replaced by values that cannot start a long generation.)"""
    d = draw(body)
    kind = draw(st.sampled_from(["none", "none", "replace", "add", "drop"]))
    if kind == "replace":
        key = draw(st.sampled_from(sorted(d)))
        d[key] = draw(st.sampled_from([0, -1, 10**9, "4", 1.5, True, [], {}]) if key == "max_tokens" else json_value)
    elif kind == "add":
        d[draw(st.text(min_size=1, max_size=10))] = draw(json_value)
    elif kind == "drop":
        del d[draw(st.sampled_from(sorted(k for k in d if k != "max_tokens")))]
    return json.dumps(d).encode()


endpoint_body = st.one_of(
    st.tuples(st.just("/v1/completions"), mutated(completion)),
    st.tuples(st.just("/v1/chat/completions"), mutated(chat)),
    st.tuples(st.just("/tokenize"), tokenize.map(lambda d: json.dumps(d).encode())),
    st.tuples(st.just("/detokenize"),
              st.fixed_dictionaries({"tokens": token_ids}).map(lambda d: json.dumps(d).encode())),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
              st.binary(max_size=40) | json_value.map(lambda v: json.dumps(v).encode())),
)


@pytest.fixture(scope="module")
def server():
    s = LiveServer(LLM().engine)
    yield s
    s.close()


def test_fuzzed_bodies_never_5xx(server):
    seen: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(endpoint_body)
    def check(case):
        path, body = case
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except OSError as e:
            raise AssertionError(f"{path} {body!r}: {e!r}") from None
        finally:
            conn.close()
        seen[resp.status] = seen.get(resp.status, 0) + 1
        assert resp.status < 500, (resp.status, body, data)
        if resp.status >= 400:
            err = json.loads(data)["error"]
            assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        elif resp.getheader("Content-Type", "").startswith("text/event-stream"):
            assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
            events = [json.loads(line[6:]) for line in data.decode().split("\n")
                      if line.startswith("data: {")]
            assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in events)
        elif path in ("/tokenize", "/detokenize"):
            assert set(json.loads(data)) in ({"tokens", "count", "max_model_len"}, {"prompt"}), data
        else:
            out = json.loads(data)
            assert out["choices"] and all(c["finish_reason"] for c in out["choices"])

    check()
    print("fuzz statuses:", seen)
    assert seen.get(200, 0) >= 30 and seen.get(400, 0) >= 30, seen  # both valid and invalid bodies were tried
    status = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    status.request("GET", "/health")
    assert status.getresponse().status == 200
    server.assert_no_leaks()
