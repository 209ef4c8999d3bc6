"""The CUDA-graph static-buffer path: padded batches give the eager outputs of their real rows.

On CPU the graphs run eagerly over the same static buffers (capture=False), which
checks bucketing, padding rows at the dummy slot and per-step refresh; the
captured replay itself is checked by tests/gpu/test_graphs_gpu.py on a GPU.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_tiny import tiny_kwargs
from harness import PagedDriver
from minidsa.exec.batch import ForwardBatch
from minidsa.config import ModelConfig
from minidsa.exec.graphs import GraphShape, StepGraphs
from minidsa.models.loader import build_model
from minidsa.sched.plan import StepKind


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
