"""Tensor parallelism on today's engine: rank 0 describes each model call as a plan; every rank runs it.

This is the one adapter between the single-process engine and the ranks, hooked at the narrowest point:
the model runner. The scheduler, prefix cache and speculator run on rank 0 only and leave their device-side
effects in rank 0's runner: the req->token table, the KV caches (written by forwards, moved by tree
compaction) and the hidden states handed to the draft model. Every call that has such an effect is a plan:

- `ForwardPlan`: `forward` / `forward_mtp` with a `BatchLayout` (the ForwardBatch's mode, sizes and host
  ints) plus one packed device tensor carrying the batch's index tensors and the req->token rows its
  requests read; for the draft model also the hidden states (and top-k) it is handed.
- `KVMovePlan`: tree compaction's slot moves. `LogprobsPlan`: prompt / sampled-token logprobs (the
  vocab-parallel head is a collective). `PreparePlan`: compile and CUDA-graph capture (they run the model).

Ranks > 0 (`serve_plans`) hold a `RankModelRunner` with the same caches and replay each plan in order, so
every collective inside a forward meets its peers. Only rank 0 samples (its logits are all-gathered).

When the control plane / worker split lands, `Worker.execute(plan)` takes the place of these plans: rank 0
broadcasts the step plan, every rank executes it, and this module shrinks to `serve_plans` calling it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minidsa.attention.dsa import DSABackend
from minidsa.batch import ForwardBatch, ForwardMode
from minidsa.config import ConfigError, EngineConfig, ModelConfig
from minidsa.distributed.launch import RankFailedError, RankGroup, single_rank_group, start_ranks
from minidsa.distributed.parallel_state import building_with
from minidsa.distributed.plan import PlanChannel
from minidsa.runner import ModelRunner

logger = logging.getLogger(__name__)

# ForwardBatch's int64 tensors, in the order they are packed.
BATCH_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "extend_lens",
                "token_req", "kv_lens", "logits_indices")


@dataclass(frozen=True)
class BatchLayout:
    """A ForwardBatch as plain data: how to cut the packed tensor back into one."""

    mode: int
    sizes: tuple[int, ...]  # numel of each BATCH_FIELDS tensor
    max_kv_len: int
    tree_mask_shape: tuple[int, int] | None
    table_pages: int  # req->token pages shipped per request row
    page_size: int

    @property
    def packed_numel(self) -> int:
        tree = self.tree_mask_shape[0] * self.tree_mask_shape[1] if self.tree_mask_shape else 0
        return sum(self.sizes) + self.sizes[3] * self.table_pages + tree


def pack_batch(batch: ForwardBatch, req_to_token: torch.Tensor, page_size: int) -> tuple[BatchLayout, torch.Tensor]:
    """(layout, one int64 device tensor): the batch's tensors, then its requests' req->token rows, then the
    tree mask. A row maps position p to slot page * page_size + p % page_size (the scheduler maps whole
    pages), so only the page of every page_size-th position travels, over the positions attention may read
    (up to max_kv_len, plus the tree's draft positions)."""
    tree = batch.tree_mask
    cols = min(req_to_token.shape[1], batch.max_kv_len + (tree.shape[1] if tree is not None else 0))
    parts = [getattr(batch, name).reshape(-1) for name in BATCH_FIELDS]
    pages = req_to_token[batch.req_pool_indices, :cols:page_size].long() // page_size
    parts.append(pages.reshape(-1))
    if tree is not None:
        parts.append(tree.reshape(-1).long())
    layout = BatchLayout(mode=int(batch.mode), sizes=tuple(p.numel() for p in parts[:len(BATCH_FIELDS)]),
                         max_kv_len=batch.max_kv_len, tree_mask_shape=None if tree is None else tuple(tree.shape),
                         table_pages=pages.shape[1], page_size=page_size)
    return layout, torch.cat(parts)


def unpack_batch(layout: BatchLayout, packed: torch.Tensor, req_to_token: torch.Tensor) -> ForwardBatch:
    """The ForwardBatch rank 0 ran, rebuilt on this rank; writes the shipped req->token rows into this rank's
    table first (rank 0's scheduler and prefix cache decided them)."""
    fields, offset = {}, 0
    for name, n in zip(BATCH_FIELDS, layout.sizes):
        fields[name] = packed[offset:offset + n]
        offset += n
    rows = fields["req_pool_indices"]
    table_numel = rows.numel() * layout.table_pages
    if table_numel:
        ps = layout.page_size
        pages = packed[offset:offset + table_numel].view(rows.numel(), layout.table_pages, 1)
        slots = (pages * ps + torch.arange(ps, device=pages.device)).view(rows.numel(), -1)
        req_to_token[rows, :slots.shape[1]] = slots.to(req_to_token.dtype)
    offset += table_numel
    tree = None
    if layout.tree_mask_shape is not None:
        t, w = layout.tree_mask_shape
        tree = packed[offset:offset + t * w].view(t, w).bool()
    return ForwardBatch(mode=ForwardMode(layout.mode), max_kv_len=layout.max_kv_len, tree_mask=tree, **fields)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def tensor_spec(t: torch.Tensor | None) -> TensorSpec | None:
    return None if t is None else TensorSpec(tuple(t.shape), t.dtype)


@dataclass(frozen=True)
class ForwardPlan:
    batch: BatchLayout
    mtp: bool = False  # the draft (MTP) layer instead of the main model
    hidden_prev: TensorSpec | None = None  # MTP input states (broadcast after the batch)
    prev_topk: TensorSpec | None = None  # MTP: the top-k it reuses


@dataclass(frozen=True)
class KVMovePlan:
    num_moves: int


@dataclass(frozen=True)
class LogprobsPlan:
    hidden: TensorSpec  # the selected rows' last-layer states
    k: int
    chunk: int


@dataclass(frozen=True)
class PreparePlan:
    spec_layout: object  # SpecLayout | None
    compile_backend: str | None


@dataclass(frozen=True)
class StopPlan:
    pass


class RankModelRunner(ModelRunner):
    """A ModelRunner holding this rank's shard of the model, the full (replicated) caches, and agreeing with
    the other ranks on the KV capacity (the smallest any rank's free memory allows)."""

    def __init__(self, ranks: RankGroup, config: EngineConfig, model_config: ModelConfig, model_path: str | None,
                 init_std: float = 0.02, decode_reserve: int = 1, progress: bool = True):
        self.ranks = ranks
        with building_with(ranks.tp):
            super().__init__(config, model_config, model_path, init_std, decode_reserve, progress)

    def _auto_kv_tokens(self) -> int:
        tokens = torch.tensor([super()._auto_kv_tokens()], dtype=torch.int64)
        if self.ranks.world_size > 1:
            torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MIN, group=self.ranks.control_group)
        return int(tokens.item())


class _BroadcastKVMoves(DSABackend):
    """Rank 0's attention backend: tree compaction's KV moves happen on every rank."""

    def __init__(self, runner: "DistributedModelRunner", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._runner = runner

    def kv_move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        runner = self._runner
        with runner.ranks.guard():
            runner.channel.send(KVMovePlan(src.numel()))
            runner.channel.broadcast_tensor(torch.stack([src.long(), dst.long()]), (2, src.numel()), torch.int64)
            super().kv_move(src, dst)


class DistributedModelRunner(RankModelRunner):
    """Rank 0's runner: every call with a device-side effect is first sent to the other ranks as a plan."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: str | None,
                 init_std: float = 0.02, decode_reserve: int = 1, progress: bool = True):
        if config.tensor_parallel_size > 1:
            ranks = start_ranks(config, model_config, model_path, init_std, decode_reserve)
        else:
            ranks = single_rank_group(config.device, config.enable_expert_parallel)
        try:
            with ranks.guard():
                self.channel = PlanChannel(ranks)
                super().__init__(ranks, config, model_config, model_path, init_std, decode_reserve, progress)
        except BaseException:
            ranks.shutdown()
            raise
        self.attn = _BroadcastKVMoves(self, self.kv_cache, self.req_to_token_pool.req_to_token,
                                      model_config.index_topk, self.kernels)
        # Dropped without close() (a notebook's `del llm`), or at interpreter exit: the ranks stop and the
        # process group goes, so another distributed engine can start in this process.
        self._release = weakref.finalize(self, ranks.shutdown)
        logger.info("tensor parallel: %d ranks (%s), expert parallel %s; rank 0 runs the engine",
                    ranks.world_size, ranks.device_group.name(), config.enable_expert_parallel)

    def prepare_fast_paths(self, spec_layout=None, static_on_cpu: bool = False,
                           compile_backend: str | None = None) -> None:
        # Capture runs the model (collectives inside) on every rank, in the same order.
        with self.ranks.guard():
            self.channel.send(PreparePlan(spec_layout, compile_backend))
            super().prepare_fast_paths(spec_layout, static_on_cpu, compile_backend)

    def forward(self, batch: ForwardBatch):
        with self.ranks.guard():
            self._send_forward(batch, mtp=False)
            return super().forward(batch)

    def forward_mtp(self, batch: ForwardBatch, hidden_prev: torch.Tensor, prev_topk: torch.Tensor | None = None):
        with self.ranks.guard():
            self._send_forward(batch, mtp=True, hidden_prev=hidden_prev, prev_topk=prev_topk)
            return super().forward_mtp(batch, hidden_prev, prev_topk)

    def _send_forward(self, batch: ForwardBatch, mtp: bool, hidden_prev: torch.Tensor | None = None,
                      prev_topk: torch.Tensor | None = None) -> None:
        if self.channel.receivers == 0:
            return
        layout, packed = pack_batch(batch, self.req_to_token, self.page_size)
        self.channel.send(ForwardPlan(layout, mtp, tensor_spec(hidden_prev), tensor_spec(prev_topk)))
        self.channel.broadcast_tensor(packed, (packed.numel(),), torch.int64)
        for t in (hidden_prev, prev_topk):
            if t is not None:
                self.channel.broadcast_tensor(t, tuple(t.shape), t.dtype)

    def token_logprobs(self, hidden: torch.Tensor, rows: list[int], targets: list[int], k: int,
                       chunk: int = 256):
        with self.ranks.guard():
            selected = hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]
            self.channel.send(LogprobsPlan(tensor_spec(selected), k, chunk))
            self.channel.broadcast_tensor(selected, tuple(selected.shape), selected.dtype)
            return super().token_logprobs(selected, list(range(len(rows))), targets, k, chunk)

    def close(self) -> None:
        """Stop the other ranks and leave the process groups (also at exit, or when the runner goes away)."""
        if not self._release.alive:
            return
        try:
            if self.ranks.processes is None or self.ranks.processes.failure is None:
                self.channel.send(StopPlan())
        except Exception as e:  # a rank already gone: stopping the rest is all that is left to do
            logger.debug("stop plan not delivered: %s", e)
        self._release()


def execute_plan(runner: RankModelRunner, channel: PlanChannel, plan: object) -> None:
    """Ranks > 0: do what rank 0 did for `plan` (the tensors it names arrive in the same order)."""
    if isinstance(plan, ForwardPlan):
        packed = channel.broadcast_tensor(None, (plan.batch.packed_numel,), torch.int64)
        batch = unpack_batch(plan.batch, packed, runner.req_to_token)
        hidden = prev_topk = None
        if plan.hidden_prev is not None:
            hidden = channel.broadcast_tensor(None, plan.hidden_prev.shape, plan.hidden_prev.dtype)
        if plan.prev_topk is not None:
            prev_topk = channel.broadcast_tensor(None, plan.prev_topk.shape, plan.prev_topk.dtype)
        if plan.mtp:
            runner.forward_mtp(batch, hidden, prev_topk)
        else:
            runner.forward(batch)
    elif isinstance(plan, KVMovePlan):
        moves = channel.broadcast_tensor(None, (2, plan.num_moves), torch.int64)
        runner.attn.kv_move(moves[0], moves[1])
    elif isinstance(plan, LogprobsPlan):
        hidden = channel.broadcast_tensor(None, plan.hidden.shape, plan.hidden.dtype)
        n = hidden.shape[0]
        runner.token_logprobs(hidden, list(range(n)), [0] * n, plan.k, plan.chunk)
    elif isinstance(plan, PreparePlan):
        runner.prepare_fast_paths(plan.spec_layout, compile_backend=plan.compile_backend)
    else:
        raise TypeError(f"rank {runner.ranks.rank}: unknown plan {type(plan).__name__}")


def serve_plans(channel: PlanChannel, execute: Callable[[object], object]) -> None:
    """Ranks > 0: `execute(plan)` for each of rank 0's plans until it sends StopPlan (today
    `functools.partial(execute_plan, runner, channel)`; after the control plane / worker split,
    `Worker.execute`)."""
    while True:
        plan = channel.receive()
        if isinstance(plan, StopPlan):
            return
        execute(plan)


def make_runner(config: EngineConfig, model_config: ModelConfig, model_path: str | None, init_std: float = 0.02,
                decode_reserve: int = 1, progress: bool = True) -> ModelRunner:
    """The engine's runner: the plain one, or rank 0 of a tensor-parallel group (starting the other ranks).

    Under torchrun (or any launcher setting RANK / WORLD_SIZE), ranks > 0 never return from here: they serve
    rank 0's plans and exit the process when it stops.
    """
    if not config.distributed:
        return ModelRunner(config, model_config, model_path, init_std, decode_reserve, progress)
    config.validate_parallel(model_config)
    from minidsa.distributed.launch import launch_mode

    try:
        mode, rank, _ = launch_mode(config.tensor_parallel_size)
    except ValueError as e:
        raise ConfigError("tensor_parallel_size", str(e)) from None
    if mode == "torchrun" and rank > 0:
        from minidsa.distributed.worker import run_torchrun_rank

        run_torchrun_rank(config, model_config, model_path, init_std, decode_reserve)
    return DistributedModelRunner(config, model_config, model_path, init_std, decode_reserve, progress)


__all__ = ["DistributedModelRunner", "RankFailedError", "RankModelRunner", "make_runner", "serve_plans"]
