"""Engine: the control plane. Requests in (add / abort), one step at a time, outputs out.

A step: the scheduler decides which requests run (sched/scheduler.py); the engine turns that into a `StepPlan`
(plain data: rows, positions, input tokens, sampling parameters, page-table writes; common/plan.py) and
hands it to the `Worker` (exec/worker.py), the only owner of device state, which returns a `StepResult`
(tokens, logprobs). The tokens enter their requests through the `OutputProcessor` (outputs.py: stop
conditions, detokenising, RequestOutput). Which KV pages and req_to_token rows are free is host bookkeeping
(sched/pages.py): the engine builds the allocators from the capacity the worker reports and hands them to the
scheduler and the prefix cache; the worker owns the memory they address.

Overlapped scheduling (`EngineConfig.overlap_schedule`, on by default): `step()` plans and launches step
N+1 *before* it waits for step N's tokens, then processes them while the device runs N+1. A decode row's
input token is the one the worker sampled for it, kept on the device, so planning needs no token from the
host. Stops stay exact: a request that stopped in step N may already be planned into step N+1; its token
from N+1 is dropped (its KV was freed once, when step N's result finished it). Tokens a step plans past
max_tokens are never planned (`Request.all_tokens_planned`). Outputs come one step later than without
overlap. Steps run without overlap (the previous step's tokens are processed first) when the plan needs
host data the in-flight step has not delivered: speculative rounds (the speculator builds trees on the
host) and requests with presence / frequency / repetition penalties (they need every output id).

Structured outputs (`SamplingParams.response_format`, minidsa/chat/grammar.py) keep the overlap: step N+1's
grammar masks depend on step N's tokens, so a step with grammar rows launches in two halves. `step()` launches
N+1's forward, takes step N's tokens (each constrained request's grammar accepts its token; a grammar that
accepted the end-of-sequence token after a complete value finishes the request, finish_reason "stop"), fills
N+1's masks on the host and launches N+1's sampling. The device runs N+1's forward meanwhile. Steps without
grammar rows launch as before. Masks only touch sampling: prefix caching, preemption (a grammar follows the
request's output ids, not its KV) and chunked prefill are unaffected. In a speculative round a constrained request
takes no draft: its token is sampled under its mask from the verify's first position (mtp.SpecRows.constrained).

Data-parallel attention (`--enable-dp-attention`, minidsa/parallel/dp_attention.py): the engine keeps one scheduler,
allocator pair and prefix cache per attention rank (`attention_ranks.py`; `self.scheduler` and the allocators are
rank 0's, the only ones without it). A new request goes to one rank (`place`) and stays there. A step asks every
rank's scheduler for its batch and launches the plans together (`DPStepPlan`, a rank without work gets None, with
the step's forwards and the graphs every rank replays: `DPAttentionWorker.dp_step`); each rank's part of the result
is processed as a step of its own. Such steps never overlap (`config.resolve` turns overlap off), so a rank's
grammar masks are made when its plan is (every earlier token is in the grammars) and travel with it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from minidsa.chat.grammar import GrammarState, StructuredOutputs, parse_response_format
from minidsa.common.kv_cache import CacheLayouts
from minidsa.common.plan import PromptScoring, StepKind, StepPlan
from minidsa.common.request import (
    InvalidRequest,
    QueueFull,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    Struct,
    now,
)
from minidsa.common.sampling import Sampler
from minidsa.common.tokenizer import Tokenizer, load_tokenizer
from minidsa.config import ConfigError, EngineConfig, make_engine_config, resolve
from minidsa.engine.attention_ranks import AttentionRank, place
from minidsa.engine.outputs import OutputProcessor
from minidsa.exec.build import choose_kernels, start_local_worker
from minidsa.exec.memory import check_fit
from minidsa.exec.runner import ModelRunner
from minidsa.exec.worker import PendingStep, Worker
from minidsa.parallel.dp_attention import DPAttentionWorker, DPPendingStep
from minidsa.parallel.ranks import TensorParallelWorker, start_parallel_worker
from minidsa.sched.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)
startup_logger = logging.getLogger("minidsa.exec.startup")


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
    spec_simulated_accept_len: float = 0.0  # benchmarks: the simulated tokens per round (0 = the model's own)
    prefix_cache_query_tokens_total: int = 0  # prompt (+ recomputed) tokens looked up at admission
    prefix_cache_hit_tokens_total: int = 0  # of which were found in the cache and not prefilled
    prefix_cache_pages: int = 0  # pages the prefix cache holds now (shared or evictable)
    prefix_cache_tokens: int = 0  # the same in token slots


@dataclass
class _InFlight:
    """A launched step and what the control plane needs to process its result."""

    plan: StepPlan
    reqs: list[Request]
    completes: list[bool]  # the step completes the request's prefill (or is a decode row)
    pending: PendingStep

    @property
    def awaits_mask(self) -> bool:
        return bool(self.plan.grammar_rows)


class _RankResult:
    """One attention rank's part of a DP step: its result comes with every rank's (`DPPendingStep.results`)."""

    def __init__(self, step: DPPendingStep, rank: int):
        self._step, self._rank = step, rank

    def result(self):
        return self._step.results()[self._rank]


@dataclass
class _DPInFlight:
    """A launched DP-attention step: each busy rank's part, processed as a step of its own (`Engine._finish`)."""

    parts: list[_InFlight]
    awaits_mask = False


class Engine:
    """Step-level engine. Used from one thread at a time (the server runs it in one background thread)."""

    def __init__(self, config: EngineConfig | None = None, progress: bool = True, **engine_args: Any):
        if config is None:
            config = make_engine_config(**engine_args)
        elif engine_args:
            config = dataclasses.replace(config, **engine_args)
        # Every "auto" decided and every argument checked here, once, before any weight or rank process exists.
        self.config = resolved = resolve(config)
        kernels = choose_kernels(resolved)
        cfg, self.model_config, self.model_name = resolved.args, resolved.model, resolved.served_model_name
        self._model_path = resolved.model_path
        self._tokenizer: Tokenizer | None = None  # loaded on first use: token-id workloads run without one
        self.vocab_size = self.model_config.vocab_size
        try:
            layouts = CacheLayouts.for_model(self.model_config, resolved.dtype, cfg.kv_cache_dtype,
                                             cfg.indexer_cache_dtype == "fp8", cfg.page_size)
        except ValueError as e:
            raise ConfigError("kv_cache_dtype", str(e)) from e
        # Before any weight is allocated (and before tensor-parallel ranks start): one line if it cannot fit.
        check_fit(resolved, layouts.bytes_per_token)
        t0 = time.perf_counter()
        startup_logger.info("start-up: %s on %s (%s); one line per phase follows", self.model_name, cfg.device,
                            cfg.dtype)
        # One process, or a rank of a tensor-parallel group (rank 0 starts the others; under torchrun every rank
        # builds an Engine and ranks > 0 follow rank 0's plans: `follow`)
        # Data-parallel attention: one attention rank per process, each with its own requests and KV cache
        self.dp_attention = cfg.enable_dp_attention
        driver = DPAttentionWorker if self.dp_attention else TensorParallelWorker
        self.worker: Worker = start_parallel_worker(resolved, kernels, progress, driver) if cfg.distributed \
            else start_local_worker(resolved, kernels, progress)
        self.is_driver = self.worker.is_driver
        runner, speculator = self.worker.runner, self.worker.speculator
        self.max_model_len: int = runner.max_model_len
        if not self.is_driver:  # the same capture as rank 0's, then nothing until `follow`
            self.worker.prepare_fast_paths()
            return
        eos_token_ids = frozenset(self.model_config.eos_token_ids or self._tokenizer_eos())
        try:  # a failure from here on must not leave tensor-parallel ranks behind
            # The host-side bookkeeping of the worker's KV memory: which pages and req_to_token rows are free. One
            # set (scheduler, allocators, prefix cache) per attention rank: one, or N under DP attention (each rank
            # has its own KV cache of the capacity the ranks agreed on).
            capacity = self.worker.kv_capacity
            # The speculator verifies pure decode batches: with it, prefill and decode steps alternate.
            self.mixed_steps = cfg.enable_mixed_chunk and speculator is None
            self.attention_ranks = [
                AttentionRank.build(r, capacity, cfg.enable_prefix_caching, lookahead=1 if resolved.spec else 0,
                                    max_running_requests=cfg.max_running_requests,
                                    max_prefill_tokens=cfg.max_prefill_tokens,
                                    max_mixed_prefill_tokens=cfg.max_mixed_prefill_tokens,
                                    chunked_prefill_size=cfg.chunked_prefill_size,
                                    decode_reserve=resolved.decode_reserve, mixed=self.mixed_steps)
                for r in range(cfg.tensor_parallel_size if self.dp_attention else 1)]
            # Attention rank 0's (the only one without DP attention)
            first = self.attention_ranks[0]
            self.page_allocator, self.row_allocator = first.page_allocator, first.row_allocator
            self.prefix_cache, self.scheduler = first.prefix_cache, first.scheduler
            self.worker.prepare_fast_paths()
        except BaseException:
            self.worker.close()
            raise
        t_graphs = time.perf_counter()
        # Each phase logged its own line (minidsa/exec/startup.py); this is the total, phase by phase.
        startup_logger.info("%s", runner.startup.summary(t_graphs - t0))
        self.outputs = OutputProcessor(lambda: self.tokenizer, eos_token_ids, self.max_model_len)
        # Speculative rounds need the previous round's tokens on the host: no overlap with them.
        self.overlap = cfg.overlap_schedule and speculator is None
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._pending: list[RequestOutput] = []  # abort outputs handed out by the next step()
        self._in_flight: _InFlight | None = None
        self._structured: StructuredOutputs | None = None  # built by the first request with a response_format
        self._ids = itertools.count()
        self._prompt_tokens_total = 0
        self._finished_total = 0
        # Speculative rounds, counted from their results (under DP attention each rank's speculator sees its own)
        self._spec_rounds = self._spec_drafted = self._spec_accepted = 0

    def follow(self) -> None:
        """A tensor-parallel rank > 0 under torchrun: run rank 0's steps until its engine closes, then leave the
        process group. Rank 0's engine (`is_driver`) runs the requests; this is the other ranks' part."""
        if self.is_driver:
            raise RuntimeError("follow() is for tensor-parallel ranks > 0; this engine runs the control plane")
        self.worker.follow()

    @property
    def decode_reserve(self) -> int:
        return self.config.decode_reserve

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.outputs.eos_token_ids

    @property
    def runner(self) -> ModelRunner:
        return self.worker.runner

    @property
    def speculator(self) -> Any:
        return self.worker.speculator

    @property
    def sampler(self) -> Sampler:
        return self.worker.sampler

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave their process group (nothing to do in one process).
        They also stop when the engine is garbage collected or the interpreter exits."""
        self.worker.close()

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._model_path, self.config.args.tokenizer)
        return self._tokenizer

    def _tokenizer_eos(self) -> tuple[int, ...]:
        try:
            return self.tokenizer.eos_token_ids
        except (RuntimeError, OSError) as e:
            logger.warning("no eos token: config.json names none and the tokenizer is unavailable (%s)", e)
            return ()

    def __repr__(self) -> str:
        return (f"Engine(model={self.model_name!r}, device={self.config.args.device}, dtype={self.config.args.dtype}, "
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
        grammar = self._grammar_state(params)
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
        if self.num_waiting() >= self.config.args.max_queued_requests:
            raise QueueFull(f"queue full: {self.num_waiting()} requests waiting "
                            f"(max_queued_requests {self.config.args.max_queued_requests})")
        if self._pending:  # an id reused right after its abort must not receive the old abort output
            self._pending = [o for o in self._pending if o.request_id != request_id]
        req = Request(request_id=request_id, prompt_ids=ids, params=params, prompt=text, arrival_time=now(),
                      use_prefix_cache=bool(use_prefix_cache), grammar=grammar)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_top_logprobs = [None], [None]  # the first prompt token has none
        self.requests[request_id] = req
        # the attention rank it lives on (the only one without DP attention): where its prefix is cached, unless that
        # rank runs an eighth of a rank's batch more than the least loaded one
        rank = place(self.attention_ranks, ids if req.use_prefix_cache else None,
                     load_gap=max(1, self.config.args.max_running_requests // 8))
        req.attention_rank = rank.rank
        rank.scheduler.add(req)
        return request_id

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """The grammar a request's response_format asks for, at its start (None: unconstrained); InvalidRequest if
        it cannot be served. Compiling a new schema takes ~0.1 s; the first one also builds the vocabulary (~1 s)."""
        after = params.structured_after_token_id
        if after is not None and (not isinstance(after, int) or isinstance(after, bool)
                                  or not 0 <= after < self.vocab_size):
            raise InvalidRequest(f"SamplingParams.structured_after_token_id must be a token id in [0, "
                                 f"{self.vocab_size}), got {after!r}")
        fmt = parse_response_format(params.response_format)
        if fmt is None:
            return None
        if self._structured is None:
            try:
                tokenizer = self.tokenizer
            except (RuntimeError, OSError) as e:
                raise InvalidRequest(f"structured outputs need the model's tokenizer: {e}") from None
            self._structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids,
                                                 fill_threads=self.config.grammar_threads)
        return self._structured.new_state(fmt, after)

    def abort(self, request_id: str, report: bool = True) -> bool:
        """Drop a request now and free its KV. With `report`, its final output (finish_reason "abort")
        comes with the next step(). False if the id is unknown or already finished.

        A step in flight may still compute a token for it: that token is dropped (the request is finished),
        and the freed pages are only written by steps launched after it."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.attention_ranks[req.attention_rank].scheduler.abort(req)
        req.finish_reason = "abort"
        self._finished_total += 1
        if report:
            self._pending.append(self.outputs.make_output(req, [], ""))
        return True

    def has_unfinished(self) -> bool:
        # A step still in flight once every request is finished holds only tokens that will be dropped.
        return bool(self.requests) or bool(self._pending)

    def num_running(self) -> int:
        return sum(len(r.scheduler.running) for r in self.attention_ranks)

    def num_waiting(self) -> int:
        return sum(len(r.scheduler.waiting) for r in self.attention_ranks)

    # -- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and launch the next step; return the outputs of the previous one (overlap) or of this one.

        Outputs: every request that got tokens or finished (and aborts since the last call)."""
        outputs, self._pending = self._pending, []
        if self._in_flight is not None and not self._can_overlap():
            outputs += self._finish(self._take_in_flight())
        previous = self._take_in_flight()
        launched = self._launch_next()
        if previous is not None:  # the device runs `launched` meanwhile
            outputs += self._finish(previous)
        if launched is not None and launched.awaits_mask:  # its masks needed the tokens just taken
            self._launch_sampling(launched)
        if launched is not None:
            if self.overlap and self._can_overlap():
                self._in_flight = launched
            else:
                outputs += self._finish(launched)
        elif previous is None and self.requests and not self.num_running():
            free = sum(r.page_allocator.num_free_pages for r in self.attention_ranks)
            raise RuntimeError(f"scheduler made no progress with {len(self.requests)} requests waiting "
                               f"and {free} free KV pages")
        return outputs

    def _take_in_flight(self) -> _InFlight | None:
        step, self._in_flight = self._in_flight, None
        return step

    def _can_overlap(self) -> bool:
        """Planning the next step needs nothing the in-flight step has not delivered to the host."""
        return self.overlap and not any(r.params.penalised for r in self.requests.values())

    def _launch_next(self) -> _InFlight | _DPInFlight | None:
        if self.dp_attention:
            return self._launch_next_dp()
        sched = self.scheduler.schedule()
        if sched is None:
            return None
        plan, completes = self._plan(sched, self.scheduler)
        return _InFlight(plan, list(sched.reqs), completes, self.worker.launch(plan))

    def _launch_next_dp(self) -> _DPInFlight | None:
        """DP attention: every attention rank's scheduler plans its own requests; one step runs all the plans in
        lockstep (a rank with none runs an idle token). None when no rank has anything to run."""
        plans: list[StepPlan | None] = []
        masks: list[Any] = []  # each rank's grammar bitmask (host), or None
        parts: list[tuple[int, StepPlan, list[Request], list[bool]]] = []
        for rank in self.attention_ranks:
            sched = rank.scheduler.schedule()
            if sched is None:
                plans.append(None)
                masks.append(None)
                continue
            plan, completes = self._plan(sched, rank.scheduler)
            plans.append(plan)
            # No overlap under DP attention: every earlier step's tokens are in the grammars already, so a rank's
            # masks travel with its plan
            masks.append(self._grammar_bitmask(plan, sched.reqs) if plan.grammar_rows else None)
            parts.append((rank.rank, plan, list(sched.reqs), completes))
        if not parts:
            return None
        pending = self.worker.launch_dp(self.worker.dp_step(plans, masks))
        return _DPInFlight([_InFlight(plan, reqs, completes, _RankResult(pending, r))  # type: ignore[arg-type]
                            for r, plan, reqs, completes in parts])

    def _launch_sampling(self, step: _InFlight) -> None:
        """The sampling half of a step with grammar rows: their masks, from the grammars as they stand now (every
        earlier step's tokens accepted). A request that finished since the step was planned gets no mask (its
        token will be dropped)."""
        self.worker.launch_sampling(step.pending, self._grammar_bitmask(step.plan, step.reqs))

    def _grammar_bitmask(self, plan: StepPlan, reqs: list[Request]) -> Any:
        """The bitmask of a plan's grammar rows (host, `Worker.mask_buffer`), from the grammars as they stand now."""
        rows = plan.grammar_rows
        bitmask = self.worker.mask_buffer(len(rows))
        self._structured.fill_bitmask([reqs[b].grammar if reqs[b].finish_reason is None else None for b in rows],
                                      bitmask)
        return bitmask

    def _plan(self, sched: ScheduledBatch, scheduler: Scheduler) -> tuple[StepPlan, list[bool]]:
        """The step plan of a scheduled batch; advances each request's planned state (seq_len, num_pending)."""
        reqs = sched.reqs
        spec = self.speculator is not None and sched.kind == StepKind.DECODE
        input_ids: list[int] = []
        from_device, sample, positions, completes = [], [], [], []
        scoring: list[PromptScoring | None] = []
        lookahead: list[int | None] = []
        for b, (r, n) in enumerate(zip(reqs, sched.extend_lens)):
            decode_row = b < sched.num_decode
            complete = decode_row or r.seq_len + n >= r.prefill_len
            completes.append(complete)
            from_device.append(decode_row and not spec)
            sample.append(complete and not spec and r.params.max_tokens > 0)
            positions.append(len(r.output_ids) + r.num_pending)
            if not decode_row:
                input_ids += r.token_slice(r.seq_len, r.seq_len + n)
                lookahead.append(r.token_slice(r.seq_len + n, r.seq_len + n + 1)[0]
                                 if r.seq_len + n < r.num_tokens else None)
            else:
                lookahead.append(None)
            scoring.append(self._prompt_scoring(r, n) if not decode_row else None)
        plan = StepPlan(
            kind=StepKind.SPEC if spec else sched.kind, rows=[r.row for r in reqs], prefix_lens=[r.seq_len for r in reqs],
            extend_lens=list(sched.extend_lens), input_ids=input_ids, from_device=from_device, sample=sample,
            params=[r.params for r in reqs], output_positions=positions,
            table_writes=scheduler.take_table_writes(), request_ids=[r.request_id for r in reqs],
            penalty_context=([(r.prompt_ids, list(r.output_ids)) if r.params.penalised else None for r in reqs]
                             if any(r.params.penalised for r in reqs) else None),
            prompt_scoring=scoring if any(s is not None for s in scoring) else None,
            spec_roots=[r.last_token for r in reqs] if spec else None,
            spec_lookahead=lookahead if self.speculator is not None and not spec else None,
            grammar_rows=[b for b, (r, s) in enumerate(zip(reqs, sample))
                          if (s or spec) and r.grammar is not None] or None)
        for r, n, s in zip(reqs, sched.extend_lens, sample):
            if spec:
                r.num_pending += 1  # the round's tokens (>= 1): seq_len advances when they arrive
                continue
            r.seq_len += n  # cached by the time any later step reads them
            r.num_pending += s
        return plan, completes

    @staticmethod
    def _prompt_scoring(req: Request, n: int) -> PromptScoring | None:
        """Prompt positions of this chunk whose successors are not scored yet (none twice after a preemption)."""
        if req.params.prompt_logprobs is None:
            return None
        first = max(req.seq_len, req.prompt_scored)
        end = min(req.seq_len + n, len(req.prompt_ids) - 1)
        req.prompt_scored = max(req.prompt_scored, end)
        targets = tuple(req.prompt_ids[first + 1:end + 1]) if end > first else ()
        return PromptScoring(first - req.seq_len, targets, req.params.prompt_logprobs)

    def _finish(self, step: _InFlight | _DPInFlight) -> list[RequestOutput]:
        """Take a launched step's result: tokens into their requests, finished requests freed."""
        if isinstance(step, _DPInFlight):  # each attention rank's part, in rank order
            return [out for part in step.parts for out in self._finish(part)]
        result = step.pending.result()
        plan = step.plan
        outputs: list[RequestOutput] = []
        if plan.kind == StepKind.SPEC:  # a round yields its accepted drafts + 1 per request
            self._spec_rounds += plan.batch_size
            self._spec_drafted += plan.batch_size * (self.speculator.opts.num_draft_tokens - 1)
            self._spec_accepted += sum(len(toks) - 1 for toks in result.tokens)
        for b, req in enumerate(step.reqs):
            toks = result.tokens[b]
            if plan.sample[b] or plan.kind == StepKind.SPEC:
                req.num_pending -= 1
            if plan.kind == StepKind.SPEC and req.status == RequestStatus.RUNNING:
                req.seq_len += len(toks)  # the root and the accepted drafts are cached
            if req.finish_reason is not None:
                continue  # stopped in an earlier step, or aborted, after this step was planned: dropped
            if result.prompt_logprobs is not None and result.prompt_logprobs[b] is not None:
                values, tops = result.prompt_logprobs[b]
                req.prompt_logprobs += values
                req.prompt_top_logprobs += tops
            if toks:
                if req.first_token_time is None:
                    self._prompt_tokens_total += len(req.prompt_ids)
                kept, text = self.outputs.append_tokens(
                    req, toks, None if result.logprobs is None else result.logprobs[b],
                    None if result.top_logprobs is None else result.top_logprobs[b])
                if req.grammar is not None and kept:
                    text += self._advance_grammar(req, kept)
                outputs.append(self.outputs.make_output(req, kept, text))
            elif step.completes[b] and req.params.max_tokens == 0:  # the prompt scored, no token wanted
                self._prompt_tokens_total += len(req.prompt_ids)
                req.finish_reason = "length"
                outputs.append(self.outputs.make_output(req, [], ""))
            if req.finish_reason is not None:
                self._retire(req)
        return outputs

    def _advance_grammar(self, req: Request, tokens: list[int]) -> str:
        """A constrained request's new tokens into its grammar. Returns the text it still held back when the
        grammar ends it."""
        left = req.grammar.accept(tokens) < len(tokens)
        if left:  # its masks allow only what the grammar accepts: an engine bug. End this request, serve the others
            logger.error("request %s: generated tokens %s leave its grammar; it ends (abort)", req.request_id, tokens)
        if req.finish_reason is not None:
            return ""
        if left:
            req.finish_reason = "abort"
        elif req.grammar.terminated:
            req.finish_reason = "stop"  # the value is complete and its end token came (ignore_eos or not)
        else:
            return ""
        rest = req.text[req.emitted:]
        req.emitted = len(req.text)
        return rest

    def _retire(self, req: Request) -> None:
        """A request finished: free its KV now (exactly once; later steps' tokens for it are dropped)."""
        scheduler = self.attention_ranks[req.attention_rank].scheduler
        if req.status == RequestStatus.RUNNING:
            scheduler.finish(req)
        elif req.status == RequestStatus.WAITING:  # preempted while its last token was in flight
            scheduler.abort(req)
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
        self._finished_total += 1

    # -- introspection ------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        """Totals over the attention ranks (one, or N under DP attention: N KV caches)."""
        allocs = [r.page_allocator for r in self.attention_ranks]
        page_size = allocs[0].page_size
        used = sum(a.num_held_pages for a in allocs) * page_size  # evictable cached pages are free for the taking
        total = sum(a.num_usable_pages for a in allocs) * page_size
        cached = sum(a.num_cached_pages for a in allocs)
        scheds = [r.scheduler for r in self.attention_ranks]
        return EngineMetrics(
            num_running=self.num_running(),
            num_waiting=self.num_waiting(),
            kv_used_tokens=used,
            kv_total_tokens=total,
            kv_usage=used / total if total else 0.0,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self.outputs.generation_tokens_total,
            requests_finished_total=self._finished_total,
            preemptions_total=sum(s.num_preemptions for s in scheds),
            spec_draft_tokens_total=self._spec_drafted,
            spec_accepted_tokens_total=self._spec_accepted,
            spec_verify_steps_total=self._spec_rounds,
            spec_simulated_accept_len=sim.accept_len if (sim := getattr(self.speculator, "simulator", None)) else 0.0,
            prefix_cache_query_tokens_total=sum(s.cache_query_tokens for s in scheds),
            prefix_cache_hit_tokens_total=sum(s.cache_hit_tokens for s in scheds),
            prefix_cache_pages=cached,
            prefix_cache_tokens=cached * page_size,
        )

    def check_no_leaks(self) -> None:
        """AssertionError if KV pages or req_to_token rows are held by no running request, or a page's
        reference count is not the number of running requests holding it (prefix-cache pages aside). Every
        attention rank's (DP attention: each rank's KV cache)."""
        for rank in self.attention_ranks:
            rank.check_no_leaks(idle=not self.requests)



