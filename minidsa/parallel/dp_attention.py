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
its step; `config.resolve` turns it off), no speculative decoding and no CUDA graphs yet (`config.resolve` refuses
them), no grammar masks (the engine refuses structured outputs under DP attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from minidsa.attention.select import KernelChoice
from minidsa.common.batch import ForwardBatch
from minidsa.common.plan import StepPlan, StepResult
from minidsa.config import ResolvedConfig
from minidsa.exec.worker import PendingStep, Worker
from minidsa.parallel.channel import PlanChannel
from minidsa.parallel.launch import RankGroup
from minidsa.parallel.ranks import RankWorker, TensorParallelWorker, build_rank_worker, serve_plans


@dataclass(frozen=True)
class DPStepPlan:
    """One lockstep step of every attention rank: `plans[r]` is rank r's plan, None where rank r is idle."""

    plans: list[StepPlan | None]

    @property
    def dp_tokens(self) -> tuple[int, ...]:
        """Tokens each rank's forward runs (an idle rank runs one, at the dummy slot)."""
        return tuple(p.num_tokens if p is not None else 1 for p in self.plans)


class _AttentionRank:
    """What every rank's DP worker does: run its own plan of a `DPStepPlan` (or the idle token), each batch
    carrying every rank's token count."""

    ranks: RankGroup
    dp_tokens: tuple[int, ...] | None = None

    def _batch(self, plan: StepPlan) -> ForwardBatch:
        return super()._batch(plan).for_dp_attention(self.dp_tokens)  # type: ignore[misc]

    def launch_own(self, step: DPStepPlan) -> PendingStep | None:
        self.dp_tokens = step.dp_tokens
        plan = step.plans[self.ranks.rank]
        if plan is None:  # nothing here this step: one dummy token, for the MoE layers' collectives
            runner = self.runner  # type: ignore[attr-defined]
            runner.forward(runner.idle_batch().for_dp_attention(step.dp_tokens))
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
