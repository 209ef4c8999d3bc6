"""CUDA graphs for the decode-like steps: DECODE, TARGET_VERIFY and the draft's DECODE steps.

One graph per (step kind, batch-size bucket, context bucket), captured at
start-up largest first into one shared memory pool. Each graph reads static input buffers
and writes static outputs; `replay` copies a real batch into the first rows,
points padding rows at the dummy slot 0 (row 0 of req_to_token, one visible
position), replays, and returns copies of the real rows' outputs. Per-step
metadata lives in those static tensors and is refreshed before each replay;
the graph itself never reads host state.

Static shapes: a bucket of `bs` requests has `bs * tokens_per_req` tokens;
its indexer rows span the context bucket (the smallest of `ctx_buckets` that
holds the batch's longest context; the last is the req_to_token width, max
context + draft tokens + 1), so short contexts do not pay for scoring and
selecting over the whole table.
Batches larger than the largest bucket, or of another shape, run eagerly.

The "extend" kind (prefill chunks and mixed steps: decode rows beside chunks, any tokens per request) is
bucketed by tokens instead (`EXTEND_TOKEN_BUCKETS`), with room for `max_requests` requests; its per-token
request index and logits rows are refreshed per step like every other input. Run uncaptured, such a step
spent ~20 ms of host time on a 4-layer model (the GPU idle 72% of it) against a 6 ms decode step.
Only (tokens, context) buckets whose indexer logits fit `EXTEND_GRAPH_MAX_LOGITS` are captured, so the
memory the graphs hold stays bounded; larger steps run uncaptured, where the host time is a smaller share.

Without a GPU the same static-buffer path can run eagerly (`capture=False`),
which is how CPU tests check the padding logic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from minidsa.batch import ForwardBatch, ForwardMode
from minidsa.models.deepseek_v32 import ModelOutput

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256)
EXTEND_TOKEN_BUCKETS = (32, 64, 128, 192, 256, 384, 512, 768, 1024)
EXTEND_GRAPH_MAX_LOGITS = 1 << 24  # tokens x context of a captured extend step: 64 MiB of fp32 indexer logits


@dataclass(frozen=True)
class StepKind:
    """What a captured step looks like."""

    name: str  # "decode" | "verify" | "draft" | "draft_extend" | "extend"
    mode: ForwardMode
    tokens_per_req: int  # 0: any ("extend"; its buckets count tokens)
    tree_width: int  # 0 = causal (no tree mask)
    mtp: bool  # runs the MTP layer (with a hidden-state input) instead of the main model


@dataclass
class _Static:
    batch: ForwardBatch
    hidden_in: torch.Tensor | None
    graph: object | None = None
    out: ModelOutput | None = None


class StepGraphs:
    def __init__(self, run_main: Callable[[ForwardBatch], ModelOutput],
                 run_mtp: Callable[[ForwardBatch, torch.Tensor], ModelOutput],
                 kinds: list[StepKind], buckets: list[int], max_kv_len: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, capture: bool = True,
                 ctx_buckets: list[int] | None = None, extend_buckets: list[int] | None = None,
                 max_requests: int = 0):
        self.run_main, self.run_mtp = run_main, run_mtp
        self.kinds = {k.name: k for k in kinds}
        self.buckets = sorted(set(buckets))
        self.extend_buckets = sorted(set(extend_buckets or ()))
        self.max_requests = max_requests  # requests an extend graph has room for
        self.max_kv_len = max_kv_len
        self.ctx_buckets = sorted({c for c in (ctx_buckets or []) if c < max_kv_len} | {max_kv_len})
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.capture = capture
        self.static: dict[tuple[str, int, int], _Static] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        for kind in kinds:
            for ctx in reversed(self.ctx_buckets):  # largest first: later graphs reuse its pool memory
                for bs in sorted(self._sizes(kind), reverse=True):
                    if kind.tokens_per_req or bs * ctx <= EXTEND_GRAPH_MAX_LOGITS:
                        self.static[(kind.name, bs, ctx)] = self._capture(kind, bs, ctx)
        if capture:
            logger.info("captured CUDA graphs: %s x batch buckets %s x context buckets %s; extend (tokens, "
                        "context): %s", [k.name for k in kinds if k.tokens_per_req], self.buckets,
                        self.ctx_buckets, sorted(k[1:] for k in self.static if not self.kinds[k[0]].tokens_per_req))

    def _sizes(self, kind: StepKind) -> list[int]:
        """Batch-size buckets of a kind; token buckets of the extend kind."""
        return self.buckets if kind.tokens_per_req else self.extend_buckets

    # -- shapes -----------------------------------------------------------------
    def bucket_for(self, kind: str, bs: int) -> int | None:
        if kind not in self.kinds:
            return None
        return next((b for b in self.buckets if b >= bs), None)

    def ctx_bucket_for(self, max_kv_len: int) -> int | None:
        return next((c for c in self.ctx_buckets if c >= max_kv_len), None)

    def extend_key(self, batch: ForwardBatch) -> tuple[str, int, int] | None:
        """The extend graph that takes this batch (its tokens, requests and logits rows fit), or None."""
        if "extend" not in self.kinds or batch.tree_mask is not None:
            return None
        t, ctx = batch.num_tokens, self.ctx_bucket_for(batch.max_kv_len)
        bucket = next((b for b in self.extend_buckets if b >= t), None)
        if bucket is None or ctx is None or ("extend", bucket, ctx) not in self.static:
            return None
        room = min(bucket, self.max_requests)
        if batch.batch_size > room or batch.logits_indices.numel() > room:
            return None
        return "extend", bucket, ctx

    def _static_batch(self, kind: StepKind, bs: int, ctx: int) -> ForwardBatch:
        dev = self.device
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
        if kind.tokens_per_req:
            t, reqs, per_req = bs * kind.tokens_per_req, bs, kind.tokens_per_req
            token_req, logits_rows = torch.arange(bs, device=dev).repeat_interleave(per_req), t
        else:  # extend: `bs` tokens from up to `room` requests, plus a spare request row for padding tokens
            t, room = bs, min(bs, self.max_requests)
            reqs, per_req, token_req, logits_rows = room + 1, 0, zeros(t), room
        return ForwardBatch(
            mode=kind.mode,
            input_ids=zeros(t),
            positions=zeros(t),
            out_cache_loc=zeros(t),  # slot 0: the dummy slot
            req_pool_indices=zeros(reqs),
            seq_lens=torch.ones(reqs, dtype=torch.int64, device=dev),
            extend_lens=torch.full((reqs,), per_req, dtype=torch.int64, device=dev),
            token_req=token_req,
            kv_lens=torch.ones(t, dtype=torch.int64, device=dev),
            logits_indices=torch.arange(logits_rows, device=dev),
            max_kv_len=ctx,
            tree_mask=(torch.zeros(t, kind.tree_width, dtype=torch.bool, device=dev) if kind.tree_width else None),
        )

    def _run(self, kind: StepKind, st: _Static) -> ModelOutput:
        if kind.mtp:
            return self.run_mtp(st.batch, st.hidden_in)
        return self.run_main(st.batch)

    def _capture(self, kind: StepKind, bs: int, ctx: int) -> _Static:
        batch = self._static_batch(kind, bs, ctx)
        hidden = (torch.zeros(batch.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                  if kind.mtp else None)
        st = _Static(batch=batch, hidden_in=hidden)
        if not self.capture:
            return st
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: allocator, autotuning, lazy init stay out of the graph
                self._run(kind, st)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            st.out = self._run(kind, st)
        st.graph = graph
        return st

    # -- replay -----------------------------------------------------------------
    def replay(self, kind_name: str, batch: ForwardBatch, hidden_in: torch.Tensor | None = None) -> ModelOutput:
        kind = self.kinds[kind_name]
        bs = batch.batch_size
        if kind.tokens_per_req:
            bucket = self.bucket_for(kind_name, bs)
            assert bucket is not None, f"no {kind_name} graph for batch size {bs}"
            assert batch.num_tokens == bs * kind.tokens_per_req, (f"{kind_name} graph expects {kind.tokens_per_req} "
                                                                  f"tokens per request, got {batch.num_tokens} for {bs}")
            ctx = self.ctx_bucket_for(batch.max_kv_len)
            assert ctx is not None, f"context {batch.max_kv_len} exceeds the graphs' {self.max_kv_len}"
            key = (kind_name, bucket, ctx)
        else:
            key = self.extend_key(batch)
            assert key is not None, (f"no extend graph for {batch.num_tokens} tokens of {bs} requests at context "
                                     f"{batch.max_kv_len}")
        st = self.static[key]
        s, t = st.batch, batch.num_tokens
        # Refresh every per-step tensor: real rows, then padding rows at the dummy slot / row 0.
        for name in ("input_ids", "positions", "out_cache_loc", "kv_lens"):
            dst, src = getattr(s, name), getattr(batch, name)
            dst[:t].copy_(src)
            dst[t:].fill_(1 if name == "kv_lens" else 0)
        s.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        s.req_pool_indices[bs:].fill_(0)
        s.seq_lens[:bs].copy_(batch.seq_lens)
        s.seq_lens[bs:].fill_(1)
        n = batch.logits_indices.numel()
        if not kind.tokens_per_req:  # which request each token belongs to, which rows give logits
            spare = s.batch_size - 1  # padding tokens: a request row of its own at the dummy row 0
            s.token_req[:t].copy_(batch.token_req)
            s.token_req[t:].fill_(spare)
            s.extend_lens[:bs].copy_(batch.extend_lens)
            s.extend_lens[bs:].fill_(0)
            s.logits_indices[:n].copy_(batch.logits_indices)
            s.logits_indices[n:].fill_(0)
        if kind.tree_width:
            assert batch.tree_mask is not None and batch.tree_mask.shape[1] == kind.tree_width
            s.tree_mask[:t].copy_(batch.tree_mask)
            s.tree_mask[t:].fill_(False)
        if kind.mtp:
            st.hidden_in[:t].copy_(hidden_in)
            st.hidden_in[t:].zero_()
        out = st.out if st.graph is not None else None
        if st.graph is not None:
            st.graph.replay()
        else:
            out = self._run(kind, st)
        # Copies: the static outputs are overwritten by the next replay.
        logits = out.logits[batch.logits_indices] if kind.tokens_per_req else out.logits[:n]
        return ModelOutput(hidden=out.hidden[:t].clone(), logits=logits.clone(),
                           topk=None if out.topk is None else out.topk[:t].clone())
