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

Each micro-batch is a batch of its own (`ForwardBatch.micro_batches`): its attention and indexer inputs, and its own
top-k, handed from layer to layer as it is without the split, so the layers that reuse the previous layer's top-k
(GLM-5's shared indexer, DSA's top-k sharing) read their own micro-batch's. The layers before the first MoE layer
(the dense ones) run on the whole batch, once.

Where it applies: the main model's forwards under DP attention with at least `two_batch_overlap_min_tokens` tokens on
a rank. A CUDA graph (DECODE, VERIFY) splits its bucket's requests in half, decided at capture, alike on every rank
(`exec.graphs.StepGraphs`); an uncaptured step (prefill chunks, mixed steps) splits each rank's tokens in half,
decided by rank 0 for every rank with the step's layout (`parallel.dp_attention.step_two_batches`), a request cut in
two where the half falls inside it. Each micro-batch's exchange then pads its rows to the ranks' most, as the whole
step's would (an idle rank's one dummy token leaves its first micro-batch empty: it sends padding only). The MTP
layer's forwards run one batch.

The stages two-batch overlap interleaves are compiled like the whole layer (`exec.runner.ModelRunner`:
`OverlapCalls` of compiled `call_attend` / `call_routed`); the collectives run between them, in eager code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minidsa.common.tensor_parallel import TensorParallel

if TYPE_CHECKING:  # the model imports this module
    from minidsa.attention.backend import LayerCaches
    from minidsa.common.batch import ForwardBatch
    from minidsa.models.deepseek_v32 import DecoderLayer, LayerContext, MoE, RunLayer


def call_attend(layer: "DecoderLayer", h: torch.Tensor, pending: torch.Tensor | None, ctx: "LayerContext",
                prev_topk: torch.Tensor | None, caches: "LayerCaches"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A MoE layer up to its exchange: (h, the rows to send, the shared experts' output for them or None, top-k).
    The shared experts need no other rank's rows: they run here, before the all-gather is issued."""
    h, x, x_quantized, topk = layer.attend(h, pending, ctx, prev_topk, caches)
    return h, x, layer.mlp.shared(x, x_quantized), topk


def call_routed(moe: "MoE", gathered: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """This rank's routed experts over every rank's gathered rows (`real`: those that are not padding)."""
    return moe.routed(gathered, real)


@dataclass(frozen=True)
class OverlapCalls:
    """How two-batch overlap calls a MoE layer's two stages (the runner hands in compiled ones)."""

    attend: Callable[..., tuple] = call_attend
    routed: Callable[..., torch.Tensor] = call_routed


@dataclass
class _MicroBatch:
    """One micro-batch's state between layers. `pending`: the last layer's output not yet added to `h` (a tensor),
    or the reduce-scatter of its routed rows still in flight with its shared experts' output (`scattering`,
    `shared`): waited for where the next layer reads it. A micro-batch with no rows on this rank (`ctx` None) runs
    no attention, and joins every exchange with padding rows only."""

    batch: "ForwardBatch"
    ctx: "LayerContext | None"
    h: torch.Tensor
    pending: torch.Tensor | None
    topk: torch.Tensor | None
    scattering: torch.Tensor | None = None
    shared: torch.Tensor | None = None

    def settle(self) -> None:
        if self.scattering is not None:
            y = TensorParallel.wait(self.scattering)[:self.h.shape[0]]
            self.pending = y if self.shared is None else y + self.shared  # MoE._forward_dp's sum, in its order
            self.scattering = self.shared = None


def run_layers(layers: list["DecoderLayer"], caches: list["LayerCaches"],
               halves: tuple["ForwardBatch", "ForwardBatch"], contexts: list["LayerContext | None"], h: torch.Tensor,
               pending: torch.Tensor | None, topk: torch.Tensor | None, run_layer: "RunLayer", calls: OverlapCalls
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`layers` over the two micro-batches `halves` (their contexts; None for one with no rows here), from the whole
    batch's (h, pending, top-k); returns the whole batch's again, the micro-batches' rows in order."""
    t = halves[0].num_tokens

    def rows(x: torch.Tensor | None, first: bool) -> torch.Tensor | None:
        # the second half copied, not a view at an offset: a compiled stage sees its inputs as the warm-up's
        return None if x is None else x[:t] if first else x[t:].clone()

    mbs = [_MicroBatch(half, ctx, rows(h, first), rows(pending, first), rows(topk, first))
           for half, ctx, first in zip(halves, contexts, (True, False))]
    for layer, cache in zip(layers, caches):
        if not layer.exchanges_rows:
            for mb in (mb for mb in mbs if mb.ctx is not None):
                mb.settle()
                mb.h, mb.pending, mb.topk = run_layer(layer, mb.h, mb.pending, mb.ctx, mb.topk, cache)
            continue
        mlp, sent = layer.mlp, []
        for mb in mbs:
            mb.settle()  # A's rows return under the last layer's experts of B; B's under this attend of A
            x = mb.h
            if mb.ctx is not None:
                mb.h, x, mb.shared, mb.topk = calls.attend(layer, mb.h, mb.pending, mb.ctx, mb.topk, cache)
            sent.append(mlp.dp.start_all_gather_rows(mlp.rows_to_send(x, mb.batch)))
        for mb, gathering in zip(mbs, sent):
            y = calls.routed(mlp, mlp.dp.wait(gathering), mb.batch.dp_real_rows)
            mb.scattering = mlp.dp.start_reduce_scatter_rows(y)
    for mb in mbs:
        mb.settle()
    busy = [mb for mb in mbs if mb.ctx is not None] or mbs[:1]
    if len(busy) == 1:
        return busy[0].h, busy[0].pending, busy[0].topk
    cat = torch.cat
    return (cat([mb.h for mb in busy]), cat([mb.pending for mb in busy]),
            None if busy[0].topk is None else cat([mb.topk for mb in busy]))
