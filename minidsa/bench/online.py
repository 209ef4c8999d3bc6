"""Online serving benchmark (`minidsa bench --request-rate R --max-concurrency C [--base-url URL]`).

The same synthetic workloads as the offline benchmark (offline.py), sent as streaming
`/v1/completions` requests (token-id prompts, `max_tokens` = the request's output length,
`ignore_eos`, greedy) to an OpenAI-compatible server: minidsa's own, started in-process on a
free loopback port, or any other one (`base_url`: minidsa, vLLM, SGLang). Requests arrive as a
Poisson process of `request_rate` per second (inf = all at t = 0), at most `max_concurrency` in
flight. Measured on the client, per request: TTFT (first streamed chunk with text), ITL (between
such chunks), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E
latency; goodput counts the requests per second that met every given SLO.

Token ids of remote prompts stay below 32000 (the vocabulary of the server's model is not known
here); the output token count comes from the server's usage report when it sends one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from minidsa.bench.offline import PERCENTILES, Workload, git_commit, _percentiles, make_workload, throughput

REMOTE_VOCAB = 32000  # prompts for a server whose tokenizer is unknown use ids below this
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds); ValueError naming a bad entry."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in GOODPUT_METRICS or not ms > 0:
            raise ValueError(f"--goodput entry {spec!r}: expected METRIC:MS with METRIC one of "
                             f"{', '.join(GOODPUT_METRICS)} and MS > 0")
        slos[name] = ms / 1e3
    return slos


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # seconds since the run started
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[tuple[float, int]] = field(default_factory=list)  # (seconds since run start, tokens)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s) of n requests: a Poisson process of `request_rate`/s; all 0 when it is inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed ^ 0xA771)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


async def _one_request(session: Any, url: str, headers: dict[str, str], model: str, prompt: list[int],
                       max_tokens: int, run_start: float) -> RequestResult:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r = RequestResult(prompt_tokens=len(prompt))
    sent = time.perf_counter()
    r.start = sent - run_start
    last = sent
    chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            usage_tokens = None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    r.error = str(event["error"].get("message", event["error"]))
                    return r
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices") or []
                if not choices or not choices[0].get("text"):  # a usage-only or final empty chunk
                    continue
                now = time.perf_counter()
                if r.ttft is None:
                    r.ttft = now - sent
                else:
                    r.itl.append(now - last)
                last = now
                chunks += 1
                r.chunk_times.append((now - run_start, 1))
            r.e2e = time.perf_counter() - sent
            r.output_tokens = usage_tokens if usage_tokens is not None else chunks
            r.ok = r.ttft is not None
            if not r.ok:
                r.error = "the stream ended without a token"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def _fetch_model(session: Any, base_url: str, headers: dict[str, str]) -> tuple[str, int | None]:
    async with session.get(base_url + "/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise OSError(f"{base_url}/v1/models answered HTTP {resp.status}: {(await resp.text())[:200]}")
        data = (await resp.json())["data"]
    if not data:
        raise OSError(f"{base_url}/v1/models lists no model")
    return data[0]["id"], data[0].get("max_model_len")


async def drive(base_url: str, w: Workload, request_rate: float, max_concurrency: int | None,
                model_name: str | None = None, api_key: str | None = None, warmup: bool = True,
                progress: bool = True, timeout_s: float = 3600.0) -> tuple[str, list[RequestResult], float]:
    """Send the workload to the server at base_url; (model name, per-request results, duration in s)."""
    import aiohttp
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        model = model_name or (await _fetch_model(session, base_url.rstrip("/"), headers))[0]
        if warmup:
            ids = w.prompts[0][:16]
            for _ in range(2):
                r = await _one_request(session, url, headers, model, ids, 4, time.perf_counter())
                if not r.ok:
                    raise OSError(f"warm-up request to {url} failed: {r.error}")
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        times = arrival_times(len(w.prompts), request_rate, w.seed)
        bar = tqdm(total=len(w.prompts), desc="bench", unit="req", disable=not progress)
        start = time.perf_counter()

        async def send(i: int) -> RequestResult:
            delay = start + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                r = await _one_request(session, url, headers, model, w.prompts[i], w.output_lens[i], start)
            else:
                async with semaphore:
                    r = await _one_request(session, url, headers, model, w.prompts[i], w.output_lens[i], start)
            bar.update(1)
            return r

        results = await asyncio.gather(*(send(i) for i in range(len(w.prompts))))
        duration = time.perf_counter() - start
        bar.close()
    return model, list(results), duration


def summarise(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    itl = [x for r in ok for x in r.itl]

    def meets(r: RequestResult) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
        return all(values[k] <= v for k, v in slos.items())

    events = sorted((t, n) for r in ok for t, n in r.chunk_times)
    timeline, done = [], 0
    ends = sorted(r.start + r.e2e for r in ok)
    for t, n in events:  # (seconds since start, tokens, requests finished): the offline result's shape
        while done < len(ends) and ends[done] <= t:
            done += 1
        timeline.append((t, n, done))
    errors = [r.error for r in results if not r.ok]
    return {
        "duration_s": duration,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "first_error": errors[0] if errors else None,
        **throughput(duration, len(ok), in_tok, out_tok),
        "ttft_s": _percentiles([r.ttft for r in ok]),
        "itl_s": _percentiles(itl),
        "tpot_s": _percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": _percentiles([r.e2e for r in ok]),
        "goodput": None if not slos else {
            "slo_s": slos,
            "requests_meeting_slo": sum(1 for r in ok if meets(r)),
            "requests_per_s": sum(1 for r in ok if meets(r)) / duration,
        },
        "timeline": timeline,
    }


def run_online_bench(engine_config: Any | None, *, base_url: str | None = None, num_requests: int | None = None,
                     input_len: tuple[int, int] | None = None, output_len: tuple[int, int] | None = None,
                     seed: int = 0, request_rate: float = float("inf"), max_concurrency: int | None = None,
                     workload: str = "random", shared_prefix_len: int | None = None, model_name: str | None = None,
                     api_key: str | None = None, goodput: dict[str, float] | None = None, warmup: bool = True,
                     progress: bool = True) -> dict[str, Any]:
    """Run the online benchmark against `base_url`, or (base_url None) against minidsa's server on an engine
    built from `engine_config`, started in-process on a free loopback port. Returns the JSON result."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf = all at once), got {request_rate}")
    slos = goodput or {}
    if base_url is not None:
        return asyncio.run(_remote(base_url, num_requests, input_len, output_len, seed, request_rate,
                                   max_concurrency, workload, shared_prefix_len, model_name, api_key, slos, warmup,
                                   progress))
    from minidsa.bench.offline import describe_device
    from minidsa.engine import Engine

    engine = Engine(engine_config, progress=progress)
    w = make_workload(workload, num_requests, input_len, output_len, seed, shared_prefix_len,
                  engine.runner.device.type == "cuda", engine.vocab_size, engine.max_model_len)

    async def local() -> tuple[str, list[RequestResult], float]:
        from minidsa.server.app import build_app, start_server
        from minidsa.server.async_engine import AsyncEngine

        ae = AsyncEngine(engine, model_name=model_name)
        runner, url = await start_server(build_app(ae, drain_timeout=5.0), "127.0.0.1", 0)
        try:
            return await drive(url, w, request_rate, max_concurrency, None, None, warmup, progress)
        finally:
            await runner.cleanup()

    model, results, duration = asyncio.run(local())
    engine.check_no_leaks()
    out = _result(model, describe_device(engine), w, workload, request_rate, max_concurrency, None,
                  summarise(results, duration, slos))
    out["engine_config"] = {k: v for k, v in dataclasses.asdict(engine.config.args).items() if k != "extra"}
    return out


async def _remote(base_url: str, num_requests: int | None, input_len: tuple[int, int] | None,
                  output_len: tuple[int, int] | None, seed: int, request_rate: float, max_concurrency: int | None,
                  workload: str, shared_prefix_len: int | None, model_name: str | None, api_key: str | None,
                  slos: dict[str, float], warmup: bool, progress: bool) -> dict[str, Any]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        try:
            listed, max_model_len = await _fetch_model(session, base_url.rstrip("/"), headers)
        except aiohttp.ClientError as e:
            raise OSError(f"cannot reach {base_url}: {e}") from None
    # The remote GPU/CPU is unknown: the GPU-sized default workload, unless sizes are given.
    w = make_workload(workload, num_requests, input_len, output_len, seed, shared_prefix_len, True, REMOTE_VOCAB,
                  max_model_len or 1 << 30)
    model, results, duration = await drive(base_url, w, request_rate, max_concurrency, model_name or listed,
                                           api_key, warmup, progress)
    return _result(model, base_url, w, workload, request_rate, max_concurrency, base_url,
                   summarise(results, duration, slos))


def _result(model: str, device: str, w: Workload, workload: str, request_rate: float,
            max_concurrency: int | None, base_url: str | None, results: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {
        "mode": "online",
        "model": model,
        "device": device,
        "base_url": base_url,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "workload": {"type": workload, "num_requests": len(w.prompts), "input_len": list(w.input_len),
                     "output_len": list(w.output_len), "seed": w.seed, "shared_prefix_len": w.shared_prefix_len,
                     "request_rate": "inf" if math.isinf(request_rate) else request_rate,
                     "max_concurrency": max_concurrency},
        "results": results,
    }


def print_online_summary(result: dict[str, Any]) -> None:
    r = result["results"]
    wl = result["workload"]
    rows = [
        ("model", result["model"]),
        ("server", result["base_url"] or f"minidsa in-process ({result['device']})"),
        ("request rate", f"{wl['request_rate']} req/s, max concurrency {wl['max_concurrency'] or 'unlimited'}"),
        ("requests", f"{r['completed']} completed, {r['failed']} failed  (in {r['input_tokens']} tok, "
                     f"out {r['output_tokens']} tok)"),
        ("duration", f"{r['duration_s']:.2f} s"),
        ("requests/s", f"{r['requests_per_s']:.2f}"),
        ("input tokens/s", f"{r['input_tokens_per_s']:.1f}"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
    ]
    if r["goodput"] is not None:
        g = r["goodput"]
        slo = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in g["slo_s"].items())
        rows.append(("goodput", f"{g['requests_per_s']:.2f} req/s  ({g['requests_meeting_slo']} of "
                                f"{r['completed']} met {slo})"))
    keys = ("mean",) + tuple(f"p{p}" for p in PERCENTILES)
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s")):
        s = r[key]
        rows.append((f"{name} ms ({'/'.join(keys)})", " / ".join(f"{s[k] * 1e3:.1f}" for k in keys)))
    if r["first_error"]:
        rows.append(("first error", r["first_error"]))
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 40))
