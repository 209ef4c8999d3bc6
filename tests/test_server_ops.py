"""The operator's view of the server: OpenAI parameters evaluation clients send (echo, logprobs, top_logprobs,
penalties), --served-model-name, one log line per request, shutdown with --shutdown-timeout, and the online
benchmark driving a live server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import openai
import pytest
import torch

from minidsa import LLM, cli
from minidsa.server.async_engine import AsyncEngine
from minidsa.server.app import build_app, start_server
from test_openai_params import model_logits
from test_server import LiveServer, _assert_error, _post, _read_sse

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "served-as-this"
PROMPT_IDS = [5, 17, 923, 4021, 77, 1500, 2600, 31, 8, 9000, 12, 13]


class NamedServer(LiveServer):
    """LiveServer whose engine is served under --served-model-name NAME."""

    def __init__(self, engine):
        self.engine = engine
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ae = AsyncEngine(engine, model_name=NAME)
        self.runner, self.url = self.run(start_server(build_app(self.ae, drain_timeout=5.0), "127.0.0.1", 0))
        self.port = int(self.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def llm():
    return LLM(progress=False)


@pytest.fixture(scope="module")
def prompt_ref(llm):
    """The model's own log-probabilities of PROMPT_IDS (before the server owns the engine)."""
    return torch.log_softmax(model_logits(llm, PROMPT_IDS), dim=-1)


@pytest.fixture(scope="module")
def server(llm, prompt_ref):
    s = NamedServer(llm.engine)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _check_prompt_logprobs(lp: dict, ref: torch.Tensor, tokenizer) -> None:
    n = len(PROMPT_IDS)
    assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in PROMPT_IDS]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        assert lp["token_logprobs"][p] == pytest.approx(ref[p - 1, PROMPT_IDS[p]].item(), abs=1e-4)
        (best_token, best), = lp["top_logprobs"][p].items()
        assert best == pytest.approx(ref[p - 1].max().item(), abs=1e-4)
        assert best_token == tokenizer.decode([int(ref[p - 1].argmax())])
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]


def test_echo_logprobs_score_the_prompt_like_lm_eval(server, llm, prompt_ref):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 0 (and 1)."""
    tok = llm.engine.tokenizer
    text = tok.decode(PROMPT_IDS)
    status, _, data = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT_IDS, "echo": True,
                                                        "logprobs": 1, "max_tokens": 0, "temperature": 0})
    assert status == 200, data
    body = json.loads(data)
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert len(choice["logprobs"]["tokens"]) == len(PROMPT_IDS)
    _check_prompt_logprobs(choice["logprobs"], prompt_ref, tok)

    status, _, data = _post(server, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "logprobs": 1,
                                                        "max_tokens": 1, "temperature": 0})
    choice = json.loads(data)["choices"][0]
    assert status == 200 and choice["text"].startswith(text) and len(choice["text"]) > len(text)
    lp = choice["logprobs"]
    _check_prompt_logprobs(lp, prompt_ref, tok)
    assert len(lp["tokens"]) == len(PROMPT_IDS) + 1  # the generated token follows, greedy = the likeliest
    assert lp["token_logprobs"][-1] == pytest.approx(prompt_ref[-1].max().item(), abs=1e-4)

    async def streamed():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": PROMPT_IDS, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
                    "stream": True}
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                return await _read_sse(resp)

    events = asyncio.run(streamed())
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"].startswith(text)
    _check_prompt_logprobs(chunks[0]["logprobs"], prompt_ref, tok)
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == len(PROMPT_IDS) + 3
    server.assert_no_leaks()


def test_top_logprobs_chat_and_completions(server, client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    for item in r.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.top_logprobs[2].logprob
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0.9, seed=1, logprobs=5)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 5 and value <= max(top.values()) + 1e-6  # sampled: not always the likeliest
    server.assert_no_leaks()


def test_penalties_served_and_unsupported_refused_alike(server, client):
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0, presence_penalty=1.0,
                                  frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2, "ignore_eos": True})
    assert r.usage.completion_tokens == 6
    ok = {"prompt": "hi", "max_tokens": 2}
    messages = []
    for path, body, param in (("/v1/completions", {**ok, "logprobs": 21}, "logprobs"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        "logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        status, _, data = _post(server, path, body)
        messages.append(_assert_error(status, data, 400, param)["message"].replace(param, "NAME"))
    assert messages[0] == messages[1] and "[0, 20]" in messages[0]
    codes = set()
    for body, param in (({**ok, "logit_bias": {"5": 1}}, "logit_bias"), ({**ok, "suffix": "x"}, "suffix"),
                        ({**ok, "best_of": 3}, "best_of")):
        status, _, data = _post(server, "/v1/completions", body)
        err = _assert_error(status, data, 400, param)
        codes.add(err["code"])
        assert err["message"].startswith(f"'{param}' is not supported")
    assert codes == {"unsupported_parameter"}
    status, _, data = _post(server, "/v1/completions", {**ok, "max_tokens": 0})  # 0 only with echo
    _assert_error(status, data, 400, "max_tokens")
    server.assert_no_leaks()


def test_served_model_name(server, client, llm):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.completions.create(model=NAME, prompt="x", max_tokens=1).model == NAME
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=llm.engine.model_name, prompt="x", max_tokens=1)


def test_one_log_line_per_finished_or_aborted_request(server, client, caplog):
    with caplog.at_level(logging.INFO, logger="minidsa.server.async_engine"):
        r = client.completions.create(model=NAME, prompt=PROMPT_IDS, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # a client that leaves
            body = json.dumps({"prompt": "bye", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            received = b""
            while b"data: " not in received and len(received) < 1 << 20:  # headers first, then the first event
                received += sock.recv(65536)
            assert b"data: " in received
        deadline = time.monotonic() + 30
        while not any("aborted" in m for m in caplog.messages) and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [m for m in caplog.messages if m.startswith("request ")]
    finished = [m for m in lines if r.id in m]
    assert len(finished) == 1, lines
    assert f"finished: {len(PROMPT_IDS)} prompt tokens, 5 output tokens, TTFT " in finished[0]
    assert "finish_reason length" in finished[0] and "duration " in finished[0]
    aborted = [m for m in lines if "aborted" in m]
    assert len(aborted) == 1 and "finish_reason abort" in aborted[0], lines
    server.assert_no_leaks()


def test_bench_base_url_against_a_live_server(server, tmp_path, capsys):
    out = tmp_path / "online.json"
    rc = cli.main(["bench", "--base-url", server.url, "--num-requests", "6", "--input-len", "8-24",
                   "--output-len", "3-6", "--request-rate", "40", "--max-concurrency", "3", "--no-progress",
                   "--goodput", "ttft:60000", "e2el:60000", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    for label in ("TTFT", "ITL", "TPOT", "E2E", "goodput", server.url):
        assert label in text
    result = json.loads(out.read_text())
    r = result["results"]
    assert result["model"] == NAME and result["workload"]["request_rate"] == 40.0
    assert r["completed"] == 6 and r["failed"] == 0
    assert 6 * 3 <= r["output_tokens"] <= 6 * 6  # from the server's usage report
    for key in ("ttft_s", "e2e_s"):
        assert 0 < r[key]["p50"] <= r[key]["p99"]
    assert r["goodput"]["requests_meeting_slo"] == 6
    starts = sorted(t for t, _, _ in r["timeline"])
    assert starts and starts[-1] > 0
    server.assert_no_leaks()


def test_bench_in_process_server_with_poisson_arrivals():
    from minidsa.bench.online import arrival_times, run_online_bench
    from minidsa.config import EngineConfig

    times = arrival_times(200, 50.0, 0)
    assert times[0] == 0 and all(b > a for a, b in zip(times, times[1:]))
    assert 2.0 < times[-1] < 6.0  # mean gap 1/50 s
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    result = run_online_bench(EngineConfig(device="cpu", max_total_tokens=4096), num_requests=4,
                              input_len=(8, 16), output_len=(2, 4), request_rate=float("inf"), max_concurrency=2,
                              progress=False)
    r = result["results"]
    assert r["completed"] == 4 and result["workload"]["max_concurrency"] == 2
    assert r["ttft_s"]["p99"] >= r["ttft_s"]["p50"] > 0


def _serve_process(*args: str) -> tuple[subprocess.Popen, str]:
    """`python -m minidsa serve --port 0 ARGS` (the tiny model) started and listening -> (process, base url)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "minidsa", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        raise AssertionError((line, proc.communicate()[1]))
    return proc, line.strip().rsplit(" ", 1)[1]


def test_shutdown_drains_answers_503_and_second_signal_aborts():
    """serve --shutdown-timeout 60: SIGTERM starts draining (the stream keeps going, new requests get 503),
    a second SIGTERM aborts the stream (finish_reason abort) and the process exits at once."""
    proc, url = _serve_process("--shutdown-timeout", "60")
    try:

        async def main():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.content.readline()).startswith(b"data: ")
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.sleep(1.0)
                    async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as late:
                        late_status, late_body = late.status, await late.json()
                    assert proc.poll() is None  # still draining: the 60 s are not up
                    second = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                    events = await _read_sse(resp)
                    return late_status, late_body, events, time.monotonic() - second

        late_status, late_body, events, took = asyncio.run(main())
        assert late_status == 503 and "shutting down" in late_body["error"]["message"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
        assert took < 20
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "shutting down" in err and "aborting" in err and "stopped after" in err
        assert "request cmpl-" in err and "aborted" in err
    finally:
        proc.kill()
        proc.wait()
