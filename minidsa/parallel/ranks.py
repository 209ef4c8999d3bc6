"""Tensor parallelism on the engine's step plans: rank 0 broadcasts each `StepPlan`, every rank's Worker runs it.

Every rank builds the same worker (`build_worker`: runner, sampler, speculator) around its shard of the
model, captures its graphs at the same point (`Worker.prepare_fast_paths`), then:

- rank 0 (`TensorParallelWorker`, the engine's worker): `launch(plan)` sends the plan to the other ranks
  (pickled, over the gloo control group; plain data, nothing else travels) and launches it locally;
- ranks > 0 (`serve_plans(channel, worker.launch)`): launch each plan as it arrives, until `StopPlan`.

The plan carries everything a rank's device state needs: the page-table writes, the host-known tokens, the
sampling parameters and output positions (the noise keys). A decode row's input is the token each rank
sampled itself in an earlier step: the logits are all-gathered, so every rank samples the same ids, and a
speculative round's drafts, trees and accepted paths (KV compaction included) come out the same too.

Overlapped scheduling works unchanged: rank 0 sends plan N+1 while step N runs on the devices, and reads
step N's tokens afterwards; ranks > 0 never read their results (they launch and move on), so none waits
for the host of another except in the collectives of the forward itself. Sends and collectives happen in
the same order on every rank (control group: plans; device group: the forward's collectives).

Structured outputs: only rank 0 holds the grammars. A plan with grammar rows launches its forward on every rank;
rank 0 then fills the masks and every rank joins one broadcast of the bitmask from rank 0's device over the
device group (`_share_mask`) before it samples. The broadcast is in stream order, so no rank's host waits for it;
ranks > 0 (`RankWorker`) launch the sampling right after the forward and wait in the broadcast.

What this module keeps besides: the KV capacity agreement (`RankModelRunner`: the smallest any rank's free
memory allows) and the group's lifetime (stopping the ranks when the engine goes).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minidsa.attention.select import KernelChoice
from minidsa.common.plan import StepPlan, StepResult
from minidsa.common.tensor_parallel import building_with
from minidsa.config import ConfigError, ResolvedConfig
from minidsa.exec.build import build_worker
from minidsa.exec.graphs import StepGraphs, release_captured
from minidsa.exec.runner import ModelRunner
from minidsa.exec.worker import PendingStep, Worker
from minidsa.parallel.channel import PlanChannel
from minidsa.parallel.launch import (
    TEARDOWN_S,
    RankGroup,
    bounded,
    launch_mode,
    single_rank_group,
    start_ranks,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopPlan:
    """Rank 0 is done: ranks > 0 leave `serve_plans`."""


class RankModelRunner(ModelRunner):
    """A ModelRunner holding this rank's shard of the model and the full (replicated) caches, agreeing with
    the other ranks on the KV capacity. It owns the rank group: `close()` (or dropping it) leaves the
    process groups and, on rank 0, stops the other ranks."""

    def __init__(self, ranks: RankGroup, resolved: ResolvedConfig, kernels: KernelChoice, progress: bool = True):
        self.ranks = ranks
        # Dropped without close() (a notebook's `del llm`), or at interpreter exit: the ranks stop and the
        # process group goes, so another distributed engine can start in this process.
        self._release = weakref.finalize(self, ranks.shutdown)
        with ranks.guard(), building_with(ranks.tp):
            super().__init__(resolved, kernels, progress)

    def use_graphs(self, graphs: StepGraphs, warm_up_tokens: int) -> None:
        # The graphs go before the communicators they captured, however the engine ends (RankGroup.shutdown).
        self.ranks.before_leaving.append(functools.partial(release_captured, graphs.captured))
        super().use_graphs(graphs, warm_up_tokens)

    def _auto_kv_tokens(self, reserve: int | None) -> int:
        tokens = torch.tensor([super()._auto_kv_tokens(reserve)], dtype=torch.int64)
        if self.ranks.world_size > 1:
            torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MIN, group=self.ranks.control_group)
        return int(tokens.item())

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def close(self) -> None:
        self._release()


class _GuardedStep:
    """Rank 0's pending step: waiting for its tokens names a rank that died meanwhile."""

    def __init__(self, pending: PendingStep, ranks: RankGroup):
        self.pending = pending
        self.plan = pending.plan
        self._ranks = ranks

    def result(self) -> StepResult:
        with self._ranks.guard(step=True):
            return self.pending.result()


def _broadcast_mask(ranks: RankGroup, mask: torch.Tensor) -> None:
    """Every rank's `mask` becomes rank 0's (a step's grammar bitmask, on the device)."""
    if ranks.world_size > 1:
        torch.distributed.broadcast(mask, src=0, group=ranks.device_group)


class RankWorker(Worker):
    """A rank > 0's worker: a plan with grammar rows samples with the bitmask rank 0 broadcasts."""

    runner: RankModelRunner

    def launch(self, plan: StepPlan) -> PendingStep:
        pending = super().launch(plan)
        if pending.awaits_mask:
            self.launch_sampling(pending, None)
        return pending

    def _share_mask(self, mask: torch.Tensor) -> None:
        _broadcast_mask(self.runner.ranks, mask)


class TensorParallelWorker(Worker):
    """Rank 0's worker: every plan goes to the other ranks before it runs here."""

    runner: RankModelRunner

    def __init__(self, runner: RankModelRunner, sampler, speculator=None):
        super().__init__(runner, sampler, speculator)
        self.ranks = runner.ranks
        self.channel = PlanChannel(runner.ranks)

    def launch(self, plan: StepPlan) -> _GuardedStep:
        with self.ranks.guard(step=True):
            self.channel.send(plan)
            return _GuardedStep(super().launch(plan), self.ranks)

    def launch_sampling(self, pending: _GuardedStep, bitmask: torch.Tensor | None) -> None:
        with self.ranks.guard(step=True):
            super().launch_sampling(pending.pending, bitmask)

    def _share_mask(self, mask: torch.Tensor) -> None:
        _broadcast_mask(self.ranks, mask)

    def prepare_fast_paths(self) -> None:
        with self.ranks.guard():  # capture runs the model: collectives with the other ranks
            super().prepare_fast_paths()

    def close(self) -> None:
        """Stop the other ranks and leave the process groups (also at exit, or when the runner goes away). Bounded:
        StopPlan lets the ranks leave their loop (under torchrun, their only way out). Not after a failed step: the
        ranks are not reading plans (a gloo send waits for its receiver), they leave on EOF instead."""
        if self.runner.closed:
            return
        watch = self.ranks.processes
        failed = self.ranks.broken is not None or (watch is not None and watch.failure is not None)
        if watch is not None:
            watch.state.stopping = True  # before StopPlan: a rank that exits from now on was stopped, it did not fail
        if self.ranks.world_size > 1 and not failed:
            bounded(lambda: self.channel.send(StopPlan()), TEARDOWN_S, "sending StopPlan to the other ranks")
        self.runner.close()


def serve_plans(channel: PlanChannel, execute: Callable[[StepPlan], object]) -> None:
    """Ranks > 0: `execute(plan)` for each of rank 0's plans until it sends StopPlan. `execute` is the rank's
    `Worker.launch` (its results are rank 0's to read: launching, not waiting, keeps overlap on every rank)."""
    while True:
        plan = channel.receive()
        if isinstance(plan, StopPlan):
            return
        execute(plan)


def build_rank_worker(ranks: RankGroup, resolved: ResolvedConfig, kernels: KernelChoice, progress: bool,
                      worker_cls: type = Worker) -> Worker:
    """This rank's worker, built and captured the same way on every rank (the same collectives, in order). Its runner
    is `worker_cls.runner_cls` where the worker names one (DP attention's), else a RankModelRunner."""
    runner = getattr(worker_cls, "runner_cls", RankModelRunner)(ranks, resolved, kernels, progress)
    try:
        with ranks.guard():
            return build_worker(runner, resolved, worker_cls)
    except BaseException:
        runner.close()
        raise


class FollowerWorker(RankWorker):
    """A rank > 0 whose engine was built in the user's process (a torchrun launch: every rank runs the script and
    gets an Engine back): `follow` runs rank 0's plans until it stops."""

    is_driver = False

    def follow(self) -> None:
        try:
            serve_plans(PlanChannel(self.runner.ranks), self.launch)
        finally:
            self.runner.close()


def run_rank(ranks: RankGroup, resolved: ResolvedConfig, kernels: KernelChoice) -> None:
    """A rank > 0 that minidsa started (`python -m minidsa.parallel`): build the worker, capture, execute rank 0's
    plans until it stops."""
    worker = build_rank_worker(ranks, resolved, kernels, progress=False, worker_cls=RankWorker)
    worker.prepare_fast_paths()
    serve_plans(PlanChannel(ranks), worker.launch)


def start_parallel_worker(resolved: ResolvedConfig, kernels: KernelChoice, progress: bool = True,
                          driver_cls: type[TensorParallelWorker] = TensorParallelWorker) -> Worker:
    """This process's worker in a tensor-parallel group: rank 0's broadcasting worker (it starts ranks 1..N-1, or
    joins torchrun's group; a group of one at tensor_parallel_size 1), or, on a rank > 0 of a torchrun launch, a
    `FollowerWorker` (`is_driver` False): every rank returns from building its engine, and only rank 0 runs the
    control plane. `driver_cls`: rank 0's worker class (DP attention's: `dp_attention.DPAttentionWorker`)."""
    try:
        mode, rank, _ = launch_mode(resolved.args.tensor_parallel_size)
    except ValueError as e:
        raise ConfigError("tensor_parallel_size", str(e)) from None
    if resolved.args.tensor_parallel_size > 1:
        ranks = start_ranks(resolved, kernels)
        resolved = resolved.on_device(str(ranks.device))
    else:
        ranks = single_rank_group(resolved.args.device, resolved.args.enable_expert_parallel)
    driver = not (mode == "torchrun" and rank > 0)
    try:
        worker = build_rank_worker(ranks, resolved, kernels, progress and driver,
                                   driver_cls if driver else FollowerWorker)
    except BaseException:
        ranks.shutdown()
        raise
    if driver and resolved.args.enable_dp_attention:
        logger.info("DP attention: %d attention ranks (%s), each with its own requests and KV cache; routed experts "
                    "whole, %d per rank; rank 0 places each request on a rank and broadcasts each step's plans "
                    "(overlap scheduling off)", ranks.world_size, ranks.device_group.name(),
                    resolved.model.n_routed_experts // ranks.world_size)
    elif driver:
        logger.info("tensor parallel: %d ranks (%s), expert parallel %s; rank 0 runs the engine and broadcasts "
                    "each step plan (overlap scheduling %s)", ranks.world_size, ranks.device_group.name(),
                    resolved.args.enable_expert_parallel, "on" if resolved.args.overlap_schedule else "off")
    return worker
