"""Engine: tokenizer + scheduler + runner + sampler (+ speculator), one step at a time; LLM: the Python API.

One step = one model forward chosen by the scheduler (see scheduler.py for
the policy). Every generated token, whether from a plain decode or several
accepted at once by the speculator, enters a request through
`Engine.append_tokens`, which checks stop conditions per token and drops
tokens after a stop.

Speculator seam (minidsa/speculative/mtp.py, built when speculative_num_steps > 0):
- `MTPSpeculator(runner, options, sampler)`, options from
  `resolve_spec_options(engine_config, model_config, page_size)`;
  `speculator.reserved_tokens` <= the engine's decode reserve (checked).
- `on_extend(reqs, batch, model_output, next_tokens)`: after every prefill
  forward (chunks too), before the sampled tokens are appended;
  `next_tokens[b]` is the token just sampled for a request whose prefill
  completed, None for a partial chunk.
- `decode(reqs) -> list[list[int]]`: replaces the plain decode forward;
  returns the accepted new tokens per request (>= 1 each) and advances
  `req.seq_len` by as many (root + accepted drafts are cached; checked).
  The engine then appends them through `append_tokens`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from minidsa.batch import ForwardMode
from minidsa.config import ConfigError, EngineConfig, ModelConfig
from minidsa.distributed.executor import make_runner
from minidsa.models.presets import DEFAULT_PRESET, PRESETS, is_preset, preset_config
from minidsa.prefix_cache import PrefixCache
from minidsa.request import (InvalidRequest, QueueFull, Request, RequestOutput, RequestStatus, SamplingParams,
                             Struct, now)
from minidsa.sampling import Sampler
from minidsa.scheduler import ScheduledBatch, Scheduler
from minidsa.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# Every live Engine (weakly), and the lists `track_engines` fills (strongly): the test suite checks every
# engine a test created for leaked KV after the test, even one the test no longer references.
_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_TRACKERS: list[list["Engine"]] = []


def live_engines() -> list["Engine"]:
    return list(_LIVE_ENGINES)


@contextlib.contextmanager
def track_engines() -> Iterator[list["Engine"]]:
    """Collects (and keeps alive) every Engine constructed inside the block."""
    created: list[Engine] = []
    _TRACKERS.append(created)
    try:
        yield created
    finally:  # by identity: nested trackers may hold equal lists
        del _TRACKERS[next(i for i, t in enumerate(_TRACKERS) if t is created)]


class EngineMetrics(Struct):
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    kv_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    preemptions_total: int
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_verify_steps_total: int = 0
    prefix_cache_query_tokens_total: int = 0  # prompt (+ recomputed) tokens looked up at admission
    prefix_cache_hit_tokens_total: int = 0  # of which were found in the cache and not prefilled
    prefix_cache_pages: int = 0  # pages the prefix cache holds now (shared or evictable)
    prefix_cache_tokens: int = 0  # the same in token slots


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """A validated copy with every "auto" replaced by what this machine gets."""
    cfg = dataclasses.replace(config, extra=dict(config.extra))
    cfg.validate()
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        on_gpu = torch.device(cfg.device).type == "cuda"
    except RuntimeError as e:
        raise ConfigError("device", f"'{cfg.device}' is not a torch device: {e}") from e
    if on_gpu and not torch.cuda.is_available():
        raise ConfigError("device", f"'{cfg.device}' asked for but CUDA is not available")
    if cfg.dtype == "auto":
        cfg.dtype = "bfloat16" if on_gpu else "float32"
    if cfg.page_size == 0:  # 64 = DeepGEMM's paged indexer block; tree drafts move single slots
        cfg.page_size = 64 if on_gpu and cfg.speculative_topk == 1 else 1
    if cfg.indexer_cache_dtype == "auto":
        cfg.indexer_cache_dtype = "fp8" if on_gpu else "model"
    return cfg


def decode_reserve_tokens(cfg: EngineConfig) -> int:
    """KV positions one decode step may write past a request's cached tokens: 1, or the speculator's
    draft / verify width (a chain of n steps verifies n + 1 tokens; a tree drafts steps * topk)."""
    if cfg.speculative_num_steps == 0:
        return 1
    steps, topk = cfg.speculative_num_steps, cfg.speculative_topk
    return max(steps * topk, cfg.speculative_num_draft_tokens or steps + 1)


def resolve_model(name: str | None) -> tuple[ModelConfig, str | None, float, str]:
    """(model config, checkpoint path or None for random weights, init std, served model name)."""
    name = name or DEFAULT_PRESET
    if is_preset(name):
        try:
            raw = preset_config(name)
        except ValueError as e:
            raise ConfigError("model", str(e)) from None
        return ModelConfig.from_dict(raw), None, float(raw.get("initializer_range", 0.02)), f"minidsa-{name}"
    if os.path.isdir(name):
        return ModelConfig.from_pretrained(name), name, 0.02, os.path.basename(os.path.normpath(name))
    raise ConfigError("model", f"'{name}' is neither a preset ({', '.join(PRESETS)}, optionally "
                      "NAME:LAYERS) nor a checkpoint directory")


class Engine:
    """Step-level engine. Used from one thread at a time (the server runs it in one background thread)."""

    def __init__(self, config: EngineConfig | None = None, progress: bool = True, **engine_args: Any):
        if config is None:
            config = make_engine_config(**engine_args)
        elif engine_args:
            config = dataclasses.replace(config, **engine_args)
        self.config = resolve_engine_config(config)
        cfg = self.config
        self.model_config, model_path, init_std, self.model_name = resolve_model(cfg.model)
        self._model_path = model_path
        self._tokenizer: Tokenizer | None = None  # loaded on first use: token-id workloads run without one
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids or self._tokenizer_eos())
        self.decode_reserve = decode_reserve_tokens(cfg)
        t0 = time.perf_counter()
        # tensor_parallel_size > 1: rank 0 of a group of processes (minidsa.distributed), same interface
        self.runner = make_runner(cfg, self.model_config, model_path, init_std, self.decode_reserve, progress)
        t_load = time.perf_counter()
        self.max_model_len: int = self.runner.max_model_len
        # With MTP speculation a page's last MTP slot depends on the token after the page: it is part of the key.
        self.prefix_cache = PrefixCache(self.runner.allocator, lookahead=1 if cfg.speculative_num_steps else 0) \
            if cfg.enable_prefix_caching else None
        self.scheduler = Scheduler(self.runner.allocator, self.runner.req_to_token_pool,
                                   max_running_requests=cfg.max_running_requests,
                                   max_prefill_tokens=cfg.max_prefill_tokens,
                                   chunked_prefill_size=cfg.chunked_prefill_size,
                                   decode_reserve=self.decode_reserve, prefix_cache=self.prefix_cache)
        self.sampler = Sampler(self.vocab_size, self.runner.device, cfg.seed)
        self.speculator = self._build_speculator()
        t_ready = time.perf_counter()
        self.runner.prepare_fast_paths(self.speculator.layout if self.speculator is not None else None)
        t_graphs = time.perf_counter()
        # Compilation happens during the graphs' warm-up calls: one figure for both.
        logger.info("start-up %.1f s: weights and KV cache %.1f s, engine %.1f s, compile + CUDA graph capture %.1f s",
                    t_graphs - t0, t_load - t0, t_ready - t_load, t_graphs - t_ready)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._pending: list[RequestOutput] = []  # abort outputs handed out by the next step()
        self._ids = itertools.count()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished_total = 0
        _LIVE_ENGINES.add(self)
        for created in _TRACKERS:
            created.append(self)

    def _build_speculator(self) -> Any:
        cfg = self.config
        if cfg.speculative_num_steps == 0 and cfg.speculative_num_draft_tokens == 0 and cfg.speculative_topk == 1:
            return None
        from minidsa.speculative.mtp import MTPSpeculator, resolve_spec_options

        options = resolve_spec_options(cfg, self.model_config, cfg.page_size)
        if options is None:
            return None
        speculator = MTPSpeculator(self.runner, options, self.sampler)
        if speculator.reserved_tokens > self.decode_reserve:
            raise RuntimeError(f"speculator needs {speculator.reserved_tokens} KV positions per decode step, "
                               f"the scheduler reserves {self.decode_reserve}")
        return speculator

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._model_path, self.config.tokenizer)
        return self._tokenizer

    def _tokenizer_eos(self) -> tuple[int, ...]:
        try:
            return self.tokenizer.eos_token_ids
        except (RuntimeError, OSError) as e:
            logger.warning("no eos token: config.json names none and the tokenizer is unavailable (%s)", e)
            return ()

    def __repr__(self) -> str:
        return (f"Engine(model={self.model_name!r}, device={self.config.device}, dtype={self.config.dtype}, "
                f"running={self.num_running()}, waiting={self.num_waiting()})")

    # -- requests -----------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, use_prefix_cache: bool = True) -> str:
        """Queue a request; raises InvalidRequest (nothing changed) when it cannot be served.

        `use_prefix_cache=False`: the request neither reuses cached KV pages nor adds its own (the baseline
        `minidsa bench --workload shared-prefix` measures beside the cached run)."""
        params = copy.copy(params) if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if self.speculator is not None:
            # the speculator's verify samples by its own rules: no logprobs and no penalties there (yet)
            for name, on in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs is not None),
                             ("presence_penalty", params.presence_penalty != 0.0),
                             ("frequency_penalty", params.frequency_penalty != 0.0),
                             ("repetition_penalty", params.repetition_penalty != 1.0)):
                if on:
                    raise InvalidRequest(f"SamplingParams.{name} is not supported with speculative decoding")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"SamplingParams.stop_token_ids {bad} are outside the vocabulary "
                                 f"(size {self.vocab_size})")
        if params.detokenize or isinstance(prompt, str):
            self.tokenizer  # noqa: B018 - fails here, before anything changed, if there is no tokenizer
        text = None
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequest("prompt is empty")
        out_of_vocab = [t for t in ids if not 0 <= t < self.vocab_size]
        if out_of_vocab:
            raise InvalidRequest(f"prompt token ids {out_of_vocab[:8]} are outside the vocabulary "
                                 f"(size {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt is too long: {len(ids)} tokens, max_model_len is {self.max_model_len} "
                                 f"(prompt + max_tokens must fit)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                                 f"{len(ids) + params.max_tokens} exceeds max_model_len {self.max_model_len}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}")
        elif request_id in self.requests:
            raise InvalidRequest(f"request_id '{request_id}' is already in use")
        if len(self.scheduler.waiting) >= self.config.max_queued_requests:
            raise QueueFull(f"queue full: {len(self.scheduler.waiting)} requests waiting "
                            f"(max_queued_requests {self.config.max_queued_requests})")
        if self._pending:  # an id reused right after its abort must not receive the old abort output
            self._pending = [o for o in self._pending if o.request_id != request_id]
        req = Request(request_id=request_id, prompt_ids=ids, params=params, prompt=text, arrival_time=now(),
                      use_prefix_cache=bool(use_prefix_cache))
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str, report: bool = True) -> bool:
        """Drop a request now and free its KV. With `report`, its final output (finish_reason "abort")
        comes with the next step(). False if the id is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req)
        req.finish_reason = "abort"
        self._finished_total += 1
        if report:
            self._pending.append(self._output(req, [], ""))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step; outputs of every request that got tokens or finished."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched is None:
            if self.requests and not self.scheduler.running:
                raise RuntimeError(f"scheduler made no progress with {len(self.requests)} requests waiting "
                                   f"and {self.runner.allocator.num_free_pages} free KV pages")
            return outputs
        if sched.mode == ForwardMode.EXTEND:
            produced = self._prefill(sched)
        else:
            produced = self._decode(sched)
        for req, new_ids, new_text in produced:
            outputs.append(self._output(req, new_ids, new_text))
            if req.finished:
                self._finished_total += 1
        return outputs

    def _prefill(self, sched: ScheduledBatch) -> list[tuple[Request, list[int], str]]:
        reqs = sched.reqs
        batch = self.runner.extend_batch(reqs, sched.extend_lens)
        out = self.runner.forward(batch)
        if any(r.params.prompt_logprobs is not None for r in reqs):
            self._score_prompts(reqs, sched.extend_lens, out.hidden)
        for req, n in zip(reqs, sched.extend_lens):
            req.seq_len += n
        complete = [i for i, r in enumerate(reqs) if not r.in_prefill]  # prefill complete: sample a token
        done = [i for i in complete if reqs[i].params.max_tokens > 0]  # max_tokens 0: the prompt scored, no token
        tokens: list[int] = []
        logprobs: list[float] | None = None
        tops: list[dict[int, float]] | None = None
        if done:
            rows = out.logits if len(done) == len(reqs) else out.logits[torch.tensor(done, device=out.logits.device)]
            tokens, logprobs, tops = self._sample(rows, [reqs[i] for i in done])
        if self.speculator is not None:
            next_tokens: list[int | None] = [None] * len(reqs)
            for j, i in enumerate(done):
                next_tokens[i] = tokens[j]
            self.speculator.on_extend(reqs, batch, out, next_tokens)
        produced = []
        for j, i in enumerate(done):
            req = reqs[i]
            if req.first_token_time is None:
                self._prompt_tokens_total += len(req.prompt_ids)
            new_ids, new_text = self.append_tokens(req, [tokens[j]], None if logprobs is None else [logprobs[j]],
                                                   None if tops is None else [tops[j]])
            produced.append((req, new_ids, new_text))
        for i in complete:
            if reqs[i].params.max_tokens == 0:
                self._prompt_tokens_total += len(reqs[i].prompt_ids)
                reqs[i].finish_reason = "length"
                produced.append((reqs[i], [], ""))
        self._release_finished(r for r, _, _ in produced)
        return produced

    def _score_prompts(self, reqs: list[Request], extend_lens: list[int], hidden: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens this prefill chunk predicts, for requests that asked.

        Position p's hidden state predicts prompt token p + 1. Positions scored before a preemption are not
        scored again when the request is prefilled anew (the scheduler skips the prefix cache for them)."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Request] = []
        offset = 0
        for req, n in zip(reqs, extend_lens):
            if req.params.prompt_logprobs is not None:
                if not req.prompt_logprobs:
                    req.prompt_logprobs, req.prompt_top_logprobs = [None], [None]
                first = len(req.prompt_logprobs) - 1  # the next position whose successor is unscored
                for p in range(max(req.seq_len, first), min(req.seq_len + n, len(req.prompt_ids) - 1)):
                    rows.append(offset + p - req.seq_len)
                    targets.append(req.prompt_ids[p + 1])
                    owners.append(req)
            offset += n
        if not rows:
            return
        k = max(r.params.prompt_logprobs for r in owners)
        values, tops = self.runner.token_logprobs(hidden, rows, targets, k)
        for req, v, top in zip(owners, values, tops):
            req.prompt_logprobs.append(v)
            req.prompt_top_logprobs.append(dict(list(top.items())[:req.params.prompt_logprobs]))

    def _decode(self, sched: ScheduledBatch) -> list[tuple[Request, list[int], str]]:
        reqs = sched.reqs
        logprobs: list[float] | None = None
        tops: list[dict[int, float]] | None = None
        if self.speculator is not None:
            before = [r.seq_len for r in reqs]
            new_tokens = self.speculator.decode(reqs)  # advances seq_len over the root + accepted drafts
            assert len(new_tokens) == len(reqs) and all(new_tokens), "speculator must return >= 1 token per request"
            for r, n, toks in zip(reqs, before, new_tokens):
                assert r.seq_len == n + len(toks), f"speculator left {r.request_id} with seq_len {r.seq_len}"
        else:
            out = self.runner.forward(self.runner.decode_batch(reqs))
            tokens, logprobs, tops = self._sample(out.logits, reqs)
            new_tokens = [[t] for t in tokens]
            for r in reqs:
                r.seq_len += 1  # the fed token is now cached
        produced = []
        for j, (req, toks) in enumerate(zip(reqs, new_tokens)):
            new_ids, new_text = self.append_tokens(req, toks, None if logprobs is None else [logprobs[j]],
                                                   None if tops is None else [tops[j]])
            produced.append((req, new_ids, new_text))
        self._release_finished(r for r, _, _ in produced)
        return produced

    def _sample(self, logits: torch.Tensor, reqs: list[Request]
                ) -> tuple[list[int], list[float] | None, list[dict[int, float]] | None]:
        """(token ids, their logprobs if any request asked, each row's top logprobs if any asked)."""
        params = [r.params for r in reqs]
        penalised = any(p.penalised for p in params)
        out = self.sampler(logits, params, [len(r.output_ids) for r in reqs],
                           [r.prompt_ids for r in reqs] if penalised else None,
                           [r.output_ids for r in reqs] if penalised else None)
        # The one host sync of the step: stop checks need the ids.
        tops = None
        if out.top_ids is not None:
            tops = [dict(zip(ids[:p.top_logprobs], lps[:p.top_logprobs]))
                    for p, ids, lps in zip(params, out.top_ids.tolist(), out.top_logprobs.tolist())]
        return out.ids.tolist(), None if out.logprobs is None else out.logprobs.tolist(), tops

    def _release_finished(self, reqs: Any) -> None:
        for req in reqs:
            if req.finish_reason is not None and req.status == RequestStatus.RUNNING:
                self.scheduler.finish(req)
                self.requests.pop(req.request_id, None)

    # -- tokens in ----------------------------------------------------------------
    def append_tokens(self, req: Request, tokens: list[int], logprobs: list[float] | None = None,
                      top_logprobs: list[dict[int, float]] | None = None) -> tuple[list[int], str]:
        """Append new tokens to a request, checking stop conditions after each one.

        Tokens after the one that stops the request (eos / stop token / stop string / max_tokens) are dropped.
        Returns (the ids kept, the text that became safe to hand out). Marks the request finished
        (finish_reason set) but does not free its KV: the step does that.
        """
        p = req.params
        kept: list[int] = []
        for i, tok in enumerate(tokens):
            req.output_ids.append(tok)
            kept.append(tok)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            if top_logprobs is not None:
                req.output_top_logprobs.append(top_logprobs[i])
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                req.finish_reason = "stop"
                break
            if p.detokenize and self._detokenize(req):
                req.finish_reason = "stop"
                break
            if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                req.finish_reason = "length"
                break
        self._generation_tokens_total += len(kept)
        if req.first_token_time is None and kept:
            req.first_token_time = now()
        # Hand out text up to where a stop string could still begin (all of it once finished).
        safe = len(req.text) if req.finish_reason else len(req.text) - _stop_prefix_len(req.text, p.stop)
        new_text = req.text[req.emitted:safe] if safe > req.emitted else ""
        req.emitted = min(max(req.emitted, safe), len(req.text))
        return kept, new_text

    def _detokenize(self, req: Request) -> bool:
        """Extend req.text by the last token's text; True if a stop string appeared (text is cut before it).

        Decodes a short window of recent ids and takes the difference, so multi-byte characters split
        across tokens appear once complete (a trailing U+FFFD means: wait for more bytes).
        """
        ids = req.output_ids
        prefix = self.tokenizer.decode(ids[req.prefix_offset:req.read_offset])
        full = self.tokenizer.decode(ids[req.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        start = len(req.text)
        req.text += full[len(prefix):]
        req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        stops = req.params.stop
        if not stops:
            return False
        window = max(0, start - max(len(s) for s in stops) + 1)
        hits = [i for i in (req.text.find(s, window) for s in stops) if i >= 0]
        if not hits:
            return False
        req.text = req.text[:min(hits)]
        return True

    def _output(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        finished = req.finish_reason is not None
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        # Prompt logprobs (as long as the prompt) go with the first output and the final one, not every step.
        with_prompt_logprobs = req.params.prompt_logprobs is not None and (finished or len(req.output_ids) <= 1)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            text=req.text[: req.emitted],
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=req.finish_reason,
            logprobs=list(req.output_logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.output_top_logprobs) if req.params.top_logprobs else None,
            prompt_logprobs=list(req.prompt_logprobs) if with_prompt_logprobs else None,
            prompt_top_logprobs=list(req.prompt_top_logprobs) if with_prompt_logprobs else None,
            ttft_s=ttft,
            prompt=req.prompt,
            num_preemptions=req.num_preemptions,
        )

    # -- introspection ------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        alloc = self.runner.allocator
        used = alloc.num_held_pages * alloc.page_size  # evictable cached pages are free for the taking
        total = alloc.num_usable_pages * alloc.page_size
        spec = getattr(self.speculator, "stats", None)
        return EngineMetrics(
            num_running=self.num_running(),
            num_waiting=self.num_waiting(),
            kv_used_tokens=used,
            kv_total_tokens=total,
            kv_usage=used / total if total else 0.0,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            requests_finished_total=self._finished_total,
            preemptions_total=self.scheduler.num_preemptions,
            spec_draft_tokens_total=getattr(spec, "draft_tokens", 0),
            spec_accepted_tokens_total=getattr(spec, "accepted_tokens", 0),
            spec_verify_steps_total=getattr(spec, "verify_steps", 0),
            prefix_cache_query_tokens_total=self.scheduler.cache_query_tokens,
            prefix_cache_hit_tokens_total=self.scheduler.cache_hit_tokens,
            prefix_cache_pages=alloc.num_cached_pages,
            prefix_cache_tokens=alloc.num_cached_pages * alloc.page_size,
        )

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave their process group (nothing to do in one process).
        They also stop when the engine is garbage collected or the interpreter exits."""
        close_ranks = getattr(self.runner, "close", None)  # only a DistributedModelRunner holds ranks
        if close_ranks is not None:
            close_ranks()

    def check_no_leaks(self) -> None:
        """AssertionError if KV pages or req_to_token rows are held by no running request, or a page's
        reference count is not the number of running requests holding it (prefix-cache pages aside)."""
        self.scheduler.check_consistent()
        if not self.requests:
            self.runner.check_all_free()


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string (text to hold back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def make_engine_config(model: str | None = None, **engine_args: Any) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_args) - names)
    if unknown:
        raise ConfigError(unknown[0], f"is not an engine argument (known: {', '.join(sorted(names))})")
    return EngineConfig(model=model, **engine_args)


class LLM:
    """Offline Python API: `LLM(model=path_or_preset, **engine_args).generate(prompts, SamplingParams(...))`.

    Synchronous (no event loop), so it works as is in a Jupyter notebook.
    """

    def __init__(self, model: str | None = None, progress: bool = True, **engine_args: Any):
        self.engine = Engine(make_engine_config(model, **engine_args), progress=progress)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def __repr__(self) -> str:
        return f"LLM({self.engine!r})"

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order."""
        batch = _as_prompt_list(prompts)
        if isinstance(params, list):
            if len(params) != len(batch):
                raise InvalidRequest(f"got {len(params)} SamplingParams for {len(batch)} prompts")
            plist = params
        else:
            plist = [params] * len(batch)
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, plist):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort(rid, report=False)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req")
        wanted = set(ids)
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # interrupted (KeyboardInterrupt in a notebook): free what is left
                if rid not in results:
                    self.engine.abort(rid, report=False)
        return [results[rid] for rid in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield an output each step the request produces tokens; the last one has finished=True.

        Closing the generator early aborts the request.
        """
        rid = self.engine.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid, report=False)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.engine.tokenizer.apply_chat_template(messages)], params)[0]


def _as_prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise InvalidRequest(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
