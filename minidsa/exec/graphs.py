"""CUDA graphs for every step whose shape can be fixed: decode, target verify, the draft's steps, draft extend,
and prefill chunks / mixed steps (EXTEND).

One graph per (step kind, batch-size bucket, context bucket), all in one shared memory pool. The kind is the batch's
`StepKind` (common/plan.py: `replay(batch)` picks the graph from it); each captured kind has a `GraphShape`. Each
graph reads static input buffers and writes static output buffers; `replay` copies a real batch into the first
rows, points padding rows at the dummy slot 0 (row 0 of req_to_token, one visible position), all in one
multi-tensor copy, replays, and returns views of the real rows' outputs. The graph itself never reads host state.

Buffers are per kind, not per graph: every graph of a kind reads views of one set of input buffers and writes one
set of output buffers, sized for the kind's largest bucket. A graph's own intermediates live in the shared pool and
are reused by the next capture, so the memory graphs hold is one kind-sized set of buffers plus the largest
graph's working set, whatever the number of graphs. The price is that a replay's outputs stay valid only until
the next replay of the same kind: callers consume them (enqueue the work that reads them) first, which every
caller does (sampling, acceptance, the next draft step's input copy).

Static shapes: a bucket of `bs` requests has `bs * tokens_per_req` tokens; its indexer rows span the context
bucket (the smallest of `ctx_buckets` that holds the batch's longest context; the last is the req_to_token width,
max context + draft tokens + 1), so short contexts do not pay for scoring and selecting over the whole table.
The smallest context bucket of every kind is captured at start-up; a larger one the first time a batch needs it
(a capture costs a few forwards and a device sync, once), so start-up does not pay for contexts a deployment
never sees. Batches larger than the largest bucket, or of another shape, run uncaptured.

The EXTEND kind (prefill chunks and mixed steps: decode rows beside chunks, any tokens per request) is bucketed by
tokens instead (`EXTEND_TOKEN_BUCKETS`), with room for `max_requests` requests; its per-token request index and
logits rows are refreshed per step like every other input. Run uncaptured, such a step spent ~20 ms of host time on
a 4-layer model (the GPU idle 72% of it) against a 6 ms decode step. Only (tokens, context) buckets whose indexer
logits fit `EXTEND_GRAPH_MAX_LOGITS` are captured, so the memory a graph's working set needs stays bounded; larger
steps run uncaptured, where the host time is a smaller share.

Two-batch overlap (DP attention, `two_batch_min`): the static batch of a DECODE or VERIFY graph of enough tokens
says where it splits into two micro-batches (`ForwardBatch.two_batches`); the model interleaves their MoE layers
(models/two_batch.py) inside the one graph.

Without a GPU the same static-buffer path can run eagerly (`capture=False`), which is how CPU tests check the
padding logic.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from minidsa.common.batch import ForwardBatch
from minidsa.common.plan import StepKind
from minidsa.models.deepseek_v32 import ModelOutput

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256)
EXTEND_TOKEN_BUCKETS = (32, 64, 128, 192, 256, 384, 512, 768, 1024)
EXTEND_GRAPH_MAX_LOGITS = 1 << 24  # tokens x context of a captured extend step: 64 MiB of fp32 indexer logits
REFRESH_PLANS = 512  # (graph, batch signature) refresh plans kept (`StepGraphs._refresh`), a few KiB of views each


@dataclass(frozen=True)
class GraphShape:
    """What the captured steps of one kind look like."""

    kind: StepKind  # DECODE, VERIFY, DRAFT, DRAFT_EXTEND or EXTEND
    tokens_per_req: int  # 0: any (EXTEND; its buckets count tokens)
    tree_width: int  # 0 = causal (no tree mask)
    logits_per_req: int = 0  # rows of logits per request (0: every token); the EXTEND kind: one per request

    @property
    def mtp(self) -> bool:
        """Runs the MTP layer (with a hidden-state input) instead of the main model."""
        return self.kind.runs_mtp

    def logit_rows(self, bs: int) -> int:
        return bs * (self.logits_per_req or self.tokens_per_req)


@dataclass
class _Buffers:
    """One kind's static inputs (a batch of its largest size, plus the MTP hidden-state input) and outputs."""

    batch: ForwardBatch
    hidden_in: torch.Tensor | None
    hidden: torch.Tensor | None = None  # outputs: allocated at the kind's first capture, from the output widths
    logits: torch.Tensor | None = None
    topk: torch.Tensor | None = None


@dataclass
class _Graph:
    batch: ForwardBatch  # views of the kind's input buffers, this graph's shape
    hidden_in: torch.Tensor | None
    graph: object | None = None
    # What `replay` refreshes: (field, "tokens" / "reqs" / "logits": its real rows, padding value), and each such
    # field's static tensor as flat bytes.
    refreshed: tuple[tuple[str, str, int], ...] = ()
    bytes: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclass
class _Refresh:
    """A step's refresh of one graph's inputs for one (tokens, requests, logits rows), all but the batch's own
    tensors: made once per such signature, so a step slices no static buffer (host time: ~25 python-level tensor
    ops a step otherwise)."""

    real: list[tuple[str, torch.dtype]]  # the fields with real rows (and their static dtype), in `dst`'s order
    dst: list[torch.Tensor]  # bytes: those fields' real rows, then every padding region
    pads: list[torch.Tensor]  # bytes: the padding regions' sources (slices of the fills)


class StepGraphs:
    def __init__(self, run_main: Callable[[ForwardBatch], ModelOutput],
                 run_mtp: Callable[[ForwardBatch, torch.Tensor], ModelOutput],
                 shapes: list[GraphShape], buckets: list[int], max_kv_len: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, capture: bool = True,
                 ctx_buckets: list[int] | None = None, extend_buckets: list[int] | None = None,
                 max_requests: int = 0, two_batch_min: int = 0):
        self.run_main, self.run_mtp = run_main, run_mtp
        # Two-batch overlap (DP attention): the main model's graphs of at least this many tokens run their batch as
        # two micro-batches (`ForwardBatch.two_batches`, models/two_batch.py); 0: off
        self.two_batch_min = two_batch_min
        self.shapes = {s.kind: s for s in shapes}
        self.buckets = sorted(set(buckets))
        self.extend_buckets = sorted(set(extend_buckets or ()))
        self.max_requests = max_requests  # requests an extend graph has room for
        self.max_kv_len = max_kv_len
        self.ctx_buckets = sorted({c for c in (ctx_buckets or []) if c < max_kv_len} | {max_kv_len})
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.capture = capture
        self.static: dict[tuple[StepKind, int, int], _Graph] = {}
        self.captured_lazily: list[tuple[StepKind, int, int]] = []
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captured: list[torch.cuda.CUDAGraph] = []  # every graph captured so far: see `release_captured`
        self._buffers = {s.kind: self._kind_buffers(s) for s in shapes}
        # Padding values `replay` copies from (`_fill`): each as long as the longest static input, in 8-byte words.
        inputs = [getattr(b.batch, f.name) for b in self._buffers.values() for f in dataclasses.fields(b.batch)]
        self._fill_len = max((-(-t.nbytes // 8) for t in inputs if isinstance(t, torch.Tensor)), default=0)
        self._fill_bytes: dict[int, torch.Tensor] = {}
        for value in (0, 1):
            self._fill(value)
        self._refreshes: dict[tuple, _Refresh] = {}  # (graph key, tokens, requests, logits rows), oldest first
        start = time.perf_counter()
        smallest = self.ctx_buckets[0]
        for shape in shapes:
            for bs in sorted(self._sizes(shape), reverse=True):  # largest first: later graphs reuse its pool memory
                if self._capturable(shape, bs, smallest):
                    self.static[(shape.kind, bs, smallest)] = self._capture(shape, bs, smallest)
        if capture:
            logger.info("captured %d CUDA graphs in %.1f s: %s x batch buckets %s at context %d; extend token "
                        "buckets %s; larger contexts (%s) are captured on first use", len(self.static),
                        time.perf_counter() - start, [s.kind.name.lower() for s in shapes if s.tokens_per_req],
                        self.buckets, smallest, [b for (k, b, _) in self.static if k == StepKind.EXTEND],
                        self.ctx_buckets[1:])

    def _sizes(self, shape: GraphShape) -> list[int]:
        """Batch-size buckets of a kind; token buckets of the EXTEND kind."""
        return self.buckets if shape.tokens_per_req else self.extend_buckets

    @staticmethod
    def _capturable(shape: GraphShape, size: int, ctx: int) -> bool:
        return bool(shape.tokens_per_req) or size * ctx <= EXTEND_GRAPH_MAX_LOGITS

    # -- shapes -----------------------------------------------------------------
    def bucket_for(self, kind: StepKind, bs: int) -> int | None:
        if kind not in self.shapes:
            return None
        return next((b for b in self.buckets if b >= bs), None)

    def ctx_bucket_for(self, max_kv_len: int) -> int | None:
        return next((c for c in self.ctx_buckets if c >= max_kv_len), None)

    def key_for(self, batch: ForwardBatch) -> tuple[StepKind, int, int] | None:
        """The graph of the batch's kind that takes it (captured or not yet), or None when none can."""
        shape = self.shapes.get(batch.kind)
        ctx = self.ctx_bucket_for(batch.max_kv_len)
        if shape is None or ctx is None:
            return None
        if (batch.tree_mask is None) != (shape.tree_width == 0):
            return None
        if shape.tree_width and batch.tree_mask.shape[1] != shape.tree_width:
            return None
        if shape.tokens_per_req:
            bucket = self.bucket_for(shape.kind, batch.batch_size)
            if bucket is None or batch.num_tokens != batch.batch_size * shape.tokens_per_req:
                return None
            if batch.logits_indices.numel() > shape.logit_rows(bucket):
                return None
            return shape.kind, bucket, ctx
        bucket = next((b for b in self.extend_buckets if b >= batch.num_tokens), None)
        if bucket is None or not self._capturable(shape, bucket, ctx):
            return None
        room = min(bucket, self.max_requests)
        if batch.batch_size > room or batch.logits_indices.numel() > room:
            return None
        return shape.kind, bucket, ctx

    # -- static buffers -------------------------------------------------------------
    def _kind_buffers(self, shape: GraphShape) -> _Buffers:
        """Inputs for the kind's largest graph; every graph of the kind reads views of them."""
        dev = self.device
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
        if shape.tokens_per_req:
            reqs = max(self.buckets)
            tokens, logit_rows = reqs * shape.tokens_per_req, shape.logit_rows(reqs)
        else:  # extend: `bs` tokens from up to `room` requests, plus a spare request row for padding tokens
            tokens = max(self.extend_buckets, default=0)
            reqs, logit_rows = min(tokens, self.max_requests) + 1, min(tokens, self.max_requests)
        batch = ForwardBatch(
            kind=shape.kind, input_ids=zeros(tokens), positions=zeros(tokens), out_cache_loc=zeros(tokens),
            req_pool_indices=zeros(reqs), seq_lens=zeros(reqs), extend_lens=zeros(reqs), token_req=zeros(tokens),
            kv_lens=zeros(tokens), logits_indices=zeros(logit_rows), max_kv_len=0,
            tree_mask=(torch.zeros(tokens, shape.tree_width, dtype=torch.bool, device=dev)
                       if shape.tree_width else None))
        hidden_in = (torch.zeros(tokens, self.hidden_size, dtype=self.dtype, device=dev) if shape.mtp else None)
        # Graphs read views of these; Dynamo traces a view's base too. Left dynamic, the base's length would be
        # "duck-sized" into the batch's symbol whenever the largest bucket is traced first (equal sizes), and
        # every smaller bucket would compile the layer again.
        for t in (*(getattr(batch, f.name) for f in dataclasses.fields(batch)), hidden_in):
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static(t)
        return _Buffers(batch, hidden_in)

    def _graph_views(self, shape: GraphShape, size: int, ctx: int) -> _Graph:
        """A graph's static batch: views of the kind's buffers, reset to the dummy state (slot 0, row 0, one
        visible position), so warm-up and capture runs touch no request's cache."""
        b = self._buffers[shape.kind]
        full = b.batch
        if shape.tokens_per_req:
            t, reqs, n = size * shape.tokens_per_req, size, shape.logit_rows(size)
        else:
            room = min(size, self.max_requests)
            t, reqs, n = size, room + 1, room
        batch = ForwardBatch(
            kind=shape.kind, input_ids=full.input_ids[:t], positions=full.positions[:t],
            out_cache_loc=full.out_cache_loc[:t], req_pool_indices=full.req_pool_indices[:reqs],
            seq_lens=full.seq_lens[:reqs], extend_lens=full.extend_lens[:reqs], token_req=full.token_req[:t],
            kv_lens=full.kv_lens[:t], logits_indices=full.logits_indices[:n], max_kv_len=ctx,
            tree_mask=None if full.tree_mask is None else full.tree_mask[:t],
            two_batches=self._two_batches(shape, size))
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices"):
            getattr(batch, name).zero_()
        batch.seq_lens.fill_(1)
        batch.kv_lens.fill_(1)
        if shape.tokens_per_req:
            batch.extend_lens.fill_(shape.tokens_per_req)
            batch.token_req.copy_(torch.arange(reqs, device=self.device).repeat_interleave(shape.tokens_per_req))
            per = shape.logits_per_req or shape.tokens_per_req
            first = torch.arange(reqs, device=self.device).repeat_interleave(per) * shape.tokens_per_req
            batch.logits_indices.copy_(first + torch.arange(per, device=self.device).repeat(reqs))
        else:
            batch.extend_lens.zero_()
            batch.token_req.zero_()
            batch.logits_indices.copy_(torch.arange(n, device=self.device))
        if batch.tree_mask is not None:
            batch.tree_mask.zero_()
        hidden_in = None if b.hidden_in is None else b.hidden_in[:t]
        if hidden_in is not None:
            hidden_in.zero_()
        refreshed = [("input_ids", "tokens", 0), ("positions", "tokens", 0), ("out_cache_loc", "tokens", 0),
                     ("kv_lens", "tokens", 1), ("req_pool_indices", "reqs", 0), ("seq_lens", "reqs", 1),
                     ("logits_indices", "logits", 0)]
        if not shape.tokens_per_req:  # which request each token belongs to; padding tokens: the spare row
            refreshed += [("token_req", "tokens", self._fill(reqs - 1)), ("extend_lens", "reqs", 0)]
        if shape.tree_width:
            refreshed.append(("tree_mask", "tokens", 0))  # zero bytes: False
        views = {name: getattr(batch, name).view(-1).view(torch.uint8) for name, _, _ in refreshed}
        return _Graph(batch, hidden_in, refreshed=tuple(refreshed), bytes=views)

    def _two_batches(self, shape: GraphShape, size: int) -> int | None:
        """The first micro-batch's tokens (its first half of the requests) of a graph of `size` requests, where
        two-batch overlap splits it: the main model's fixed-shape kinds, from `two_batch_min` tokens."""
        if not self.two_batch_min or shape.mtp or not shape.tokens_per_req or size < 2 or \
                size * shape.tokens_per_req < self.two_batch_min:
            return None
        return size // 2 * shape.tokens_per_req

    def _fill(self, value: int) -> int:
        """Makes `value`'s padding source once (at start-up or a graph's capture): int64 `value`s on the device,
        as bytes. A step's padding is a slice of one, so the refresh allocates and fills nothing."""
        if value not in self._fill_bytes:
            words = torch.full((self._fill_len,), value, dtype=torch.int64, device=self.device)
            self._fill_bytes[value] = words.view(torch.uint8)
        return value

    # -- capture ----------------------------------------------------------------
    def _run(self, shape: GraphShape, g: _Graph) -> ModelOutput:
        """One step over a graph's static batch, its outputs written into the kind's output buffers."""
        out = self.run_mtp(g.batch, g.hidden_in) if shape.mtp else self.run_main(g.batch)
        b = self._buffers[shape.kind]
        if b.logits is None:  # the first run of the kind (its largest graph): output widths are known now
            tokens, rows = b.batch.num_tokens, b.batch.logits_indices.numel()
            b.hidden = out.hidden.new_empty(tokens, out.hidden.shape[1])
            b.logits = out.logits.new_empty(rows, out.logits.shape[1])
            b.topk = None if out.topk is None else out.topk.new_empty(tokens, out.topk.shape[1])
        t, n = g.batch.num_tokens, g.batch.logits_indices.numel()
        b.hidden[:t].copy_(out.hidden)
        b.logits[:n].copy_(out.logits)
        if b.topk is not None and out.topk is not None:
            b.topk[:t].copy_(out.topk)
        return ModelOutput(hidden=b.hidden[:t], logits=b.logits[:n], topk=None if b.topk is None else b.topk[:t])

    def _capture(self, shape: GraphShape, size: int, ctx: int) -> _Graph:
        g = self._graph_views(shape, size, ctx)
        if not self.capture:
            return g
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # One run first, so compilation, autotuning, the allocator's growth and lazy init stay out of the graph
            # (a second one was one more pass through every layer per graph; the GPU tests compare replays with eager).
            self._run(shape, g)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._run(shape, g)
        g.graph = graph
        self.captured.append(graph)
        return g

    def _graph_for(self, key: tuple[StepKind, int, int]) -> _Graph:
        g = self.static.get(key)
        if g is None:  # a context bucket this deployment meets for the first time
            start = time.perf_counter()
            g = self.static[key] = self._capture(self.shapes[key[0]], key[1], key[2])
            self.captured_lazily.append(key)
            if self.capture:
                logger.info("captured the %s graph for %d at context %d on first use (%.0f ms)",
                            key[0].name.lower(), key[1], key[2], 1000 * (time.perf_counter() - start))
        return g

    def _refresh(self, key: tuple[StepKind, int, int], g: _Graph, t: int, bs: int, n: int) -> _Refresh:
        real, real_dst, pad_dst, pads = [], [], [], []
        rows = {"tokens": t, "reqs": bs, "logits": n}
        for name, per, pad in g.refreshed:
            static, whole = getattr(g.batch, name), g.bytes[name]
            if not whole.numel():
                continue
            width = rows[per] * whole.shape[0] // static.shape[0]
            if width:
                real.append((name, static.dtype))
                real_dst.append(whole[:width])
            if whole.shape[0] > width:
                pad_dst.append(whole[width:])
                pads.append(self._fill_bytes[pad][:whole.shape[0] - width])
        if len(self._refreshes) >= REFRESH_PLANS:  # bounded: extend steps meet many signatures
            del self._refreshes[next(iter(self._refreshes))]
        plan = self._refreshes[(key, t, bs, n)] = _Refresh(real, real_dst + pad_dst, pads)
        return plan

    # -- replay -----------------------------------------------------------------
    def replay(self, batch: ForwardBatch, hidden_in: torch.Tensor | None = None,
               key: tuple[StepKind, int, int] | None = None) -> ModelOutput:
        """Run `batch` through the graph of its kind (`hidden_in`: the MTP layer's hidden-state input). The outputs
        are views of the kind's buffers: valid until the next replay of the same kind.

        `key`: this graph, not the smallest that takes the batch (DP attention: every rank replays the bucket rank 0
        chose for all of them, its own batch possibly smaller, or empty on an idle rank)."""
        shape = self.shapes[batch.kind]
        if key is None:
            key = self.key_for(batch)
            assert key is not None, (f"no {batch.kind.name} graph for {batch.num_tokens} tokens of "
                                     f"{batch.batch_size} requests at context {batch.max_kv_len}")
        else:
            own = self.key_for(batch) if batch.batch_size else (batch.kind, key[1], key[2])
            assert own is not None and own[0] == key[0] and own[1] <= key[1] and own[2] <= key[2] \
                and key[1] in self._sizes(shape) and key[2] in self.ctx_buckets, (own, key)
        g = self._graph_for(key)
        t, bs, n = batch.num_tokens, batch.batch_size, batch.logits_indices.numel()
        # Refresh every per-step tensor, real rows then padding rows (the dummy slot / row 0), in ONE launch: a
        # multi-tensor copy (`_foreach_copy_`: one kernel on CUDA, where a copy_ + fill_ per tensor was up to 14
        # launches, each ~1 us of GPU time plus its host-side launch). Its fast path wants one dtype on each side,
        # so every pair travels as bytes (the bool tree mask too); padding comes from the device-resident fills
        # (`_fill`). The sources are device tensors already (input ids and cache slots are gathered on the
        # device: next_input_ids, req_to_token), so a host-packed H2D could not carry them. No host buffer is
        # read here, so none can be overwritten under an in-flight copy (ForwardBatch.build's one H2D stages
        # through a fresh pinned tensor, which the caching host allocator does not hand out again before that
        # copy's stream event completes).
        plan = self._refreshes.get((key, t, bs, n)) or self._refresh(key, g, t, bs, n)
        src = []
        for name, dtype in plan.real:
            real = getattr(batch, name)
            if real.dtype != dtype or not real.is_contiguous():  # no batch the engine builds
                real = real.to(dtype).contiguous()
            src.append(real.view(-1).view(torch.uint8))
        torch._foreach_copy_(plan.dst, src + plan.pads)
        if shape.mtp:  # activations, not step inputs: a plain device copy moves them fastest
            g.hidden_in[:t].copy_(hidden_in)
            if g.hidden_in.shape[0] > t:
                g.hidden_in[t:].zero_()
        if g.graph is not None:
            g.graph.replay()
        else:
            self._run(shape, g)
        b = self._buffers[batch.kind]
        return ModelOutput(hidden=b.hidden[:t], logits=b.logits[:n], topk=None if b.topk is None else b.topk[:t])


def release_captured(graphs: list) -> None:
    """Destroy the CUDA graphs in `graphs` (a StepGraphs' `captured`) now. NCCL (2.26 on) does not destroy or abort
    a communicator while a graph that captured one of its collectives lives: it polls until the graph is gone. A
    tensor-parallel rank calls this before leaving its process groups (parallel/launch.py `release_device_state`),
    so the order does not rest on the garbage collector. The list holds no reference to the runner, so a rank
    group can keep it without keeping the engine alive."""
    while graphs:
        graphs.pop().reset()
