"""The model definition traces into one graph (no graph breaks) for decode and target verify.

torch.compile today compiles the FFN blocks in the engine (runner.prepare_fast_paths); this pins that
the whole forward stays break-free, so compiling all of it stays a switch away.
"""

from __future__ import annotations

import torch

from harness import PagedDriver
from minidsa.batch import ForwardBatch, ForwardMode
from minidsa.config import ModelConfig
from minidsa.models.loader import build_model
from minidsa.models.presets import preset_config


def test_decode_and_verify_forward_have_no_graph_breaks():
    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw["vocab_size"] = 512
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=0, init_std=0.1)
    d = PagedDriver(model, cfg, page_size=1, max_len=128)
    for n in (40, 50):
        d.add(list(range(3, 3 + n)), reserve=4)
    d.prefill([0, 1])
    rows, seq = [d.reqs[i]["row"] for i in range(2)], [40, 50]
    r2t = d.pool.req_to_token
    decode = ForwardBatch.build(ForwardMode.DECODE, [5, 6], rows, seq, [1, 1],
                                torch.stack([r2t[r, n].long() for r, n in zip(rows, seq)]), "cpu")
    mask = torch.tril(torch.ones(3, 3, dtype=torch.bool)).repeat(2, 1)
    verify = ForwardBatch.build(ForwardMode.TARGET_VERIFY, list(range(10, 16)), rows, seq, [3, 3],
                                torch.cat([r2t[r, n:n + 3].long() for r, n in zip(rows, seq)]), "cpu", logits="all",
                                positions=torch.tensor([n + j for n in seq for j in range(3)]),
                                kv_lens=torch.tensor([n for n in seq for _ in range(3)]), tree_mask=mask,
                                max_kv_len=max(seq) + 3)
    with torch.no_grad():
        for batch in (decode, verify):
            ex = torch._dynamo.explain(model.forward)(batch, d.attn)
            assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
            assert ex.graph_count == 1
            hidden = torch.zeros(batch.num_tokens, cfg.hidden_size)
            ex = torch._dynamo.explain(model.forward_mtp)(batch, d.attn, hidden, None)
            assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
    d.release_all()
