"""The aiohttp application: OpenAI-compatible completions and chat, models, health and metrics.

Every handler decodes its body with the strict msgspec structs in
`protocol.py`, turns it into engine requests, and reads their outputs from
the `RequestStream` the bridge (`async_engine.py`) fills. Whatever way a
handler ends (finished, client gone, cancelled, error), `release` aborts
what is still running, so no request outlives its HTTP connection.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from minidsa.chat.formats import ChatOptions
from minidsa.common.request import InvalidRequest, SamplingParams, ToolCall
from minidsa.engine.chat import chat_format, prepare_chat
from minidsa.server import protocol as P
from minidsa.server.async_engine import AsyncEngine, ChatPrompt, EngineRequest, Histogram, RequestStream, StreamEnd

logger = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("async_engine", AsyncEngine)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCONNECT_POLL_S = 0.25  # how often a handler waiting for tokens checks that its client is still there
RETRY_AFTER_S = "1"
CLIENT_CLOSED = 499  # nginx's status for "client closed the connection before the response"


# ---------------------------------------------------------------- engine requests from API requests


def _sampling_params(req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int | None, seed_offset: int,
                     logprobs: bool, top_logprobs: int = 0, prompt_logprobs: int | None = None) -> Any:
    return SamplingParams(
        max_tokens=1 if max_tokens is None else max_tokens,  # None: replaced by the context room on the engine thread
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=None if req.seed is None else (req.seed + seed_offset) % 2**63,
        stop=P.stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        response_format=P.response_format_dict(req.response_format),
    )


def _check_model(ae: AsyncEngine, model: str | None) -> None:
    if model is not None and model != ae.model_name:
        raise P.RequestError(f"The model `{model}` does not exist; this server serves `{ae.model_name}`",
                             status=404, param="model", code="model_not_found")


async def _start(ae: AsyncEngine, requests: list[EngineRequest]) -> RequestStream:
    """Hand requests to the engine; engine refusals become 400 (bad request) or 503 (queue full)."""
    if not ae.accepting:
        raise P.RequestError("the server is shutting down", status=503, type="server_error",
                             code="unavailable", headers={"Retry-After": RETRY_AFTER_S})
    try:
        return await ae.generate(requests)
    except RuntimeError as e:  # the engine thread is not running
        raise P.RequestError(f"the engine is not available: {e}", status=503, type="server_error",
                             code="unavailable") from None
    except InvalidRequest as e:
        if type(e).__name__ == "QueueFull":
            raise P.RequestError(f"the request queue is full: {e}", status=503, type="server_error",
                                 code="queue_full", headers={"Retry-After": RETRY_AFTER_S}) from None
        raise P.RequestError(str(e), param=_engine_error_param(str(e))) from None


def _engine_error_param(message: str) -> str | None:
    """The request field an engine InvalidRequest is about ("SamplingParams.top_p ...", "prompt is empty")."""
    m = re.match(r"(?:SamplingParams\.)?(\w+)", message)
    name = m.group(1) if m else None
    return name if name in _PARAM_NAMES else None


_PARAM_NAMES = {"prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "prompt_logprobs", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "response_format", "tools", "tool_choice",
                "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort"}


def _disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


# ---------------------------------------------------------------- accumulating outputs per choice


@dataclass
class _Choice:
    index: int
    count_prompt: bool  # only the first of n choices of a prompt counts its prompt tokens
    chat: bool = False  # a chat answer (streams its parsed message)
    echo: str | None = None  # completions with echo: the prompt text, sent before the output
    text: str = ""
    num_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprob_tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    # echo with logprobs: the prompt's tokens, their logprobs (first None) and top alternatives
    prompt_logprob_tokens: list[str] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    # chat answers: the parsed message so far (RequestOutput.content / reasoning_content / tool_calls)
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    # deltas since the last emitted chunk
    pending_text: str = ""
    pending_logprobs: int = 0
    pending_echo: bool = False  # the echoed prompt is still to be sent (with the first chunk)
    pending_content: str = ""
    pending_reasoning: str = ""
    pending_calls: dict[int, str] = field(default_factory=dict)  # call index -> new argument text
    pending_new_calls: set[int] = field(default_factory=set)  # calls not announced yet (id and name)

    @property
    def has_pending(self) -> bool:
        """Something to stream: a chat choice streams its parsed message, not the raw text (held markup or
        not-yet-complete values send nothing)."""
        text = self.pending_content or self.pending_reasoning or self.pending_calls if self.chat else self.pending_text
        return bool(text or self.pending_logprobs or self.finish_reason or self.pending_echo)

    def clear_pending(self) -> None:
        self.pending_text, self.pending_logprobs, self.pending_echo = "", 0, False
        self.pending_content, self.pending_reasoning, self.pending_calls = "", "", {}
        self.pending_new_calls = set()


class _Choices:
    def __init__(self, request_ids: list[str], n: int, tokenizer: Any, want_logprobs: bool,
                 echoes: list[str] | None = None, chat: bool = False):
        self.by_id = {rid: _Choice(i, i % n == 0, chat, None if echoes is None else echoes[i // n])
                      for i, rid in enumerate(request_ids)}
        for c in self.by_id.values():
            c.pending_echo = c.echo is not None
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs

    def _decode_top(self, top: dict[int, float] | None) -> dict[str, float] | None:
        return None if top is None else {self.tokenizer.decode([t]): float(v) for t, v in top.items()}

    def update(self, item: Any) -> _Choice:
        c = self.by_id[item.request_id]
        if isinstance(item, StreamEnd):
            c.finish_reason = item.finish_reason
            c.error = item.error
            return c
        if item.prompt_logprobs is not None and not c.prompt_logprobs:
            c.prompt_logprob_tokens = [self.tokenizer.decode([t]) for t in item.prompt_token_ids]
            c.prompt_logprobs = list(item.prompt_logprobs)
            c.prompt_top_logprobs = [self._decode_top(t) for t in item.prompt_top_logprobs]
        # cumulative fields are the source of truth: a dropped or merged delta cannot lose a token
        if item.text.startswith(c.text):
            delta = item.text[len(c.text):]
        else:
            delta = item.new_text
        c.text += delta
        c.pending_text += delta
        new_ids = list(item.token_ids[c.num_tokens:])
        if self.want_logprobs and item.logprobs is not None:
            lps = list(item.logprobs)
            cumulative = len(lps) == len(item.token_ids)  # the engine may send all logprobs so far, or a delta
            new_lps = lps[c.num_tokens:] if cumulative else lps[len(lps) - len(new_ids):]
            c.logprob_tokens += [self.tokenizer.decode([t]) for t in new_ids]
            c.logprobs += [float(x) for x in new_lps]
            if item.top_logprobs is not None:
                tops = list(item.top_logprobs)
                new_tops = tops[c.num_tokens:] if len(tops) == len(item.token_ids) else tops[len(tops) - len(new_ids):]
                c.top_logprobs += [self._decode_top(t) for t in new_tops]
            c.pending_logprobs += len(new_ids)
        c.num_tokens = len(item.token_ids)
        c.prompt_tokens = len(item.prompt_token_ids)
        if item.content is not None:
            self._update_message(c, item)
        if item.finished:
            c.finish_reason = item.finish_reason or "stop"
        return c

    @staticmethod
    def _update_message(c: _Choice, item: Any) -> None:
        """The parsed message's growth since the last output (its fields only grow)."""
        c.pending_content += item.content[len(c.content):]
        c.content = item.content
        if item.reasoning_content is not None:
            c.pending_reasoning += item.reasoning_content[len(c.reasoning or ""):]
            c.reasoning = item.reasoning_content
        for i, call in enumerate(item.tool_calls or ()):
            sent = c.tool_calls[i].arguments if i < len(c.tool_calls) else None
            if sent is None:
                c.tool_calls.append(call)
                c.pending_new_calls.add(i)
                c.pending_calls[i] = c.pending_calls.get(i, "") + call.arguments
            elif len(call.arguments) > len(sent):
                c.pending_calls[i] = c.pending_calls.get(i, "") + call.arguments[len(sent):]
                c.tool_calls[i] = call

    def usage(self) -> P.UsageInfo:
        prompt = sum(c.prompt_tokens for c in self.by_id.values() if c.count_prompt)
        completion = sum(c.num_tokens for c in self.by_id.values())
        return P.UsageInfo(prompt, completion, prompt + completion)

    def ordered(self) -> list[_Choice]:
        return sorted(self.by_id.values(), key=lambda c: c.index)


def _completion_logprobs(c: _Choice, start: int, with_echo: bool, top: bool) -> P.CompletionLogprobs:
    """Logprobs of output tokens [start:], preceded by the echoed prompt's when `with_echo`; text offsets
    count from the start of the choice's whole text (echoed prompt included)."""
    tokens = c.logprob_tokens[start:]
    values: list[float | None] = list(c.logprobs[start:])
    tops: list[dict[str, float] | None] = list(c.top_logprobs[start:])
    if with_echo:
        tokens = c.prompt_logprob_tokens + tokens
        values = c.prompt_logprobs + values
        tops = c.prompt_top_logprobs + tops
        pos = 0
    else:
        pos = len(c.echo or "") + sum(len(t) for t in c.logprob_tokens[:start])
    offsets = []
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return P.CompletionLogprobs(tokens, values, tops if top else None, offsets)


def _chat_logprobs(c: _Choice, start: int) -> P.ChatLogprobs:
    def as_bytes(t: str) -> list[int]:
        return list(t.encode("utf-8", "replace"))

    tops = c.top_logprobs[start:] or [{}] * len(c.logprobs[start:])
    return P.ChatLogprobs([P.ChatTokenLogprob(t, lp, as_bytes(t),
                                              [P.ChatTopLogprob(k, v, as_bytes(k)) for k, v in top.items()])
                           for t, lp, top in zip(c.logprob_tokens[start:], c.logprobs[start:], tops)])


async def _collect(request: web.Request, stream: RequestStream, choices: _Choices) -> bool:
    """Wait for every choice to finish; False if the client went away first."""
    while not stream.finished:
        items = await stream.get_batch(DISCONNECT_POLL_S)
        if _disconnected(request):  # checked every batch: tokens may keep arriving for a client long gone
            return False
        for item in items:
            choices.update(item)
    errors = [c.error for c in choices.by_id.values() if c.error]
    if errors:
        raise P.RequestError(errors[0], status=500, type="server_error", code="engine_error")
    return True


async def _stream(request: web.Request, stream: RequestStream, choices: _Choices,
                  make_chunk: Callable[[_Choice, bool], bytes], first_chunks: list[bytes],
                  usage_chunk: Callable[[], bytes] | None) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    try:
        if first_chunks:
            await resp.write(b"".join(first_chunks))
        while not stream.finished:
            items = await stream.get_batch(DISCONNECT_POLL_S)
            if not items:
                if _disconnected(request):
                    return resp
                continue
            changed: dict[int, _Choice] = {}
            for item in items:
                c = choices.update(item)
                changed[c.index] = c
            out = []
            for index in sorted(changed):
                c = changed[index]
                if c.has_pending:
                    out.append(make_chunk(c, c.finish_reason is not None))
                    c.clear_pending()
            if out:
                await resp.write(b"".join(out))
        tail = [usage_chunk()] if usage_chunk is not None else []
        errors = [c.error for c in choices.by_id.values() if c.error]
        if errors:  # the engine failed mid-stream: say so the way OpenAI streams errors
            tail.append(_sse(P.ErrorResponse(P.ErrorBody(errors[0], "server_error", None, "engine_error"))))
        await resp.write(b"".join(tail) + b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:  # client went away mid-write; `release` aborts the requests
        pass
    return resp


def _include_usage(req: P.CompletionRequest | P.ChatCompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _sse(obj: Any) -> bytes:
    return b"data: " + P.encode(obj) + b"\n\n"


# ---------------------------------------------------------------- handlers


async def completions(request: web.Request) -> web.StreamResponse:
    ae = request.app[ENGINE_KEY]
    req = P.decode_completion_request(await request.read())
    _check_model(ae, req.model)
    want_logprobs = req.logprobs is not None
    top = req.logprobs or 0
    prompts = P.prompt_list(req.prompt)
    echoes = None
    if req.echo:
        tokenizer = ae.engine.tokenizer
        echoes = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
    # echo: the prompt's logprobs come from the prefill (max_tokens 0 asks for nothing else)
    prompt_logprobs = top if req.echo and (want_logprobs or req.max_tokens == 0) else None
    base_id = f"cmpl-{uuid.uuid4().hex}"
    engine_requests = [
        EngineRequest(f"{base_id}-{i * req.n + j}", prompt,
                      _sampling_params(req, req.max_tokens, j, want_logprobs, top, prompt_logprobs),
                      max_tokens_to_context=req.max_tokens is None)
        for i, prompt in enumerate(prompts) for j in range(req.n)
    ]
    stream = await _start(ae, engine_requests)
    try:
        choices = _Choices(stream.request_ids, req.n, ae.engine.tokenizer, want_logprobs, echoes)
        created = P.now()
        if req.stream:
            def chunk(c: _Choice, final: bool) -> bytes:
                start = len(c.logprobs) - c.pending_logprobs
                lp = _completion_logprobs(c, start, c.pending_echo, top > 0) if want_logprobs else None
                text = (c.echo if c.pending_echo else "") + c.pending_text
                choice = P.CompletionChoice(c.index, text, lp, c.finish_reason if final else None)
                return _sse(P.CompletionResponse(base_id, created, ae.model_name, [choice]))

            def usage() -> bytes:  # OpenAI's stream_options.include_usage: one last chunk with no choices
                return _sse(P.CompletionResponse(base_id, created, ae.model_name, [], choices.usage()))

            return await _stream(request, stream, choices, chunk, [], usage if _include_usage(req) else None)
        if not await _collect(request, stream, choices):
            return web.Response(status=CLIENT_CLOSED)  # nobody reads it; counted in /metrics
        body = P.CompletionResponse(
            base_id, created, ae.model_name,
            [P.CompletionChoice(c.index, (c.echo or "") + c.text,
                                _completion_logprobs(c, 0, req.echo, top > 0) if want_logprobs else None,
                                c.finish_reason) for c in choices.ordered()],
            choices.usage())
        return web.Response(body=P.encode(body), content_type="application/json")
    finally:
        ae.release(stream)


def _chat_options(req: P.ChatCompletionRequest | P.TokenizeRequest) -> ChatOptions:
    return ChatOptions(tools=P.tools_list(req.tools), tool_choice=P.tool_choice_value(req.tool_choice),
                       parallel_tool_calls=getattr(req, "parallel_tool_calls", True),
                       chat_template_kwargs=dict(req.chat_template_kwargs or {}),
                       reasoning_effort=req.reasoning_effort,
                       add_generation_prompt=getattr(req, "add_generation_prompt", True))


def _chat_message(c: _Choice) -> P.ChatResponseMessage:
    calls = [P.ToolCallOut(t.id, P.FunctionCallOut(t.name, t.arguments)) for t in c.tool_calls]
    return P.ChatResponseMessage("assistant", None if calls and not c.content else c.content,
                                 c.reasoning or None, calls)


def _chat_deltas(c: _Choice) -> list[P.ChatDelta]:
    """A choice's news as OpenAI streams it: reasoning, then content, then per call its id and name (arguments ""),
    then its argument fragments."""
    deltas = []
    if c.pending_reasoning:
        deltas.append(P.ChatDelta(reasoning_content=c.pending_reasoning))
    if c.pending_content:
        deltas.append(P.ChatDelta(content=c.pending_content))
    for i in sorted(c.pending_calls):
        args = c.pending_calls[i]
        call = c.tool_calls[i]
        if i in c.pending_new_calls:  # announced first: id, type and name
            deltas.append(P.ChatDelta(tool_calls=[P.ToolCallDelta(i, P.FunctionCallDelta(call.name, ""), call.id,
                                                                  "function")]))
        if args:
            deltas.append(P.ChatDelta(tool_calls=[P.ToolCallDelta(i, P.FunctionCallDelta(arguments=args))]))
    return deltas or [P.ChatDelta()]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ae = request.app[ENGINE_KEY]
    req = P.decode_chat_request(await request.read())
    _check_model(ae, req.model)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt = ChatPrompt(P.chat_messages(req.messages), _chat_options(req))
    base_id = f"chatcmpl-{uuid.uuid4().hex}"
    engine_requests = [
        EngineRequest(f"{base_id}-{j}", prompt,
                      _sampling_params(req, max_tokens, j, req.logprobs, req.top_logprobs or 0),
                      max_tokens_to_context=max_tokens is None)
        for j in range(req.n)
    ]
    stream = await _start(ae, engine_requests)
    try:
        choices = _Choices(stream.request_ids, req.n, ae.engine.tokenizer, req.logprobs, chat=True)
        created = P.now()
        if req.stream:
            def chunk(c: _Choice, final: bool) -> bytes:
                start = len(c.logprobs) - c.pending_logprobs
                lp = _chat_logprobs(c, start) if req.logprobs else None
                deltas = _chat_deltas(c)
                events = [P.ChatChunkChoice(c.index, d, lp if k == 0 else None,
                                            c.finish_reason if final and k == len(deltas) - 1 else None)
                          for k, d in enumerate(deltas)]
                return b"".join(_sse(P.ChatCompletionChunk(base_id, created, ae.model_name, [e])) for e in events)

            first = [_sse(P.ChatCompletionChunk(base_id, created, ae.model_name,
                                                [P.ChatChunkChoice(j, P.ChatDelta(role="assistant", content=""))]))
                     for j in range(req.n)]
            def usage() -> bytes:
                return _sse(P.ChatCompletionChunk(base_id, created, ae.model_name, [], choices.usage()))

            return await _stream(request, stream, choices, chunk, first, usage if _include_usage(req) else None)
        if not await _collect(request, stream, choices):
            return web.Response(status=CLIENT_CLOSED)  # nobody reads it; counted in /metrics
        body = P.ChatCompletionResponse(
            base_id, created, ae.model_name,
            [P.ChatChoice(c.index, _chat_message(c), _chat_logprobs(c, 0) if req.logprobs else None,
                          c.finish_reason) for c in choices.ordered()],
            choices.usage())
        return web.Response(body=P.encode(body), content_type="application/json")
    finally:
        ae.release(stream)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: the tokens a completion prompt or a conversation becomes (the same as generation uses)."""
    ae = request.app[ENGINE_KEY]
    req = P.decode_tokenize_request(await request.read())
    _check_model(ae, req.model)

    def run(engine: Any) -> list[int]:
        if req.prompt is not None:
            return engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        params = SamplingParams(response_format=P.response_format_dict(req.response_format))
        return prepare_chat(engine, P.chat_messages(req.messages), params, _chat_options(req))[0].token_ids

    tokens = await _on_engine(ae, run)
    return web.Response(body=P.encode(P.TokenizeResponse(tokens, len(tokens), ae.max_model_len)),
                        content_type="application/json")


async def detokenize(request: web.Request) -> web.Response:
    ae = request.app[ENGINE_KEY]
    req = P.decode_detokenize_request(await request.read())
    _check_model(ae, req.model)
    vocab = ae.engine.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise P.RequestError(f"token ids {bad[:8]} are outside the vocabulary (size {vocab})", param="tokens")
    prompt = await _on_engine(ae, lambda engine: engine.tokenizer.decode(req.tokens, skip_special_tokens=False))
    return web.Response(body=P.encode(P.DetokenizeResponse(prompt)), content_type="application/json")


async def _on_engine(ae: AsyncEngine, fn: Callable[[Any], Any]) -> Any:
    """fn(engine) on the engine thread (the tokenizer and chat format are the engine's); refusals are 400s."""
    try:
        return await ae.run_on_engine(fn)
    except InvalidRequest as e:
        raise P.RequestError(str(e), param=_engine_error_param(str(e))) from None
    except RuntimeError as e:  # the engine thread is not running
        raise P.RequestError(f"the engine is not available: {e}", status=503, type="server_error",
                             code="unavailable") from None


async def models(request: web.Request) -> web.Response:
    ae = request.app[ENGINE_KEY]
    card = P.ModelCard(ae.model_name, request.app[_STARTED_KEY], ae.max_model_len)
    return web.Response(body=P.encode(P.ModelList([card])), content_type="application/json")


async def model(request: web.Request) -> web.Response:
    ae = request.app[ENGINE_KEY]
    _check_model(ae, request.match_info["model"])
    card = P.ModelCard(ae.model_name, request.app[_STARTED_KEY], ae.max_model_len)
    return web.Response(body=P.encode(card), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    ae = request.app[ENGINE_KEY]
    if not ae.is_alive:
        return web.json_response({"status": "error", "reason": "engine thread is not running"}, status=503)
    if not ae.accepting:
        return web.json_response({"status": "draining"}, status=503, headers={"Retry-After": RETRY_AFTER_S})
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=render_metrics(request.app[ENGINE_KEY]), content_type="text/plain",
                        charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})


# ---------------------------------------------------------------- Prometheus exposition


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def render_metrics(ae: AsyncEngine) -> str:
    """Prometheus text format 0.0.4, written by hand (no prometheus_client at runtime)."""
    model = f'model_name="{_label(ae.model_name)}"'
    m = ae.metrics_snapshot
    get = (lambda name: getattr(m, name, 0) or 0) if m is not None else (lambda name: 0)
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{{{model}{labels}}} {_num(value)}")

    def simple(name: str, kind: str, help_text: str, value: float) -> None:
        metric(name, kind, help_text, [("", value)])

    def histogram(name: str, help_text: str, h: Histogram) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} histogram")
        cumulative = 0
        for bound, count in zip(list(h.buckets) + [float("inf")], h.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else _num(float(bound))
            lines.append(f'{name}_bucket{{{model},le="{le}"}} {cumulative}')
        lines.append(f"{name}_sum{{{model}}} {_num(float(h.sum))}")
        lines.append(f"{name}_count{{{model}}} {h.count}")

    simple("minidsa_num_requests_running", "gauge", "Requests in the running batch.", get("num_running"))
    simple("minidsa_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", get("num_waiting"))
    simple("minidsa_kv_cache_usage_ratio", "gauge", "Fraction of KV cache token slots in use (0..1).",
           float(get("kv_usage")))
    simple("minidsa_kv_cache_used_tokens", "gauge", "KV cache token slots in use.", get("kv_used_tokens"))
    simple("minidsa_kv_cache_total_tokens", "gauge", "KV cache token slots in all.", get("kv_total_tokens"))
    simple("minidsa_prompt_tokens_total", "counter", "Prompt tokens prefilled.", get("prompt_tokens_total"))
    simple("minidsa_generation_tokens_total", "counter", "Tokens generated.", get("generation_tokens_total"))
    simple("minidsa_generation_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
           float(ae.generation_tokens_per_second()))
    simple("minidsa_requests_finished_total", "counter", "Requests the engine finished.",
           get("requests_finished_total"))
    simple("minidsa_preemptions_total", "counter", "Requests preempted for KV space.", get("preemptions_total"))
    simple("minidsa_requests_aborted_total", "counter", "Requests aborted because their client went away.",
           ae.stats.requests_aborted)
    simple("minidsa_engine_errors_total", "counter", "Requests failed by an engine error.", ae.stats.engine_errors)
    metric("minidsa_request_finish_total", "counter", "Finished requests by finish reason.",
           [(f',finish_reason="{_label(k)}"', v) for k, v in sorted(ae.stats.finish_reasons.items())])
    metric("minidsa_http_responses_total", "counter", "HTTP responses by route and status.",
           [(f',route="{_label(r)}",status="{s}"', v) for (r, s), v in sorted(ae.stats.http_responses.items())])
    draft, accepted = get("spec_draft_tokens_total"), get("spec_accepted_tokens_total")
    simple("minidsa_spec_decode_draft_tokens_total", "counter", "Speculative draft tokens proposed.", draft)
    simple("minidsa_spec_decode_accepted_tokens_total", "counter", "Speculative draft tokens accepted.", accepted)
    simple("minidsa_spec_decode_verify_steps_total", "counter", "Speculative verify steps.",
           get("spec_verify_steps_total"))
    simple("minidsa_spec_decode_acceptance_ratio", "gauge", "Accepted over proposed draft tokens (0 when off).",
           accepted / draft if draft else 0.0)
    simple("minidsa_spec_decode_simulated_accept_length", "gauge", "Benchmarks only: the simulated tokens per "
           "speculative round (--speculative-simulate-accept-len); 0 = acceptance is the model's own.",
           float(get("spec_simulated_accept_len")))
    query, hits = get("prefix_cache_query_tokens_total"), get("prefix_cache_hit_tokens_total")
    simple("minidsa_prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
           query)
    simple("minidsa_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served by the prefix cache.", hits)
    simple("minidsa_prefix_cache_hit_ratio", "gauge", "Prefix cache hit tokens over query tokens (0 when off).",
           hits / query if query else 0.0)
    simple("minidsa_prefix_cache_tokens", "gauge", "KV token slots held by the prefix cache.",
           get("prefix_cache_tokens"))
    histogram("minidsa_time_to_first_token_seconds", "Time from request arrival to its first token.", ae.stats.ttft)
    histogram("minidsa_inter_token_latency_seconds", "Time between successive tokens of a request.", ae.stats.itl)
    histogram("minidsa_e2e_request_latency_seconds", "Time from request arrival to its last token.", ae.stats.e2e)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- middlewares and the app

_STARTED_KEY = web.AppKey("started", int)
_DRAIN_KEY = web.AppKey("drain_timeout", float)


def _error_response(err: P.RequestError) -> web.Response:
    return web.Response(body=P.error_body(err), status=err.status, content_type="application/json",
                        headers=err.headers)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure becomes an OpenAI-style JSON error; responses are counted for /metrics."""
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    try:
        resp = await handler(request)
    except P.RequestError as e:
        resp = _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        keep = {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
        resp = _error_response(P.RequestError(e.reason or "error", status=e.status, type=kind, headers=keep))
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - a bug; say so in JSON and keep serving
        logger.exception("unhandled error in %s", request.path)
        resp = _error_response(P.RequestError(f"internal error: {type(e).__name__}: {e}", status=500,
                                              type="server_error"))
    request.app[ENGINE_KEY].stats.http_responses[(route, resp.status)] += 1
    return resp


def _auth(api_key: str | None) -> Any:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        # /health and /metrics stay open for load balancers and scrapers; the API needs the key
        if expected is not None and request.path.startswith(("/v1", "/tokenize", "/detokenize")):
            got = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(got, expected):
                raise P.RequestError("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     status=401, code="invalid_api_key")
        return await handler(request)

    return auth


async def _on_startup(app: web.Application) -> None:
    ae = app[ENGINE_KEY]
    if not ae.is_alive:
        ae.start()


async def _on_shutdown(app: web.Application) -> None:
    await app[ENGINE_KEY].drain(app[_DRAIN_KEY])


async def _on_cleanup(app: web.Application) -> None:
    await app[ENGINE_KEY].stop()


def build_app(async_engine: AsyncEngine, api_key: str | None = None, *, drain_timeout: float = 30.0
              ) -> web.Application:
    """The aiohttp app serving `async_engine`. Starting the app starts the engine thread; shutting it down
    drains open requests for up to `drain_timeout` s (then aborts them, each stream getting a final event)
    and stops the thread."""
    app = web.Application(middlewares=[_errors, _auth(api_key)], client_max_size=32 * 1024 * 1024)
    app[ENGINE_KEY] = async_engine
    app[_STARTED_KEY] = P.now()
    app[_DRAIN_KEY] = float(drain_timeout)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, bound now, so a taken port or a bad address is reported before
    the model loads (and nothing can take the port meanwhile). OSError names the address and the reason."""
    if not 0 <= port <= 65535:
        raise OSError(f"port {port} is out of range (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: unknown host ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart right after a previous server
        sock.bind(address)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        reason = "the address is already in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise OSError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.setblocking(False)
    return sock


async def start_server(app: web.Application, host: str, port: int, *, handler_cancellation: bool = True,
                       sock: socket.socket | None = None) -> tuple[web.AppRunner, str]:
    """Start `app` on host:port (port 0 picks a free one), or on an already bound `sock`; returns the runner
    and the base URL.

    With handler_cancellation aiohttp cancels a handler as soon as its client disconnects; without it the
    handlers notice on their own (a failed write, or the transport found closed within DISCONNECT_POLL_S)."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{bound_host}:{bound_port}"


DEFAULT_DRAIN_TIMEOUT_S = 30.0


class EngineDied(RuntimeError):
    """The server stopped because its engine could not go on (e.g. a tensor-parallel rank died)."""


def serve(engine_config: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
          drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S, served_model_name: str | None = None,
          sock: socket.socket | None = None, engine_factory: Callable[[Any], Any] | None = None) -> None:
    """Load an Engine from `engine_config` (an EngineConfig; None = the embedded tiny preset) and serve it
    until SIGTERM / SIGINT. While the engine starts, the port already answers: /health with 503
    {"status": "starting"}, the API with 503 (`_StartingServer`); an engine that fails to start raises its
    error here. The first signal stops taking requests (new ones get 503) and lets the open ones
    finish for up to `drain_timeout` s; a second signal, or the timeout, aborts what is left (each stream
    ends with finish_reason "abort"). An engine that stops by itself (a dead tensor-parallel rank) fails the
    open requests, shuts the server down the same way and raises EngineDied naming why.
    `engine_factory(engine_config)` builds the engine (default: `Engine`)."""
    from minidsa.config import EngineConfig, resolve
    from minidsa.engine import Engine

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_config = engine_config if engine_config is not None else EngineConfig()
    # Bad input (a model that does not exist, a --tp the GPUs or the model's shapes cannot take) fails now, in one
    # line, before listening or starting any rank.
    resolve(engine_config)
    if sock is None:
        sock = bind_socket(host, port)
    try:
        started = time.monotonic()
        starting = _StartingServer(sock)
        logger.info("listening on %s; /health answers 503 \"starting\" until the engine is ready", starting.url)
        try:
            engine = (engine_factory or Engine)(engine_config)
        finally:
            starting.stop()
        logger.info("engine ready in %.1f s: %s", time.monotonic() - started, engine)
        try:
            chat_format(engine)  # decided (and logged) now rather than on the first chat request
        except Exception as e:  # noqa: BLE001 - e.g. no tokenizer: completions by token ids still work
            logger.error("chat requests will fail: %s", e)
        ae = AsyncEngine(engine, model_name=served_model_name)
        try:
            asyncio.run(_serve(ae, sock, api_key, drain_timeout))
        finally:
            engine.close()  # tensor-parallel ranks stop with the server
        if ae.death_reason is not None:
            raise EngineDied(ae.death_reason)
    finally:
        sock.close()


def _starting_app() -> web.Application:
    """Answers every request while the engine starts: /health 503 {"status": "starting"}, the rest an
    OpenAI-style 503, both with Retry-After, so an orchestrator can tell a starting server from a dead one."""
    async def starting(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.json_response({"status": "starting"}, status=503, headers={"Retry-After": RETRY_AFTER_S})
        return _error_response(P.RequestError("the server is starting: the model is loading; retry later",
                                              status=503, type="server_error", headers={"Retry-After": RETRY_AFTER_S}))

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", starting)
    return app


class _StartingServer:
    """`_starting_app` served from a thread of its own on a duplicate of `sock` while this thread builds the
    engine (a signal then interrupts the build as before); `stop` closes the duplicate, so `sock` stays bound
    and listening for the real server."""

    def __init__(self, sock: socket.socket):
        self.loop = asyncio.new_event_loop()
        started: list = []
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                started.append(self.loop.run_until_complete(start_server(_starting_app(), "", 0, sock=sock.dup())))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                started.append(e)
            ready.set()
            if isinstance(started[0], BaseException):
                return
            self.loop.run_forever()
            self.loop.run_until_complete(started[0][0].cleanup())

        self.thread = threading.Thread(target=run, name="minidsa-starting", daemon=True)
        self.thread.start()
        ready.wait()
        if isinstance(started[0], BaseException):
            raise started[0]
        self.url = started[0][1]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _signal_when_engine_dies(ae: AsyncEngine, signals: asyncio.Queue) -> None:
    """An engine that cannot step any more (e.g. a tensor-parallel rank died) stops the server as SIGTERM would."""
    while ae.is_alive:
        await asyncio.sleep(0.5)
    logger.error("the engine stopped: shutting the server down")
    signals.put_nowait(signal.SIGTERM)


async def _serve(ae: AsyncEngine, sock: socket.socket, api_key: str | None, drain_timeout: float) -> None:
    app = build_app(ae, api_key, drain_timeout=drain_timeout)
    runner, url = await start_server(app, "", 0, sock=sock)
    signals = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    logger.info("minidsa serving %s on %s (max_model_len %d)", ae.model_name, url, ae.max_model_len)
    print(f"minidsa: serving {ae.model_name} on {url}", flush=True)
    engine_watch = asyncio.ensure_future(_signal_when_engine_dies(ae, signals))
    sig = await signals.get()
    engine_watch.cancel()
    started = time.monotonic()
    open_requests = len(ae.inflight_request_ids())
    logger.info("%s: shutting down; draining %d in-flight requests for up to %.1f s (new requests get 503; "
                "signal again to abort them now)", signal.Signals(sig).name, open_requests, drain_timeout)
    # The listening socket stays open while draining: new requests get a 503 with an error body, not a refusal.
    drain = asyncio.ensure_future(ae.drain(drain_timeout))
    again = asyncio.ensure_future(signals.get())
    await asyncio.wait([drain, again], return_when=asyncio.FIRST_COMPLETED)
    if again.done() and not drain.done():
        logger.warning("%s again: aborting %d in-flight requests", signal.Signals(again.result()).name,
                       len(ae.inflight_request_ids()))
        await ae.abort_all_and_wait(timeout=5.0)
        drain.cancel()
    again.cancel()
    app[_DRAIN_KEY] = 0.0  # drained already: the app's own shutdown hook must not wait again
    await runner.cleanup()
    logger.info("stopped after %.1f s", time.monotonic() - started)
