"""The CUDA-graph static-buffer path: padded batches give the eager outputs of their real rows.

On CPU the graphs run eagerly over the same static buffers (capture=False), which
checks bucketing, padding rows at the dummy slot and per-step refresh; the
captured replay itself is checked by tests/gpu/test_graphs_gpu.py on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_tiny import tiny_kwargs
from harness import PagedDriver
from minidsa.common.batch import ForwardBatch
from minidsa.config import ModelConfig
from minidsa.exec import graphs as graphs_module
from minidsa.exec.graphs import GraphShape, StepGraphs
from minidsa.models.deepseek_v32 import ModelOutput
from minidsa.models.loader import build_model
from minidsa.common.plan import StepKind


def _setup():
    raw = tiny_kwargs("deepseek_v32", num_nextn_predict_layers=1)
    raw["architectures"] = ["DeepseekV32ForCausalLM"]
    config = ModelConfig.from_dict(raw)
    model = build_model(config, None, torch.float32, torch.device("cpu"), seed=0, init_std=0.1)
    driver = PagedDriver(model, config, page_size=1, max_len=96)
    g = torch.Generator().manual_seed(0)
    for n in (20, 31, 17):
        driver.add(torch.randint(2, config.vocab_size, (n,), generator=g).tolist(), reserve=8)
    driver.prefill([0, 1, 2])
    return model, config, driver


def test_padded_decode_and_verify_match_eager():
    model, config, d = _setup()
    run_main = lambda b: model(b, d.attn)  # noqa: E731
    run_mtp = lambda b, h: model.forward_mtp(b, d.attn, h, None)  # noqa: E731
    shapes = [GraphShape(StepKind.DECODE, 1, 0), GraphShape(StepKind.VERIFY, 3, 3), GraphShape(StepKind.DRAFT, 1, 0)]
    graphs = StepGraphs(run_main, run_mtp, shapes, [1, 2, 4], max_kv_len=96, hidden_size=config.hidden_size,
                        dtype=torch.float32, device=torch.device("cpu"), capture=False, ctx_buckets=[40])
    assert graphs.bucket_for(StepKind.DECODE, 3) == 4 and graphs.bucket_for(StepKind.DECODE, 5) is None
    # indexer rows span the smallest context bucket holding the batch (all batches below fit in 40)
    assert graphs.ctx_bucket_for(32) == 40 and graphs.ctx_bucket_for(41) == 96 and graphs.ctx_bucket_for(97) is None

    rows = [d.reqs[i]["row"] for i in range(3)]
    seq = [len(d.reqs[i]["tokens"]) for i in range(3)]
    r2t = d.table.req_to_token
    # decode: 3 requests in the 4-bucket
    loc = torch.stack([r2t[r, n].long() for r, n in zip(rows, seq)])
    batch = ForwardBatch.build(StepKind.DECODE, [5, 6, 7], rows, seq, [1, 1, 1], loc, "cpu")
    with torch.no_grad():
        eager = model(batch, d.attn)
        padded = graphs.replay(batch)
    assert torch.allclose(eager.logits, padded.logits, atol=1e-5)
    assert torch.equal(eager.topk, padded.topk)
    # the batch's kind picks the graph: the same shape as an MTP draft step takes the DRAFT graph, as a prefill none
    assert graphs.key_for(batch) == (StepKind.DECODE, 4, 40)
    assert graphs.key_for(dataclasses.replace(batch, kind=StepKind.DRAFT)) == (StepKind.DRAFT, 4, 40)
    assert graphs.key_for(dataclasses.replace(batch, kind=StepKind.EXTEND)) is None

    # verify: a 3-node chain per request with an explicit tree mask
    mask = torch.tril(torch.ones(3, 3, dtype=torch.bool)).repeat(3, 1)
    loc = torch.cat([r2t[r, n:n + 3].long() for r, n in zip(rows, seq)])
    pos = torch.tensor([n + j for n in seq for j in range(3)])
    kv = torch.tensor([n for n in seq for _ in range(3)])
    vbatch = ForwardBatch.build(StepKind.VERIFY, list(range(10, 19)), rows, seq, [3, 3, 3], loc, "cpu",
                                logits="all", positions=pos, kv_lens=kv, tree_mask=mask, max_kv_len=max(seq) + 3)
    with torch.no_grad():
        eager = model(vbatch, d.attn)
        padded = graphs.replay(vbatch)
    assert torch.allclose(eager.logits, padded.logits, atol=1e-5)

    # draft step of the MTP layer, 2 requests in the 2-bucket, hidden-state input
    hidden = torch.randn(2, config.hidden_size)
    dbatch = ForwardBatch.build(StepKind.DRAFT, [3, 4], rows[:2], seq[:2], [1, 1],
                                torch.stack([r2t[r, n].long() for r, n in zip(rows[:2], seq[:2])]), "cpu")
    with torch.no_grad():
        eager = model.forward_mtp(dbatch, d.attn, hidden, None)
        padded = graphs.replay(dbatch, hidden)
    assert torch.allclose(eager.logits, padded.logits, atol=1e-5)
    assert torch.allclose(eager.hidden, padded.hidden, atol=1e-5)
    d.release_all()


def test_padded_mixed_step_matches_eager():
    """The extend graph: decode rows beside a prefill chunk (any tokens per request), bucketed by tokens, with
    padding tokens at a spare request row; the logits of each request's last token as the eager step gives."""
    model, config, d = _setup()
    run_main = lambda b: model(b, d.attn)  # noqa: E731
    shapes = [GraphShape(StepKind.DECODE, 1, 0), GraphShape(StepKind.EXTEND, 0, 0)]
    graphs = StepGraphs(run_main, None, shapes, [1, 2], max_kv_len=96, hidden_size=config.hidden_size,
                        dtype=torch.float32, device=torch.device("cpu"), capture=False, ctx_buckets=[40],
                        extend_buckets=[8, 16], max_requests=3)
    g = torch.Generator().manual_seed(1)
    d.add(torch.randint(2, config.vocab_size, (9,), generator=g).tolist(), reserve=8)  # request 3: not prefilled
    rows = [d.reqs[i]["row"] for i in range(4)]
    seq = [len(d.reqs[i]["tokens"]) for i in range(3)]
    r2t = d.table.req_to_token
    # two decode rows (requests 0 and 2) and the first 7 tokens of request 3's prompt: 9 tokens -> bucket 16
    starts, lens = [seq[0], seq[2], 0], [1, 1, 7]
    loc = torch.cat([r2t[r, s:s + n].long() for r, s, n in zip([rows[0], rows[2], rows[3]], starts, lens)])
    ids = [5, 6] + d.reqs[3]["tokens"][:7]
    batch = ForwardBatch.build(StepKind.EXTEND, ids, [rows[0], rows[2], rows[3]], starts, lens, loc, "cpu")
    assert graphs.key_for(batch) == (StepKind.EXTEND, 16, 40)
    with torch.no_grad():
        eager = model(batch, d.attn)
        padded = graphs.replay(batch)
    assert padded.logits.shape == eager.logits.shape == (3, config.vocab_size)
    assert torch.allclose(eager.logits, padded.logits, atol=1e-5)
    assert torch.allclose(eager.hidden, padded.hidden, atol=1e-5)
    assert torch.equal(eager.topk, padded.topk)
    # no graph: more tokens than the largest bucket, more requests (or logits rows) than it has room for
    many = ForwardBatch.build(StepKind.EXTEND, list(range(17)), [rows[3]], [0], [17],
                              r2t[rows[3], :17].long(), "cpu")
    assert graphs.key_for(many) is None
    four = ForwardBatch.build(StepKind.EXTEND, [1, 2, 3, 4], rows, [seq[0], seq[1], seq[2], 0], [1, 1, 1, 1],
                              torch.stack([r2t[r, n].long() for r, n in zip(rows, seq + [0])]), "cpu")
    assert graphs.key_for(four) is None
    d.release_all()


# -- the per-step refresh of the static inputs ---------------------------------------------------------------------
_H, _V, _K = 6, 11, 4  # the recording model's hidden width, vocabulary, top-k width


def _recording_graphs(shapes: list[GraphShape]) -> tuple[StepGraphs, list[dict[str, torch.Tensor]]]:
    """Graphs (eager, static buffers) over a stand-in model that records the static inputs each step sees."""
    seen: list[dict[str, torch.Tensor]] = []

    def record(batch: ForwardBatch, hidden: torch.Tensor | None = None) -> ModelOutput:
        inputs = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        seen.append({k: v.clone() for k, v in (*inputs.items(), ("hidden_in", hidden)) if isinstance(v, torch.Tensor)})
        t, n = batch.num_tokens, batch.logits_indices.numel()
        return ModelOutput(hidden=torch.zeros(t, _H), logits=torch.zeros(n, _V),
                           topk=torch.zeros(t, _K, dtype=torch.int32))

    graphs = StepGraphs(record, record, shapes, [1, 2, 4], max_kv_len=64, hidden_size=_H, dtype=torch.float32,
                        device=torch.device("cpu"), capture=False, ctx_buckets=[16], extend_buckets=[8, 16],
                        max_requests=5)
    return graphs, seen


def _legacy_replay(graphs: StepGraphs, batch: ForwardBatch, hidden_in: torch.Tensor | None = None) -> None:
    """The refresh as it was before the single multi-tensor copy (a copy_ + fill_ per tensor), then the step."""
    shape = graphs.shapes[batch.kind]
    g = graphs._graph_for(graphs.key_for(batch))
    s, t, bs = g.batch, batch.num_tokens, batch.batch_size
    for name in ("input_ids", "positions", "out_cache_loc", "kv_lens"):
        dst, src = getattr(s, name), getattr(batch, name)
        dst[:t].copy_(src)
        dst[t:].fill_(1 if name == "kv_lens" else 0)
    s.req_pool_indices[:bs].copy_(batch.req_pool_indices)
    s.req_pool_indices[bs:].fill_(0)
    s.seq_lens[:bs].copy_(batch.seq_lens)
    s.seq_lens[bs:].fill_(1)
    n = batch.logits_indices.numel()
    s.logits_indices[:n].copy_(batch.logits_indices)
    s.logits_indices[n:].fill_(0)
    if not shape.tokens_per_req:
        spare = s.batch_size - 1
        s.token_req[:t].copy_(batch.token_req)
        s.token_req[t:].fill_(spare)
        s.extend_lens[:bs].copy_(batch.extend_lens)
        s.extend_lens[bs:].fill_(0)
    if shape.tree_width:
        s.tree_mask[:t].copy_(batch.tree_mask)
        s.tree_mask[t:].fill_(False)
    if shape.mtp:
        g.hidden_in[:t].copy_(hidden_in)
        g.hidden_in[t:].zero_()
    graphs._run(shape, g)


def _random_batch(shape: GraphShape, bs: int, gen: torch.Generator, tokens: int = 0,
                  max_kv_len: int = 12) -> tuple[ForwardBatch, torch.Tensor | None]:
    """A batch of `bs` requests with random values in every field (no model reads them), and a hidden input."""
    t = tokens or bs * shape.tokens_per_req
    ints = lambda n: torch.randint(2, 1000, (n,), generator=gen)  # noqa: E731
    n = bs if shape.logits_per_req or not shape.tokens_per_req else t  # EXTEND: each request's last token
    batch = ForwardBatch(
        kind=shape.kind, input_ids=ints(t), positions=ints(t), out_cache_loc=ints(t), req_pool_indices=ints(bs),
        seq_lens=ints(bs), extend_lens=ints(bs), token_req=ints(t), kv_lens=ints(t), logits_indices=ints(n),
        max_kv_len=max_kv_len,
        tree_mask=torch.rand(t, shape.tree_width, generator=gen) < 0.5 if shape.tree_width else None)
    hidden = torch.randn(t, _H, generator=gen) if shape.mtp else None
    return batch, hidden


# every kind a deployment captures: plain decode, a tree speculator's (tree verify, tree draft with a hidden input,
# draft extend), a chain draft step, and prefill / mixed steps (token_req padding: the spare row)
_SHAPE_SETS = [
    [GraphShape(StepKind.DECODE, 1, 0, logits_per_req=1), GraphShape(StepKind.EXTEND, 0, 0)],
    [GraphShape(StepKind.VERIFY, 4, 4), GraphShape(StepKind.DRAFT_EXTEND, 4, 0, logits_per_req=1),
     GraphShape(StepKind.DRAFT, 2, 6)],
    [GraphShape(StepKind.VERIFY, 3, 0), GraphShape(StepKind.DRAFT, 1, 0)],
]
# (requests, tokens for EXTEND, max_kv_len): padded, full and one-request buckets, a larger context bucket, and a
# padded batch after a full one (its padding rows held real values the step before)
_SIZES = [(3, 5, 12), (4, 8, 12), (1, 1, 12), (3, 13, 40), (4, 16, 12), (2, 7, 12), (4, 8, 40), (3, 9, 40)]


@pytest.mark.parametrize("plans", [graphs_module.REFRESH_PLANS, 2])
def test_packed_refresh_matches_per_tensor_refresh(plans, monkeypatch):
    """The one-copy refresh leaves every static input (real rows and padding) as the per-tensor copies did; its
    per-signature plans are reused (every size twice), or evicted (2 kept)."""
    monkeypatch.setattr(graphs_module, "REFRESH_PLANS", plans)
    gen = torch.Generator().manual_seed(0)
    for shapes in _SHAPE_SETS:
        (packed, seen), (legacy, legacy_seen) = _recording_graphs(shapes), _recording_graphs(shapes)
        for shape in shapes:
            for bs, tokens, ctx in _SIZES * 2:
                if not shape.tokens_per_req:
                    bs = min(bs, 5, tokens)
                batch, hidden = _random_batch(shape, bs, gen, 0 if shape.tokens_per_req else tokens, ctx)
                assert packed.key_for(batch) is not None
                packed.replay(batch, hidden)
                _legacy_replay(legacy, batch, hidden)
                assert seen[-1].keys() == legacy_seen[-1].keys()
                for name in seen[-1]:
                    assert torch.equal(seen[-1][name], legacy_seen[-1][name]), (shape.kind, bs, name)
                # the padding values themselves, not only agreement with the old code
                got, t, reqs = seen[-1], batch.num_tokens, batch.batch_size
                assert torch.equal(got["input_ids"][:t], batch.input_ids)
                assert (got["kv_lens"][t:] == 1).all() and (got["seq_lens"][reqs:] == 1).all()
                assert (got["out_cache_loc"][t:] == 0).all() and (got["req_pool_indices"][reqs:] == 0).all()
                if not shape.tokens_per_req:
                    assert (got["token_req"][t:] == got["req_pool_indices"].numel() - 1).all()
                if shape.tree_width:
                    assert torch.equal(got["tree_mask"][:t], batch.tree_mask) and not got["tree_mask"][t:].any()
        # every static buffer of every kind ends the same (nothing written outside the graphs' views either)
        for kind, buffers in packed._buffers.items():
            for f in dataclasses.fields(buffers.batch):
                a, b = getattr(buffers.batch, f.name), getattr(legacy._buffers[kind].batch, f.name)
                assert not isinstance(a, torch.Tensor) or torch.equal(a, b), (kind, f.name)


class _Writes(TorchDispatchMode):
    """The ops (views aside) dispatched until the model runs: what a step's refresh does to device state."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.model_ran = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        view = returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        if not self.model_ran and not view:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_refresh_is_one_copy():
    """Every per-step input of a step (integers and the tree mask, real rows and padding) is refreshed by one
    multi-tensor copy (one launch on CUDA); the MTP kinds add their hidden-state input's copy (and its padding's
    fill). Nothing else touches device state before the step runs: no allocation, no per-tensor copy or fill."""
    gen = torch.Generator().manual_seed(1)
    for shapes in _SHAPE_SETS:
        graphs, _ = _recording_graphs(shapes)
        for shape in shapes:
            for bs, tokens, ctx in _SIZES[:4]:
                if not shape.tokens_per_req:
                    bs = min(bs, 5, tokens)
                batch, hidden = _random_batch(shape, bs, gen, 0 if shape.tokens_per_req else tokens, ctx)
                graphs.replay(batch, hidden)  # the graph's first step sizes the output buffers
                writes = _Writes()
                run_main, run_mtp = graphs.run_main, graphs.run_mtp

                def entered(run):
                    def step(*args):
                        writes.model_ran = True
                        return run(*args)
                    return step

                graphs.run_main, graphs.run_mtp = entered(run_main), entered(run_mtp)
                with writes:
                    graphs.replay(batch, hidden)
                graphs.run_main, graphs.run_mtp = run_main, run_mtp
                expected = [torch.ops.aten._foreach_copy_.default]
                if shape.mtp:
                    padded = graphs._graph_for(graphs.key_for(batch)).hidden_in.shape[0] > batch.num_tokens
                    expected += [torch.ops.aten.copy_.default] + [torch.ops.aten.zero_.default] * padded
                assert writes.model_ran and writes.ops == expected, (shape.kind, bs, writes.ops)
