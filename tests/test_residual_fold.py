"""A layer hands its MLP / MoE output to the next layer unsummed, and that layer's input norm adds it to the residual
stream in its own launch (`DecoderLayer.forward`); after the last layer the model adds it. The outputs are the bytes
of the forward in which every layer added its output itself (`unfolded_forward`), in fp32 and bf16, for the main
model (prefill and decode) and the MTP layer. Within a MoE layer the shared experts' output is added by the routed
experts' op (`MoE.forward`): in fp32 the bytes of adding it on its own, in bf16 one rounding instead of two."""

from __future__ import annotations

import pytest
import torch

from harness import PagedDriver
from minidsa.config import ModelConfig
from minidsa.common.batch import ForwardBatch
from minidsa.models.deepseek_v32 import call_layer
from minidsa.models.loader import build_model
from minidsa.common.presets import preset_config
from minidsa.common.plan import StepKind


def unfolded_forward(model, batch, attn, hidden_prev=None, prev_topk=None):
    """(hidden, logits, top-k) as the forward computed them when each layer ended with `h = h + mlp(...)`: the main
    model's, or with `hidden_prev` the MTP layer's over the same rows."""
    ctx = model.layer_context(batch, attn)
    caches = attn.layer_caches

    def layer_output(layer, h, topk, i):
        x, xq = layer.input_layernorm.normed(h)
        a, topk = layer.self_attn(x, ctx, topk, caches[i], xq)
        h, x, xq = layer.post_attention_layernorm.add_normed(a, h)
        return h + layer.mlp(x, xq), topk

    embedded = model.model.embed_tokens(batch.input_ids)
    if hidden_prev is None:
        h, topk = embedded, None
        for i, layer in enumerate(model.main_layers):
            h, topk = layer_output(layer, h, topk, i)
        norm = model.model.norm
    else:
        mtp = model.mtp_layer
        h = mtp.eh_proj(torch.cat([mtp.enorm(embedded), mtp.hnorm(hidden_prev)], dim=-1))
        h, topk = layer_output(mtp, h, prev_topk, model.config.num_hidden_layers)
        norm = mtp.shared_head.norm
    return h, model.logits(norm.rows(h, batch.logits_indices)), topk


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (-0.0 is not 0.0)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def assert_unfolded_bytes(model, batch, attn, out, hidden_prev=None, prev_topk=None) -> None:
    hidden, logits, topk = unfolded_forward(model, batch, attn, hidden_prev, prev_topk)
    assert same_bits(out.hidden, hidden)
    assert same_bits(out.logits, logits)
    assert (out.topk is None and topk is None) or torch.equal(out.topk, topk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_residual_gives_the_unfolded_bytes(dtype):
    raw = preset_config("tiny")
    raw.pop("initializer_range")
    # two dense layers, then MoE layers: the first layer's kind has another layer, as in the real models
    raw.update(vocab_size=256, num_hidden_layers=4, first_k_dense_replace=2)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, dtype, torch.device("cpu"), seed=3, init_std=0.1, progress=False)
    with torch.no_grad():
        # a -0.0 in the embedding: the first layer's norm must hand it on as -0.0
        model.model.embed_tokens.weight[:, ::7] = -0.0
    d = PagedDriver(model, cfg, page_size=4, max_len=64, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for n in (40, 9):  # 40 > index_topk 32: sparse attention
        d.add(torch.randint(2, 256, (n,), generator=g).tolist(), reserve=2)
    with torch.no_grad():
        for _, out, batch, _ in d.prefill([0, 1], chunk=24, logits="all"):
            assert_unfolded_bytes(model, batch, d.attn, out)
            assert_unfolded_bytes(model, batch, d.attn, model.forward_mtp(batch, d.attn, out.hidden, out.topk),
                                  out.hidden, out.topk)
        rows = [d.reqs[i]["row"] for i in (0, 1)]
        decode = ForwardBatch.build(StepKind.DECODE, [5, 6], rows, [40, 9], [1, 1],
                                    torch.stack([d.table.req_to_token[r, p] for r, p in zip(rows, (40, 9))]).long(),
                                    "cpu")
        calls = []

        def recording(layer, h, pending, *args):
            calls.append((layer, h, pending))
            return call_layer(layer, h, pending, *args)

        out = model(decode, d.attn, recording)
        assert_unfolded_bytes(model, decode, d.attn, out)
        # What the first layer is handed to add is nothing, bit for bit (the embedding's -0.0 stays -0.0)
        first, h, pending = calls[0]
        h_summed, normed, _ = first.input_layernorm.add_normed(pending, h)
        assert same_bits(h_summed, h) and same_bits(normed, first.input_layernorm.normed(h)[0])
        assert [c[0] for c in calls] == model.main_layers
    d.release_all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_adds_its_shared_experts_in_the_routed_experts_op(dtype):
    """`MoE.forward` hands the shared experts' output to the routed experts' op, which adds it to the routed rows'
    fp32 sum before its one rounding. fp32: the bytes of the separate add it replaced. bf16: that add rounded the
    routed sum first, then the total: the two differ by at most those roundings (half an ulp of the routed output,
    one of the total), and not nowhere (the old numerics are gone)."""
    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw.update(vocab_size=256, num_hidden_layers=2, first_k_dense_replace=1)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, dtype, torch.device("cpu"), seed=5, init_std=0.1, progress=False)
    moe = model.main_layers[1].mlp
    assert moe.shared_experts is not None
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        got = moe(x)
        routed = moe.experts(x, *moe.gate(x))
        separate = routed + moe.shared_experts(x)
    if dtype == torch.float32:
        assert same_bits(got, separate)
    else:
        eps = torch.finfo(dtype).eps  # an ulp is at most eps * |value|
        bound = eps / 2 * routed.float().abs() + eps * separate.float().abs()
        assert ((got.float() - separate.float()).abs() <= bound).all() and not torch.equal(got, separate)
