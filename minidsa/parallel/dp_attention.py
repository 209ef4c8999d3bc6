"""Data-parallel attention (`--enable-dp-attention` with `--tp N`): the ranks' side.

Under tensor parallelism every rank runs every request (MLA has one KV head, so each holds the whole latent cache
and runs the whole indexer). Under DP attention each rank is an attention rank of its own: it holds attention, the
indexer, embeddings, dense MLPs, shared experts and lm_head whole, and its own KV cache, and runs only the requests
rank 0's engine placed on it. The ranks' tokens meet in each MoE layer, where the routed experts are placed whole,
`n_routed_experts / N` per rank (`models.deepseek_v32.MoE._forward_dp`: all-gather of the rows, router, this rank's
experts, reduce-scatter).

A step is one `DPStepPlan`: a `StepPlan` per rank, None for a rank with nothing to run. Rank 0 broadcasts it over the
control group (the same `PlanChannel` as TP's plans), every rank runs its own plan (an idle rank runs one token at
the dummy slot 0, so its MoE layers join the others' collectives in the same order), and each rank's `StepResult`
comes back to rank 0 through one gather over the control group (`ResultChannel`). Every rank knows every rank's
token count from the plan (`DPStepPlan.forwards`): each forward's batch carries them (`ForwardBatch.dp_tokens`) for
the MoE exchange.

Steps run in lockstep: no overlap scheduling (a rank's tokens reach rank 0 after its step; `config.resolve` turns it
off), so rank 0 makes a rank's grammar masks with its plan and they travel in the step (`DPStepPlan.masks`).

Speculative decoding (MTP chains): a step may run several forwards per rank, of the main model or of the MTP layer,
and every rank must join every one of them, in the same order. A speculative round is `num_steps - 1` draft forwards
of the MTP layer, the verify forward, then the draft extend (MTP); a prefill step under speculation is the main
forward, then the MTP layer's catch-up over the chunk. Rank 0 lays out the step's forwards (`step_forwards`): each
rank's own (`rank_forwards`, from its plan alone) fitted in order into one template, with every rank's token count
per forward. On each rank (`DPModelRunner`) a forward of its own takes the next slot of its kind; a slot it has
nothing for (a prefilling rank beside a speculating one, an idle rank) it joins with one dummy token.

CUDA graphs: every rank captures the same decode-like graphs (DECODE, or the speculative round's DRAFT, VERIFY and
DRAFT_EXTEND; the same batch buckets, in the same order, at the same point: `prepare_fast_paths` under the group's
guard), whose MoE exchanges are bucket x N rows. Each step rank 0 decides for all ranks (`step_graph`, carried in
`DPStepPlan.graph`): when every busy rank decodes, or every busy rank runs a speculative round, and the largest batch
fits a bucket, every rank replays each forward's graph at that one bucket (an idle rank with padding rows only);
otherwise every rank runs uncaptured (torch.compile's layer on a GPU), padded to the step's most rows. Prefill
chunks and mixed steps never run as graphs under DP attention (no EXTEND graph is captured). With two-batch overlap
a main-model forward of enough tokens runs its MoE layers as two micro-batches (models/two_batch.py): a graph as it
was captured (every rank captures the same graphs, so every rank splits alike), an uncaptured forward as rank 0 laid
it out for every rank (`DPStepPlan.two_batches`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minidsa.attention.select import KernelChoice
from minidsa.common.batch import ForwardBatch
from minidsa.common.plan import StepKind, StepPlan, StepResult
from minidsa.config import ResolvedConfig, SpecOptions
from minidsa.exec.graphs import StepGraphs
from minidsa.exec.worker import PendingStep, Worker
from minidsa.parallel.channel import PlanChannel, ResultChannel
from minidsa.parallel.launch import RankGroup
from minidsa.parallel.ranks import (RankModelRunner, RankWorker, TensorParallelWorker, build_rank_worker,
                                    serve_plans)

if TYPE_CHECKING:
    from minidsa.models.deepseek_v32 import ModelOutput


@dataclass(frozen=True)
class DPStepPlan:
    """One lockstep step of every attention rank: `plans[r]` is rank r's plan, None where rank r is idle.

    `graph`: the (batch-size bucket, context bucket) of the graphs every rank replays this step (an idle rank
    too, with padding rows only), chosen by rank 0 for all of them (`step_graph`); None: every rank runs
    uncaptured. A rank never picks its own: the graph's MoE exchanges are bucket x N rows, on every rank alike."""

    plans: list[StepPlan | None]
    graph: tuple[int, int] | None = None
    # The step's forwards in order, every rank joining each: (the slot's kind, each rank's tokens). See
    # `step_forwards`.
    forwards: tuple[tuple[StepKind, tuple[int, ...]], ...] = ()
    # Per rank, the grammar bitmask of its plan's grammar rows (host int32, `Worker.mask_buffer`), or None
    masks: tuple[torch.Tensor | None, ...] | None = None
    # Two-batch overlap of an uncaptured step: every rank's first micro-batch (tokens) of the step's main-model
    # forward (`step_two_batches`); None: it runs whole (a graph splits as it was captured)
    two_batches: tuple[int, ...] | None = None


def rank_forwards(plan: StepPlan | None, spec: SpecOptions | None) -> list[tuple[StepKind, int]]:
    """The forwards a rank's plan runs, in order: (batch kind, tokens). From the plan alone, as the worker and the
    speculator build their batches: a speculative round (chains) is `num_steps - 1` one-token DRAFT forwards, the
    VERIFY and the DRAFT_EXTEND over `num_draft_tokens` per request; under speculation a prefill step's MTP catch-up
    (DRAFT_EXTEND) runs each chunk shifted by one token, plus the token after it where one is known
    (`MTPSpeculator.on_extend`)."""
    if plan is None:
        return []
    if plan.kind == StepKind.SPEC:
        bs, nd = plan.batch_size, spec.num_draft_tokens
        return [(StepKind.DRAFT, bs)] * (spec.num_steps - 1) + [(StepKind.VERIFY, bs * nd),
                                                                  (StepKind.DRAFT_EXTEND, bs * nd)]
    forwards = [(plan.kind, plan.num_tokens)]
    if spec is not None and plan.kind == StepKind.EXTEND:
        known = plan.spec_lookahead
        caught_up = sum(n - 1 + bool(plan.sample[b] or (known is not None and known[b] is not None))
                        for b, n in enumerate(plan.extend_lens))
        if caught_up:
            forwards.append((StepKind.DRAFT_EXTEND, caught_up))
    return forwards


def _fits(slot: StepKind | None, kind: StepKind) -> bool:
    """A forward of `kind` takes a slot of the template: an MTP forward its own kind's, a main one the main slot."""
    return slot == kind if kind.runs_mtp else slot is None or not slot.runs_mtp


def step_forwards(plans: list[StepPlan | None], spec: SpecOptions | None
                  ) -> tuple[tuple[StepKind, tuple[int, ...]], ...]:
    """Every forward of a DP step, in order, with each rank's tokens (1: a dummy token, for a rank with nothing in that
    forward). Each rank's forwards are fitted, in order, into one template: a speculative round's (the draft steps,
    the main forward, the draft extend), or the main forward alone without speculation; a slot no rank uses is
    dropped. The main slot's kind is the busy ranks' when they agree (a graph replays it), else EXTEND."""
    template: list[StepKind | None] = ([StepKind.DRAFT] * (spec.num_steps - 1) + [None, StepKind.DRAFT_EXTEND]
                                       if spec is not None else [None])
    tokens = [[1] * len(plans) for _ in template]
    used: list[set[StepKind]] = [set() for _ in template]
    for r, plan in enumerate(plans):
        at = 0
        for kind, n in rank_forwards(plan, spec):
            while at < len(template) and not _fits(template[at], kind):
                at += 1
            if at == len(template):
                raise RuntimeError(f"DP attention: rank {r}'s {plan.kind.name} step runs forwards that do not fit a "
                                   "step's template")
            tokens[at][r] = n
            used[at].add(kind)
            at += 1
    return tuple((kinds.pop() if len(kinds) == 1 else StepKind.EXTEND, tuple(n))
                 for kinds, n in zip(used, tokens) if kinds)


def step_graph(plans: list[StepPlan | None], graphs: StepGraphs | None, spec: SpecOptions | None
               ) -> tuple[int, int] | None:
    """The (batch-size bucket, context bucket) whose graphs every rank replays for each forward of a step of `plans`
    (rank 0 decides, from the plans alone), or None: every rank runs uncaptured, padded to the step's most rows.

    Graphs serve a step whose busy ranks all decode, or all run a speculative round (each forward of the round then
    replays its kind's graph at the same buckets), when the largest batch fits a captured bucket: the smallest bucket
    that holds it, at the smallest context bucket that holds the longest context of any rank (a graph not captured
    yet is then captured on every rank in the same step: the capture's warm-up run issues the MoE collectives). A
    rank that prefills, or a batch past the largest bucket, runs the step uncaptured on every rank."""
    busy = [p for p in plans if p is not None]
    if graphs is None or not busy:
        return None
    kind = busy[0].kind
    if any(p.kind != kind for p in busy):
        return None
    if kind == StepKind.DECODE:
        longest = max(s + n for p in busy for s, n in zip(p.prefix_lens, p.extend_lens))
    elif kind == StepKind.SPEC and spec is not None:
        kind, longest = StepKind.VERIFY, max(s for p in busy for s in p.prefix_lens) + spec.num_draft_tokens
    else:
        return None
    bucket = graphs.bucket_for(kind, max(p.batch_size for p in busy))
    ctx = graphs.ctx_bucket_for(longest)
    if bucket is None or ctx is None:
        return None
    return bucket, ctx


def step_two_batches(forwards: tuple[tuple[StepKind, tuple[int, ...]], ...], graph: tuple[int, int] | None,
                     min_tokens: int) -> tuple[int, ...] | None:
    """Two-batch overlap of an uncaptured step (`min_tokens` 0: off): where some rank runs `min_tokens` tokens or
    more in the main-model forward, every rank splits its tokens of it in half (the first micro-batch is the
    smaller: a rank with one token sends padding only in it). A step replaying graphs splits as they were
    captured (None here)."""
    if not min_tokens or graph is not None:
        return None
    tokens = next((n for kind, n in forwards if not kind.runs_mtp), None)
    if tokens is None or max(tokens) < max(2, min_tokens):
        return None
    return tuple(n // 2 for n in tokens)


class _RankForwards:
    """One rank's walk through its step's forwards (`DPStepPlan.forwards`): each forward of its own takes the next
    slot of its kind, joined by every rank; a slot it skips, and any left once its work is launched, it joins with a
    dummy token at the dummy slot (an idle rank: all of them)."""

    def __init__(self, step: DPStepPlan, rank: int, runner: "DPModelRunner"):
        self.step, self.rank, self.runner = step, rank, runner
        self.at = 0

    def join(self, batch: ForwardBatch) -> ForwardBatch:
        forwards = self.step.forwards
        while self.at < len(forwards) and not _fits(forwards[self.at][0], batch.kind):
            self._dummy()
        if self.at == len(forwards) or forwards[self.at][1][self.rank] != batch.num_tokens:
            raise RuntimeError(f"DP attention: rank {self.rank} runs a {batch.kind.name} forward of "
                               f"{batch.num_tokens} tokens that its step's layout {forwards} has no slot for")
        kind, tokens = forwards[self.at]
        self.at += 1
        return batch.for_dp_attention(tokens, self.step.graph, self._split(kind), self.rank)

    def _split(self, kind: StepKind) -> tuple[int, ...] | None:
        return None if kind.runs_mtp else self.step.two_batches

    def finish(self) -> None:
        while self.at < len(self.step.forwards):
            self._dummy()

    def _dummy(self) -> None:
        kind, tokens = self.step.forwards[self.at]
        self.at += 1
        graph, runner = self.step.graph, self.runner
        batch = runner.idle_batch(kind, graph is not None).for_dp_attention(tokens, graph, self._split(kind), self.rank)
        if kind.runs_mtp:
            runner.forward_mtp(batch, runner.idle_hidden(batch.num_tokens))
        else:
            runner.forward(batch)


class DPModelRunner(RankModelRunner):
    """A rank's runner under DP attention: while a step runs (`walk`), every forward joins its slot of the step's
    layout (the MoE exchanges of all ranks then match); a batch that already carries the ranks' tokens (a dummy, the
    start-up's warm-up) runs as it is."""

    forwards: _RankForwards | None = None

    @contextlib.contextmanager
    def walk(self, step: DPStepPlan) -> Iterator[None]:
        self.forwards = _RankForwards(step, self.ranks.rank, self)
        try:
            yield
            self.forwards.finish()
        finally:
            self.forwards = None

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        if batch.dp_tokens is None and self.forwards is not None:
            batch = self.forwards.join(batch)
        return super().forward(batch)

    def forward_mtp(self, batch: ForwardBatch, hidden_prev: torch.Tensor,
                    prev_topk: torch.Tensor | None = None) -> ModelOutput:
        if batch.dp_tokens is None and self.forwards is not None:
            batch = self.forwards.join(batch)
        return super().forward_mtp(batch, hidden_prev, prev_topk)


class _AttentionRank:
    """What every rank's DP worker does: run its own plan of a `DPStepPlan` (or nothing), joining each of the step's
    forwards (`DPModelRunner.walk`)."""

    ranks: RankGroup
    runner: DPModelRunner
    runner_cls = DPModelRunner

    def launch_own(self, step: DPStepPlan) -> PendingStep | None:
        rank = self.ranks.rank
        plan = step.plans[rank]
        with self.runner.walk(step):  # every forward of the plan is launched inside (speculation's included)
            if plan is None:
                return None
            pending = Worker.launch(self, plan)  # type: ignore[arg-type]  # not TP's: nothing to send
            if plan.grammar_rows:  # its masks came with the step (rank 0 made them with the plan)
                Worker.launch_sampling(self, pending, step.masks[rank])  # type: ignore[arg-type]
            return pending

    def _share_mask(self, mask: torch.Tensor) -> None:
        """Each rank samples its own requests with its own masks: nothing to share."""

    @functools.cached_property
    def results(self) -> ResultChannel:
        """Every rank's step results to rank 0."""
        return ResultChannel(self.ranks)


class DPRankWorker(_AttentionRank, RankWorker):
    """A rank > 0: runs its part of each step and sends its result to rank 0."""

    @property
    def ranks(self) -> RankGroup:  # type: ignore[override]
        return self.runner.ranks

    def execute_dp(self, step: DPStepPlan) -> None:
        pending = self.launch_own(step)
        self.results.send(pending.result() if pending is not None else None)


class DPPendingStep:
    """Rank 0's launched DP step: `results()` waits for its own tokens and gathers the other ranks'."""

    def __init__(self, step: DPStepPlan, own: PendingStep | None, ranks: RankGroup, channel: ResultChannel):
        self.step = step
        self._own = own
        self._ranks = ranks
        self._channel = channel
        self._results: list[StepResult | None] | None = None

    def results(self) -> list[StepResult | None]:
        """Per rank, its plan's result (None for an idle rank)."""
        if self._results is None:
            with self._ranks.guard(step=True):
                mine = self._own.result() if self._own is not None else None
                self._results = self._channel.gather(mine)
        return self._results


class DPAttentionWorker(_AttentionRank, TensorParallelWorker):
    """Rank 0's worker under DP attention: `launch_dp` sends a step to the ranks and runs rank 0's part of it."""

    def dp_step(self, plans: list[StepPlan | None], masks: list[torch.Tensor | None] | None = None) -> DPStepPlan:
        """The step of every rank's plan (and grammar masks): its forwards, and the graphs' buckets all of them
        replay (if any)."""
        spec = self.speculator.opts if self.speculator is not None else None
        graph, forwards = step_graph(plans, self.runner.graphs, spec), step_forwards(plans, spec)
        config = self.runner.config
        split = step_two_batches(forwards, graph, config.two_batch_overlap_min_tokens
                                 if config.enable_two_batch_overlap else 0)
        return DPStepPlan(plans, graph, forwards,
                          tuple(masks) if masks is not None and any(m is not None for m in masks) else None, split)

    def launch_dp(self, step: DPStepPlan) -> DPPendingStep:
        with self.ranks.guard(step=True):
            self.channel.send(step)
            own = self.launch_own(step)
        return DPPendingStep(step, own, self.ranks, self.results)

    def launch(self, plan: StepPlan):  # the engine hands DP steps to `launch_dp`
        raise RuntimeError("under DP attention every step is a DPStepPlan (launch_dp)")


def run_dp_rank(ranks: RankGroup, resolved: ResolvedConfig, kernels: KernelChoice) -> None:
    """A rank > 0 under DP attention (`python -m minidsa.parallel`): build, then run its part of each of rank 0's
    steps until it stops."""
    worker = build_rank_worker(ranks, resolved, kernels, progress=False, worker_cls=DPRankWorker)
    worker.prepare_fast_paths()
    serve_plans(PlanChannel(ranks), worker.execute_dp)
