"""The bridge between the asyncio server and the (blocking, single-threaded) Engine.

One background thread owns the engine: it alone calls add_request / step /
abort / metrics. The event loop hands it work through a command deque guarded
by a condition variable; the thread runs the commands, then one engine step,
then hands that step's outputs to the event loop in one
`loop.call_soon_threadsafe`, so a token reaches its HTTP stream as soon as the
step that produced it returns. With no command and no unfinished request the
thread sleeps on the condition (no polling).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import copy
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from minidsa.chat.formats import ChatOptions
from minidsa.engine.chat import prepare_chat
from minidsa.parallel.launch import RankFailedError

logger = logging.getLogger(__name__)


@dataclass
class ChatPrompt:
    """A chat conversation; the engine thread renders it with the model's chat format and parses the answer."""

    messages: list[dict[str, Any]]
    options: ChatOptions = field(default_factory=ChatOptions)


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | list[int] | ChatPrompt
    params: Any  # minidsa.common.request.SamplingParams
    max_tokens_to_context: bool = False  # params.max_tokens := context length - prompt length


@dataclass
class StreamEnd:
    """A request that ended without a finished RequestOutput (aborted by the server, or an engine error)."""

    request_id: str
    finish_reason: str = "abort"
    error: str | None = None


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0


class RequestStream:
    """The outputs of the engine requests behind one HTTP request, in arrival order."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.unfinished = set(request_ids)
        now = time.perf_counter()
        self.timing = {rid: _Timing(now) for rid in request_ids}

    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def get_batch(self, timeout: float) -> list[Any]:
        """Everything queued now, waiting up to `timeout` s for the first item ([] on timeout)."""
        try:
            first = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return []
        items = [first]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, StreamEnd) or item.finished:
                self.unfinished.discard(item.request_id)
        return items


class Histogram:
    """A Prometheus histogram (cumulative buckets written out by `metrics.render`)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)


@dataclass
class ServerStats:
    """Server-side measurements; touched only on the event loop thread."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    requests_aborted: int = 0
    engine_errors: int = 0
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)
    http_responses: collections.Counter = field(default_factory=collections.Counter)  # (route, status)


def _log_request_end(request_id: str, timing: _Timing | None, finish_reason: str, error: str | None,
                     now: float) -> None:
    """The one INFO line per request that ended (finished, aborted or failed)."""
    if timing is None:
        logger.info("request %s %s", request_id, finish_reason)
        return
    ttft = "-" if timing.first_token is None else f"{timing.first_token - timing.arrival:.3f} s"
    what = "failed" if error else "aborted" if finish_reason == "abort" else "finished"
    logger.info("request %s %s: %d prompt tokens, %d output tokens, TTFT %s, duration %.3f s, finish_reason %s%s",
                request_id, what, timing.prompt_tokens, timing.output_tokens, ttft, now - timing.arrival,
                finish_reason, f" ({error})" if error else "")


class AsyncEngine:
    def __init__(self, engine: Any, model_name: str | None = None):
        """`model_name`: the name clients send and /v1/models lists (default: the engine's)."""
        self.engine = engine
        self.model_name: str = model_name or engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.stats = ServerStats()
        self.metrics_snapshot: Any = None  # the engine's latest metrics(), taken by the engine thread
        self.accepting = True  # False while draining for shutdown
        self._drained = False  # a drain (or abort_all_and_wait) has completed: the next drain returns at once
        self._cond = threading.Condition()
        # (command, future): the future, when there is one, is failed if the thread dies before running it
        self._commands: collections.deque[tuple[Callable[[], None], concurrent.futures.Future | None]] = \
            collections.deque()
        self._stopping = False
        self._dead = False  # the engine thread has exited (set under _cond)
        self.death_reason: str | None = None  # why the engine thread ended, when not asked to stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine_streams: dict[str, RequestStream] = {}  # written by the engine thread only
        self._open_streams: set[RequestStream] = set()  # event loop only
        self._streams_closed: asyncio.Event | None = None  # set when no stream is open; made in start()
        self._gen_rate = collections.deque(maxlen=64)  # (time, generation_tokens_total) samples

    # ------------------------------------------------------------ lifecycle (event loop side)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = self._dead = False
        self._streams_closed = asyncio.Event()
        self._streams_closed.set()
        self._thread = threading.Thread(target=self._run, name="minidsa-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and not self._dead

    async def drain(self, timeout: float) -> None:
        """Stop taking requests; let open ones finish for up to `timeout` s, then abort the rest.

        Every aborted stream still receives a final StreamEnd, so its handler writes a last event.
        """
        self.accepting = False
        if self._drained:
            return
        try:
            await asyncio.wait_for(self._streams_closed.wait(), timeout)
            self._drained = True
        except asyncio.TimeoutError:
            logger.warning("shutdown: drain timeout (%.1f s) reached", timeout)
            await self.abort_all_and_wait(5.0)

    async def abort_all_and_wait(self, timeout: float) -> None:
        """Stop taking requests, abort every open one and wait up to `timeout` s for their handlers to end."""
        self.accepting = False
        ids = [rid for s in self._open_streams for rid in s.unfinished]
        if ids:
            logger.warning("shutdown: aborting %d unfinished requests", len(ids))
        self.abort(ids)
        try:
            await asyncio.wait_for(self._streams_closed.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._drained = True

    async def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # ------------------------------------------------------------ requests (event loop side)

    async def generate(self, requests: list[EngineRequest]) -> RequestStream:
        """Add requests to the engine (all or none) and return the stream their outputs arrive on.

        Raises whatever Engine.add_request raised (InvalidRequest / QueueFull) for the first request
        it refused; the ones added before it are aborted.
        """
        stream = RequestStream([r.request_id for r in requests])
        done: concurrent.futures.Future = concurrent.futures.Future()

        def add_all() -> None:
            added = []
            try:
                for r in requests:
                    prompt, params, chat_output = self._resolve(r)
                    self.engine.add_request(prompt, params, request_id=r.request_id)
                    added.append(r.request_id)
                    if chat_output is not None:
                        self.engine.outputs.parse_chat(self.engine.requests[r.request_id], chat_output)
                    # for the request's log line even if it ends before any output (an int write: no race)
                    stream.timing[r.request_id].prompt_tokens = len(self.engine.requests[r.request_id].prompt_ids)
                    self._engine_streams[r.request_id] = stream
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                for rid in added:
                    self.engine.abort(rid)
                    self._engine_streams.pop(rid, None)
                done.set_exception(e)
            else:
                done.set_result(None)

        self._open_streams.add(stream)
        self._streams_closed.clear()
        try:
            self._submit(add_all, done)
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:  # the client left while the add was queued: undo it (FIFO: abort runs after)
            self.abort(stream.request_ids)
            self._close(stream)
            raise
        except BaseException:
            self._close(stream)
            raise
        return stream

    def release(self, stream: RequestStream) -> None:
        """The handler is done with `stream`: abort what is still running (e.g. the client went away)."""
        if stream.unfinished:
            self.stats.requests_aborted += len(stream.unfinished)
            self.abort(list(stream.unfinished))
            stream.unfinished.clear()
        self._close(stream)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (on the engine thread, soon); each open stream gets a final StreamEnd. Never raises."""

        def abort_all() -> None:
            for rid in request_ids:
                self.engine.abort(rid)
                stream = self._engine_streams.pop(rid, None)
                if stream is not None:
                    self._post([(stream, StreamEnd(rid))])

        if request_ids and self.is_alive:
            try:
                self._submit(abort_all)
            except RuntimeError:  # the thread died meanwhile; its exit already ended every stream
                pass

    async def run_on_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            try:
                done.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

        self._submit(call, done)
        return await asyncio.wrap_future(done)

    def inflight_request_ids(self) -> set[str]:
        """Ids the engine thread still runs for some stream (a snapshot; safe from any thread)."""
        return set(list(self._engine_streams))

    def generation_tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` s (0 when idle)."""
        now = time.monotonic()
        samples = [(t, n) for t, n in list(self._gen_rate) if t >= now - window]
        if len(samples) < 2:
            return 0.0
        (t0, n0), (_, n1) = samples[0], samples[-1]
        return (n1 - n0) / max(now - t0, 1e-6)

    def _close(self, stream: RequestStream) -> None:
        self._open_streams.discard(stream)
        if not self._open_streams:
            self._streams_closed.set()

    def _submit(self, command: Callable[[], None], future: concurrent.futures.Future | None = None) -> None:
        with self._cond:
            if self._thread is None or self._dead:
                raise RuntimeError("the engine thread is not running")
            self._commands.append((command, future))
            self._cond.notify()

    def _deliver(self, items: list[tuple[RequestStream, Any]]) -> None:
        """Event loop side of `_post`: queue outputs on their streams and time them."""
        now = time.perf_counter()
        for stream, item in items:
            if isinstance(item, StreamEnd):
                if item.error is not None:
                    self.stats.engine_errors += 1
                self.stats.finish_reasons[item.finish_reason] += 1
                _log_request_end(item.request_id, stream.timing.get(item.request_id), item.finish_reason,
                                 item.error, now)
            else:
                timing = stream.timing.get(item.request_id)
                if timing is not None:
                    timing.prompt_tokens, timing.output_tokens = len(item.prompt_token_ids), len(item.token_ids)
                n_new = len(item.new_token_ids)
                if timing is not None and n_new:
                    if timing.first_token is None:
                        self.stats.ttft.observe(now - timing.arrival)
                        if n_new > 1:  # speculative steps may emit several tokens at once
                            self.stats.itl.observe(0.0, n_new - 1)
                    else:
                        self.stats.itl.observe((now - timing.last_token) / n_new, n_new)
                    timing.first_token = timing.first_token or now
                    timing.last_token = now
                if item.finished:
                    self.stats.finish_reasons[item.finish_reason or "stop"] += 1
                    if timing is not None:
                        self.stats.e2e.observe(now - timing.arrival)
                    _log_request_end(item.request_id, timing, item.finish_reason or "stop", None, now)
            stream.queue.put_nowait(item)

    # ------------------------------------------------------------ engine thread

    def _post(self, items: list[tuple[RequestStream, Any]]) -> None:
        if items:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _resolve(self, r: EngineRequest) -> tuple[str | list[int], Any, Any]:
        """(prompt, sampling params, the chat answer's OutputSpec or None) of a request."""
        prompt, params, chat_output = r.prompt, r.params, None
        if isinstance(prompt, ChatPrompt):
            prepared, params = prepare_chat(self.engine, prompt.messages, params, prompt.options)
            prompt, chat_output = prepared.token_ids, prepared.output
        if r.max_tokens_to_context:
            if isinstance(prompt, str):
                prompt = list(self.engine.tokenizer.encode(prompt))
            # at least 1, so a prompt that fills the context is refused by the engine's length check
            params = copy.copy(params)
            params.max_tokens = max(1, self.max_model_len - len(prompt))
        return prompt, params, chat_output

    def _run(self) -> None:
        why = "the engine thread stopped"
        try:
            self._loop_until_stopped()
        except BaseException as e:
            logger.exception("the engine thread died")
            why = f"engine error: {type(e).__name__}: {e}"  # e.g. which tensor-parallel rank died
            raise
        finally:
            # whatever ended the loop, no handler may wait forever: end every stream and queued command
            with self._cond:
                self._dead = True
                pending = list(self._commands)
                self._commands.clear()
            for _, future in pending:
                if future is not None and not future.done():
                    future.set_exception(RuntimeError("the engine thread is not running"))
            if not self._stopping:
                self.death_reason = why
            self._fail_all(None if self._stopping else why)

    def _loop_until_stopped(self) -> None:
        engine = self.engine
        failed_steps = 0
        self._snapshot_metrics()
        while True:
            with self._cond:
                while not self._commands and not self._stopping and not engine.has_unfinished():
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            for command, _ in commands:
                try:
                    command()
                except Exception:  # commands hand their own errors to their futures; this is a bug in one
                    logger.exception("engine command failed")
            if stopping:
                return
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                    failed_steps = 0
                except RankFailedError:  # a tensor-parallel rank is gone: nothing can serve any more
                    raise
                except Exception as e:  # noqa: BLE001 - keep serving; fail the requests in flight
                    failed_steps += 1
                    logger.error("engine step failed; aborting %d requests\n%s", len(self._engine_streams),
                                 traceback.format_exc())
                    self._fail_all(f"engine error: {type(e).__name__}: {e}")
                    if failed_steps >= 3:  # the engine is broken, not one request: stop (health turns 503)
                        raise
                    outputs = []
                items = []
                for out in outputs:
                    stream = self._engine_streams.get(out.request_id)
                    if stream is None:  # aborted meanwhile
                        continue
                    if out.finished:
                        del self._engine_streams[out.request_id]
                    items.append((stream, out))
                self._snapshot_metrics()  # before posting: a client that got its tokens sees them in /metrics
                self._post(items)
            else:
                self._snapshot_metrics()

    def _fail_all(self, error: str | None) -> None:
        """Abort every request a stream waits on; each stream gets a StreamEnd (with `error` unless None)."""
        items = []
        for rid, stream in self._engine_streams.items():
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", rid)
            items.append((stream, StreamEnd(rid, "abort", error)))
        self._engine_streams.clear()
        self._post(items)

    def _snapshot_metrics(self) -> None:
        try:
            m = self.engine.metrics()
        except Exception:  # noqa: BLE001 - metrics must never take the loop down
            logger.exception("engine.metrics() failed")
            return
        self.metrics_snapshot = m
        now = time.monotonic()
        sample = (now, getattr(m, "generation_tokens_total", 0))
        # keep samples >= 0.25 s apart, but always keep the newest one fresh
        if len(self._gen_rate) >= 2 and now - self._gen_rate[-2][0] < 0.25:
            self._gen_rate[-1] = sample
        else:
            self._gen_rate.append(sample)
