"""Two-batch overlap (`--enable-two-batch-overlap`, with DP attention): one micro-batch's MoE exchange runs while
the other computes.

Under DP attention every MoE layer exchanges the ranks' rows twice (an all-gather before the routed experts, a
reduce-scatter after them: `MoE._forward_dp`), and the compute stream waits for each. Split into two micro-batches,
A and B, each layer runs

    attend A, send A's rows | attend B, send B's rows | A's experts, return A's rows | B's experts, return B's rows

and each exchange is issued when its rows are ready and waited for only where they are read: A's all-gather runs
under B's attention, B's under A's experts, A's reduce-scatter under B's experts, and B's under the next layer's
attention of A. The collectives are torch's functional ones: issued on the process group's stream, joined by
`wait_tensor`, so a CUDA graph captures the two streams' branches and replays them side by side.

Each micro-batch is a batch of its own (`ForwardBatch.micro_batches`, split at a request boundary): its attention
and indexer inputs, and its own top-k, handed from layer to layer as it is without the split, so the layers that
reuse the previous layer's top-k (GLM-5's shared indexer, DSA's top-k sharing) read their own micro-batch's. Layers
that exchange nothing (the dense layers before the first MoE layer) run on the whole batch, once.

Where it applies: the batches of the main model's CUDA graphs (DECODE, VERIFY) under DP attention, at a batch
bucket of at least `two_batch_overlap_min_requests` requests (`exec.graphs.StepGraphs`). There every rank runs the
same bucket, so every rank splits alike and the exchanges match; the decision is made at capture, identically on
every rank. Uncaptured steps (prefill, mixed) and the MTP layer run one batch.

The stages two-batch overlap interleaves are compiled like the whole layer (`exec.runner.ModelRunner`:
`OverlapCalls` of compiled `call_attend` / `call_routed`); the collectives run between them, in eager code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the model imports this module
    from minidsa.attention.backend import LayerCaches
    from minidsa.common.batch import ForwardBatch
    from minidsa.models.deepseek_v32 import DecoderLayer, LayerContext, MoE, RunLayer


def call_attend(layer: DecoderLayer, h: torch.Tensor, pending: torch.Tensor | None, ctx: LayerContext,
                prev_topk: torch.Tensor | None, caches: LayerCaches
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A MoE layer up to its exchange: (h, the rows to send, the shared experts' output for them or None, top-k).
    The shared experts need no other rank's rows: they run here, before the all-gather is issued."""
    h, x, x_quantized, topk = layer.attend(h, pending, ctx, prev_topk, caches)
    return h, x, layer.mlp.shared(x, x_quantized), topk


def call_routed(moe: MoE, gathered: torch.Tensor) -> torch.Tensor:
    """This rank's routed experts over every rank's gathered rows."""
    return moe.routed(gathered)


@dataclass(frozen=True)
class OverlapCalls:
    """How two-batch overlap calls a MoE layer's two stages (the runner hands in compiled ones)."""

    attend: Callable[..., tuple] = call_attend
    routed: Callable[["MoE", torch.Tensor], torch.Tensor] = call_routed


@dataclass
class _MicroBatch:
    """One micro-batch's state between layers. `pending`: the last layer's output not yet added to `h` (a tensor),
    or the reduce-scatter of its routed rows still in flight with its shared experts' output (`scattering`,
    `shared`): waited for where the next layer reads it."""

    ctx: LayerContext
    h: torch.Tensor
    pending: torch.Tensor | None
    topk: torch.Tensor | None
    scattering: torch.Tensor | None = None
    shared: torch.Tensor | None = None

    def settle(self, moe: MoE) -> None:
        if self.scattering is not None:
            y = moe.dp.wait(self.scattering)
            self.pending = y if self.shared is None else y + self.shared  # MoE._forward_dp's sum, in its order
            self.scattering = self.shared = None


def run_layers(layers: list[DecoderLayer], caches: list[LayerCaches], halves: tuple[ForwardBatch, ForwardBatch],
               contexts: tuple[LayerContext, LayerContext], h: torch.Tensor, pending: torch.Tensor | None,
               topk: torch.Tensor | None, run_layer: RunLayer, calls: OverlapCalls
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`layers` over the two micro-batches `halves` (their contexts), from the whole batch's (h, pending, top-k);
    returns the whole batch's again, the micro-batches' rows in order."""
    t = halves[0].num_tokens
    mbs = [_MicroBatch(ctx, h[s], None if pending is None else pending[s], None if topk is None else topk[s])
           for ctx, s in zip(contexts, (slice(0, t), slice(t, None)))]
    moe: MoE | None = None  # the last exchanging layer's MoE (its group settles what is in flight)
    for layer, cache in zip(layers, caches):
        if not layer.exchanges_rows:
            for mb in mbs:
                if moe is not None:
                    mb.settle(moe)
                mb.h, mb.pending, mb.topk = run_layer(layer, mb.h, mb.pending, mb.ctx, mb.topk, cache)
            continue
        dp, sent = layer.mlp.dp, []
        for mb in mbs:
            if moe is not None:
                mb.settle(moe)  # A's rows return under the last layer's experts of B; B's under this attend of A
            mb.h, x, mb.shared, mb.topk = calls.attend(layer, mb.h, mb.pending, mb.ctx, mb.topk, cache)
            sent.append(dp.start_all_gather_rows(x))
        for mb, gathering in zip(mbs, sent):
            mb.scattering = dp.start_reduce_scatter_rows(calls.routed(layer.mlp, dp.wait(gathering)))
        moe = layer.mlp
    if moe is not None:
        for mb in mbs:
            mb.settle(moe)
    cat = torch.cat
    return (cat([mb.h for mb in mbs]), cat([mb.pending for mb in mbs]),
            None if mbs[0].topk is None else cat([mb.topk for mb in mbs]))
