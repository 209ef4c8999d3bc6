"""Live-server tests of the OpenAI-compatible server on the embedded tiny model (CPU, 127.0.0.1 only).

One server per module: the aiohttp app runs on its own event-loop thread (AppRunner + TCPSite on port 0),
the engine on the bridge's thread, and the tests talk to it over real sockets with the `openai` client,
aiohttp and a killed subprocess. Reference outputs come from `LLM.generate` (greedy) on the same engine,
computed before the server takes it over.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import read_sse
from minidsa import LLM, SamplingParams
from minidsa.server.async_engine import AsyncEngine
from minidsa.server.app import build_app, start_server


pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "sk-test-key"
MAX_TOKENS = 8
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
CHATS = [[{"role": "user", "content": "Say something."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]]
N_CONCURRENT = 100
CONCURRENT_PROMPTS = [f"Client {i} asks about topic {i * 7 % 13}:" for i in range(N_CONCURRENT)]


class LiveServer:
    """build_app + start_server on an event loop in a background thread."""

    def __init__(self, engine, api_key: str | None = None):
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()
        self.ae = AsyncEngine(engine)
        app = build_app(self.ae, api_key, drain_timeout=5.0)
        # without aiohttp's handler cancellation (serve() turns it on) the handlers must notice gone clients
        # themselves: the disconnect tests then check the server's own detection
        self.runner, self.url = self.run(start_server(app, "127.0.0.1", 0, handler_cancellation=False))
        self.port = int(self.url.rsplit(":", 1)[1])

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_engine(self, fn):
        """fn(engine) on the engine thread, between steps (the engine is single-threaded)."""
        return self.run(self.ae.run_on_engine(fn))

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda e: e.has_unfinished()):
            assert time.monotonic() < deadline, "engine still busy"
            time.sleep(0.02)

    def assert_no_leaks(self) -> None:
        self.wait_idle()
        self.on_engine(lambda e: e.check_no_leaks())
        assert self.on_engine(lambda e: e.metrics().kv_used_tokens) == 0

    def close(self) -> None:
        self.run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def refs(llm):
    """Greedy LLM.generate outputs, taken before the server owns the engine."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    return {
        "prompts": llm.generate(PROMPTS, greedy),
        "chats": llm.chat(CHATS, greedy),
        "concurrent": llm.generate(CONCURRENT_PROMPTS, greedy),
    }


@pytest.fixture(scope="module")
def server(llm, refs):
    s = LiveServer(llm.engine, api_key=API_KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _post(server: LiveServer, path: str, body: bytes | dict, key: str | None = API_KEY) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), data


def _get(server: LiveServer, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def _assert_error(status: int, data: bytes, expected_status: int, param: str | None = "any") -> dict:
    assert status == expected_status, (status, data)
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param != "any":
        assert err["param"] == param, err
    return err



# ---------------------------------------------------------------- (1) the official openai client


def test_openai_completions_match_llm_generate(server, client, refs):
    for prompt, ref in zip(PROMPTS, refs["prompts"]):
        r = client.completions.create(model="minidsa-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

        chunks = list(client.completions.create(model="minidsa-tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == ref.text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [ref.finish_reason]
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # a batch of prompts in one request: one choice per prompt, in order
    r = client.completions.create(model="minidsa-tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [ref.text for ref in refs["prompts"]]
    assert r.usage.completion_tokens == sum(len(ref.token_ids) for ref in refs["prompts"])
    server.assert_no_leaks()


def test_openai_chat_matches_llm_generate(server, client, refs):
    for messages, ref in zip(CHATS, refs["chats"]):
        r = client.chat.completions.create(model="minidsa-tiny", messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)

        chunks = list(client.chat.completions.create(model="minidsa-tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            [ref.finish_reason]
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    server.assert_no_leaks()


def test_openai_client_models_and_logprobs(server, client, refs):
    assert [m.id for m in client.models.list().data] == ["minidsa-tiny"]
    assert client.models.retrieve("minidsa-tiny").id == "minidsa-tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    ref = refs["chats"][0]
    r = client.chat.completions.create(model="minidsa-tiny", messages=CHATS[0], max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=True)
    lps = r.choices[0].logprobs.content
    assert len(lps) == len(ref.token_ids) and all(lp.logprob <= 0 for lp in lps)
    r = client.completions.create(model="minidsa-tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == len(refs["prompts"][0].token_ids)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


# ---------------------------------------------------------------- (2) 100 concurrent streams


def test_100_concurrent_streams(server, refs):
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[str, list, dict]:
        body = {"prompt": CONCURRENT_PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with session.post(server.url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            assert resp.status == 200, await resp.text()
            events = await read_sse(resp)
        assert events[-1] == "[DONE]", events[-3:]
        chunks = events[:-1]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
                    c["choices"][0]["finish_reason"]]
        return text, finishes, chunks[-1]["usage"]

    async def health_poller(session: aiohttp.ClientSession, stop: asyncio.Event) -> list[float]:
        latencies = []
        while not stop.is_set():
            t0 = time.perf_counter()
            async with session.get(server.url + "/health") as resp:
                assert resp.status == 200
                assert (await resp.json())["status"] == "ok"
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)
        return latencies

    async def main():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=90)) as session:
            stop = asyncio.Event()
            poller = asyncio.create_task(health_poller(session, stop))
            results = await asyncio.gather(*(one(session, i) for i in range(N_CONCURRENT)))
            stop.set()
            return results, await poller

    results, latencies = asyncio.run(main())
    for (text, finishes, usage), ref in zip(results, refs["concurrent"]):
        assert text == ref.text  # no token lost or duplicated
        assert finishes == [ref.finish_reason]
        assert usage["completion_tokens"] == len(ref.token_ids)
    assert len(latencies) >= 3 and max(latencies) < 2.0, latencies
    server.assert_no_leaks()


# ---------------------------------------------------------------- (3) a client killed mid-stream


def test_killed_client_is_aborted_and_others_unaffected(server, refs):
    max_model_len = server.ae.max_model_len
    killed = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "stream_client.py"), "--url", server.url, "--api-key",
         API_KEY, "--prompt", "A very long story:", "--max-tokens", str(max_model_len - 32), "--ignore-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([killed.stdout], [], [], 30)
        assert ready and killed.stdout.read1(64), "stream_client printed nothing"
        victims = server.ae.inflight_request_ids()
        assert len(victims) == 1

        async def others():
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
                async def one(i):
                    body = {"prompt": CONCURRENT_PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                            "stream": True}
                    async with session.post(server.url + "/v1/completions", json=body) as resp:
                        events = await read_sse(resp)
                    assert events[-1] == "[DONE]"
                    return "".join(c["choices"][0]["text"] for c in events[:-1])

                tasks = [asyncio.create_task(one(i)) for i in range(4)]
                await asyncio.sleep(0.05)  # the others are in flight when the client dies
                killed.kill()
                t_kill = time.monotonic()
                while victims & server.ae.inflight_request_ids():
                    assert time.monotonic() - t_kill < 1.0, "killed client's request still running after 1 s"
                    await asyncio.sleep(0.01)
                return time.monotonic() - t_kill, await asyncio.gather(*tasks)

        abort_latency, texts = asyncio.run(others())
        assert abort_latency < 1.0
        # the engine itself no longer knows the request (abort returns False for unknown ids)
        assert server.on_engine(lambda e: [e.abort(rid) for rid in victims]) == [False]
        assert texts == [refs["concurrent"][i].text for i in range(4)]
        server.assert_no_leaks()
        assert _get(server, "/health")[0] == 200
    finally:
        killed.kill()
        killed.wait()


def test_non_streaming_client_disconnect_aborts(server):
    body = json.dumps({"prompt": "x", "max_tokens": server.ae.max_model_len - 16, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + API_KEY.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 10
    while not server.ae.inflight_request_ids():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victims = server.ae.inflight_request_ids()
    sock.close()
    t_close = time.monotonic()
    while victims & server.ae.inflight_request_ids():
        assert time.monotonic() - t_close < 1.0, "request still running 1 s after its client disconnected"
        time.sleep(0.01)
    server.assert_no_leaks()


# ---------------------------------------------------------------- bad input, auth, limits


@pytest.mark.smoke
def test_bad_requests_get_openai_style_400(server):
    ok = {"prompt": "hi", "max_tokens": 2}
    cases = [
        (b"{not json", None),
        (b"\xff\xfe", None),
        (b"[1, 2]", None),
        (json.dumps({**ok, "bogus_field": 1}).encode(), "bogus_field"),
        (json.dumps({**ok, "max_tokens": "2"}).encode(), "max_tokens"),
        (json.dumps({**ok, "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({**ok, "temperature": -1}).encode(), "temperature"),
        (json.dumps({**ok, "top_p": 0}).encode(), "top_p"),
        (json.dumps({**ok, "stream": "yes"}).encode(), "stream"),
        (json.dumps({**ok, "stream_options": {"include_usage": True, "x": 1}}).encode(), "stream_options.x"),
        (json.dumps({**ok, "prompt": [1, "a"]}).encode(), "prompt"),
        (json.dumps({**ok, "prompt": [10**10]}).encode(), "prompt[0]"),
        (json.dumps({**ok, "presence_penalty": 2.5}).encode(), "presence_penalty"),
        (json.dumps({**ok, "logit_bias": {"5": 1.0}}).encode(), "logit_bias"),
        (json.dumps({"max_tokens": 2}).encode(), "prompt"),
        (json.dumps({**ok, "prompt": ""}).encode(), "prompt"),  # the engine's own checks from here
        (json.dumps({**ok, "prompt": [129280, 5]}).encode(), "prompt"),
        (json.dumps({**ok, "stop_token_ids": [10**6]}).encode(), "stop_token_ids"),
        (json.dumps({**ok, "stop": "\ud800"}).encode(), None),  # lone surrogate via a JSON escape
    ]
    for body, param in cases:
        status, _, data = _post(server, "/v1/completions", body)
        _assert_error(status, data, 400, param if param is not None else "any")
    chat_cases = [
        ({"messages": [], "max_tokens": 2}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}], "max_tokens": 2}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "max_tokens": 2},
         None),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": []}, "tools"),
    ]
    for body, param in chat_cases:
        status, _, data = _post(server, "/v1/chat/completions", body)
        _assert_error(status, data, 400, param if param is not None else "any")
    status, _, data = _post(server, "/v1/nope", ok)
    _assert_error(status, data, 404)
    server.assert_no_leaks()


def test_prompt_longer_than_context_is_400(server):
    n = server.ae.max_model_len
    status, _, data = _post(server, "/v1/completions", {"prompt": [5] * (n + 10), "max_tokens": 1})
    assert "too long" in _assert_error(status, data, 400)["message"]
    status, _, data = _post(server, "/v1/completions", {"prompt": [5] * (n - 4), "max_tokens": 8})
    assert "max_model_len" in _assert_error(status, data, 400)["message"]
    # chat with no max_tokens: generation may use the rest of the context, a prompt that fills it cannot run
    long_chat = [{"role": "user", "content": "word " * n}]
    status, _, data = _post(server, "/v1/chat/completions", {"messages": long_chat})
    _assert_error(status, data, 400)
    server.assert_no_leaks()


def test_api_key_required(server):
    for key in (None, "wrong-key"):
        status, _, data = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
        assert _assert_error(status, data, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    assert _get(server, "/health")[0] == 200  # health and metrics stay open


def test_queue_full_is_503_with_retry_after(refs):
    small = LiveServer(LLM(max_queued_requests=1).engine)
    try:
        async def main():
            async with aiohttp.ClientSession() as session:
                async def one(i):
                    body = {"prompt": CONCURRENT_PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0}
                    async with session.post(small.url + "/v1/completions", json=body) as resp:
                        return resp.status, resp.headers.get("Retry-After"), await resp.json()
                return await asyncio.gather(*(one(i) for i in range(6)))

        results = asyncio.run(main())
        full = [r for r in results if r[0] == 503]
        served = [(i, r) for i, r in enumerate(results) if r[0] == 200]
        assert full and served, [r[0] for r in results]
        assert all(r[1] == "1" and r[2]["error"]["code"] == "queue_full" for r in full)
        for i, r in served:
            assert r[2]["choices"][0]["text"] == refs["concurrent"][i].text
        small.assert_no_leaks()
    finally:
        small.close()


# ---------------------------------------------------------------- (5) metrics


def _scrape(server: LiveServer) -> dict[str, dict[tuple, float]]:
    status, data = _get(server, "/metrics")
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(data.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _value(metrics: dict, name: str, **labels) -> float:
    return sum(v for key, v in metrics.get(name, {}).items() if set(labels.items()) <= set(key))


def test_metrics_parse_and_move(server, client):
    before = _scrape(server)
    for name in ("minidsa_num_requests_running", "minidsa_num_requests_waiting", "minidsa_kv_cache_usage_ratio",
                 "minidsa_generation_tokens_total", "minidsa_prompt_tokens_total",
                 "minidsa_generation_tokens_per_second", "minidsa_time_to_first_token_seconds_bucket",
                 "minidsa_inter_token_latency_seconds_count", "minidsa_spec_decode_accepted_tokens_total",
                 "minidsa_spec_decode_draft_tokens_total"):
        assert name in before, name
    r = client.completions.create(model="minidsa-tiny", prompt="metrics please", max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS
    after = _scrape(server)
    gen = "minidsa_generation_tokens_total"
    assert _value(after, gen) - _value(before, gen) == MAX_TOKENS
    assert _value(after, "minidsa_prompt_tokens_total") - _value(before, "minidsa_prompt_tokens_total") == \
        r.usage.prompt_tokens
    assert _value(after, "minidsa_time_to_first_token_seconds_count") == \
        _value(before, "minidsa_time_to_first_token_seconds_count") + 1
    assert _value(after, "minidsa_inter_token_latency_seconds_count") == \
        _value(before, "minidsa_inter_token_latency_seconds_count") + MAX_TOKENS - 1
    assert _value(after, "minidsa_time_to_first_token_seconds_bucket", le="+Inf") == \
        _value(after, "minidsa_time_to_first_token_seconds_count")
    assert _value(after, "minidsa_generation_tokens_per_second") > 0
    assert _value(after, "minidsa_http_responses_total", route="/v1/completions", status="200") == \
        _value(before, "minidsa_http_responses_total", route="/v1/completions", status="200") + 1
    assert _value(after, "minidsa_kv_cache_total_tokens") > 0


# ---------------------------------------------------------------- SIGTERM


def test_sigterm_gives_every_stream_a_final_event():
    code = ("from minidsa.config import EngineConfig\nfrom minidsa.server import serve\n"
            "serve(EngineConfig(), '127.0.0.1', 0, drain_timeout=1.0)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.strip().rsplit(" ", 1)[1]

        async def main():
            async with aiohttp.ClientSession() as session:
                async def short():  # finishes inside the drain window
                    body = {"prompt": "short", "max_tokens": 4, "temperature": 0, "stream": True}
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        return await read_sse(resp)

                body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    first = await resp.content.readline()
                    assert first.startswith(b"data: ")
                    short_task = asyncio.create_task(short())
                    await asyncio.sleep(0.1)
                    proc.send_signal(signal.SIGTERM)
                    long_events = await read_sse(resp)
                return long_events, await short_task

        long_events, short_events = asyncio.run(main())
        assert long_events[-1] == "[DONE]" and long_events[-2]["choices"][0]["finish_reason"] == "abort"
        assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait()


def test_engine_step_error_ends_requests_and_server_recovers(server, refs):
    def break_next_step(engine):
        real_step = engine.step

        def failing_step():
            engine.step = real_step  # fail once, then behave
            raise RuntimeError("injected step failure")

        engine.step = failing_step

    server.on_engine(break_next_step)
    status, _, data = _post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
    err = _assert_error(status, data, 500)
    assert err["code"] == "engine_error" and "injected step failure" in err["message"]

    server.wait_idle()  # the engine reports the aborted request in one more step: let that step run unbroken
    server.on_engine(break_next_step)

    async def stream():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "stream": True}
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                return await read_sse(resp)

    events = asyncio.run(stream())
    assert events[-1] == "[DONE]" and "injected step failure" in events[-2]["error"]["message"]
    assert [c["choices"][0]["finish_reason"] for c in events[:-2] if c["choices"][0]["finish_reason"]] == ["abort"]
    server.assert_no_leaks()
    status, _, data = _post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                        "temperature": 0})
    assert status == 200 and json.loads(data)["choices"][0]["text"] == refs["prompts"][0].text
    assert _get(server, "/health")[0] == 200
