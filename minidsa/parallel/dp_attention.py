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
comes back to rank 0 through one gather over the control group. Every rank knows every rank's token count from the
plan (`DPStepPlan.dp_tokens`): each forward's batch carries them (`ForwardBatch.dp_tokens`) for the MoE exchange.

Steps run in lockstep, one forward per rank per step: no overlap scheduling (a rank's tokens reach rank 0 after
its step; `config.resolve` turns it off), no speculative decoding yet (`config.resolve` refuses it), no grammar masks
(the engine refuses structured outputs under DP attention).

CUDA graphs: every rank captures the same DECODE graphs (the same batch buckets, in the same order, at the same
point: `prepare_fast_paths` under the group's guard), whose MoE exchanges are bucket x N rows. Each step rank 0
decides for all ranks (`decode_graph`, carried in `DPStepPlan.graph`): when every busy rank decodes and the largest
batch fits a bucket, every rank replays the DECODE graph of that one bucket (an idle rank with padding rows only);
otherwise every rank runs uncaptured (torch.compile's layer on a GPU), padded to the step's most rows. Prefill
chunks and mixed steps never run as graphs under DP attention (no EXTEND graph is captured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from minidsa.attention.select import KernelChoice
from minidsa.common.batch import ForwardBatch
from minidsa.common.plan import StepKind, StepPlan, StepResult
from minidsa.config import ResolvedConfig
from minidsa.exec.graphs import StepGraphs
from minidsa.exec.worker import PendingStep, Worker
from minidsa.parallel.channel import PlanChannel
from minidsa.parallel.launch import RankGroup
from minidsa.parallel.ranks import RankWorker, TensorParallelWorker, build_rank_worker, serve_plans


@dataclass(frozen=True)
class DPStepPlan:
    """One lockstep step of every attention rank: `plans[r]` is rank r's plan, None where rank r is idle.

    `graph`: the (batch-size bucket, context bucket) of the DECODE graph every rank replays this step (an idle rank
    too, with padding rows only), chosen by rank 0 for all of them (`decode_graph`); None: every rank runs
    uncaptured. A rank never picks its own: the graph's MoE exchanges are bucket x N rows, on every rank alike."""

    plans: list[StepPlan | None]
    graph: tuple[int, int] | None = None

    @property
    def dp_tokens(self) -> tuple[int, ...]:
        """Tokens each rank's forward runs (an idle rank runs one, at the dummy slot)."""
        return tuple(p.num_tokens if p is not None else 1 for p in self.plans)


def decode_graph(plans: list[StepPlan | None], graphs: StepGraphs | None) -> tuple[int, int] | None:
    """The DECODE graph every rank replays for a step of `plans` (rank 0 decides, from the plans alone): when every
    busy rank decodes and the largest batch fits a captured bucket, the smallest bucket that holds the largest
    batch, at the smallest context bucket that holds the longest context of any rank (a context bucket's graph
    that is not captured yet is then captured on every rank in the same step: the capture's warm-up run issues the
    MoE collectives). Otherwise (a rank prefills, or a batch is past the largest bucket) None: every rank runs
    uncaptured, padded to the step's most rows."""
    if graphs is None or StepKind.DECODE not in graphs.shapes:
        return None
    busy = [p for p in plans if p is not None]
    if not busy or any(p.kind != StepKind.DECODE for p in busy):
        return None
    bucket = graphs.bucket_for(StepKind.DECODE, max(p.batch_size for p in busy))
    ctx = graphs.ctx_bucket_for(max(s + n for p in busy for s, n in zip(p.prefix_lens, p.extend_lens)))
    if bucket is None or ctx is None:
        return None
    return bucket, ctx


class _AttentionRank:
    """What every rank's DP worker does: run its own plan of a `DPStepPlan` (or the idle batch), each batch
    carrying every rank's token count and the step's graph."""

    ranks: RankGroup
    step: DPStepPlan | None = None

    def _batch(self, plan: StepPlan) -> ForwardBatch:
        step = self.step
        return super()._batch(plan).for_dp_attention(step.dp_tokens, step.graph)  # type: ignore[misc]

    def launch_own(self, step: DPStepPlan) -> PendingStep | None:
        self.step = step
        plan = step.plans[self.ranks.rank]
        if plan is None:  # nothing here this step: padding rows, for the MoE layers' collectives
            runner = self.runner  # type: ignore[attr-defined]
            runner.forward(runner.idle_batch(step.graph is not None).for_dp_attention(step.dp_tokens, step.graph))
            return None
        if plan.grammar_rows:
            raise RuntimeError("grammar rows in a DP-attention plan: structured outputs are refused under "
                               "--enable-dp-attention")
        return Worker.launch(self, plan)  # type: ignore[arg-type]  # not TensorParallelWorker's: nothing to send


class DPRankWorker(_AttentionRank, RankWorker):
    """A rank > 0: runs its part of each step and sends its result to rank 0."""

    @property
    def ranks(self) -> RankGroup:  # type: ignore[override]
        return self.runner.ranks

    def execute_dp(self, step: DPStepPlan) -> None:
        pending = self.launch_own(step)
        result = pending.result() if pending is not None else None
        dist.gather_object(result, None, dst=0, group=self.ranks.control_group)


class DPPendingStep:
    """Rank 0's launched DP step: `results()` waits for its own tokens and gathers the other ranks'."""

    def __init__(self, step: DPStepPlan, own: PendingStep | None, ranks: RankGroup):
        self.step = step
        self._own = own
        self._ranks = ranks
        self._results: list[StepResult | None] | None = None

    def results(self) -> list[StepResult | None]:
        """Per rank, its plan's result (None for an idle rank)."""
        if self._results is None:
            with self._ranks.guard(step=True):
                mine = self._own.result() if self._own is not None else None
                gathered: list[StepResult | None] = [None] * self._ranks.world_size
                dist.gather_object(mine, gathered, dst=0, group=self._ranks.control_group)
            self._results = gathered
        return self._results


class DPAttentionWorker(_AttentionRank, TensorParallelWorker):
    """Rank 0's worker under DP attention: `launch_dp` sends a step to the ranks and runs rank 0's part of it."""

    def dp_step(self, plans: list[StepPlan | None]) -> DPStepPlan:
        """The step of every rank's plan, with the DECODE graph all of them replay (if any)."""
        return DPStepPlan(plans, decode_graph(plans, self.runner.graphs))

    def launch_dp(self, step: DPStepPlan) -> DPPendingStep:
        with self.ranks.guard(step=True):
            self.channel.send(step)
            own = self.launch_own(step)
        return DPPendingStep(step, own, self.ranks)

    def launch(self, plan: StepPlan):  # the engine hands DP steps to `launch_dp`
        raise RuntimeError("under DP attention every step is a DPStepPlan (launch_dp)")


def run_dp_rank(ranks: RankGroup, resolved: ResolvedConfig, kernels: KernelChoice) -> None:
    """A rank > 0 under DP attention (`python -m minidsa.parallel`): build, then run its part of each of rank 0's
    steps until it stops."""
    worker = build_rank_worker(ranks, resolved, kernels, progress=False, worker_cls=DPRankWorker)
    worker.prepare_fast_paths()
    serve_plans(PlanChannel(ranks), worker.execute_dp)
