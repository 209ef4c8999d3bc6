"""q_b_proj and the indexer's wq_b, the two projections of qr (q_a_layernorm's output), as one GEMM
(`MLAttention.qr_proj`) in the layers that run their indexer every step.

At decode batch 1 each is a GEMV whose launch costs a fixed few microseconds; one launch fewer per layer is the
point. What must hold: the same logits as the two GEMMs apart (bit for bit: each output column is reduced over K
in the same order whatever the other rows are), the same checkpoint names, wq_b left apart in the layers that
reuse a top-k (the MTP layer by default, which runs its indexer only when handed none), a tensor-parallel rank's
q_b_proj heads fused with the whole replicated wq_b, and a checkpoint storing one of the two in FP8 and the other
not still served (the members run one by one).
"""

from __future__ import annotations

import pytest
import torch

from harness import PagedDriver, random_fp8_linear
from hf_tiny import tiny_kwargs
from minidsa.config import ModelConfig
from minidsa.exec.batch import ForwardBatch
from minidsa.kernels.fp8 import FP8_DTYPE
from minidsa.models import loader
from minidsa.models.deepseek_v32 import DeepseekV32ForCausalLM, MLAttention
from minidsa.models.layers.linear import FusedLinear
from minidsa.models.loader import build_model
from minidsa.parallel.state import TensorParallel, building_with
from minidsa.sched.plan import StepKind

ARCHS = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
# Every FP8 dimension in whole or partial 128-blocks: q_b_proj 4 x 48 = 192 rows (the odd height, last), wq_b
# 16 x 32 = 512, qr 128 wide.
WIDE = dict(vocab_size=256, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, q_lora_rank=128,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)


def _config(arch: str = "deepseek_v32", **over) -> ModelConfig:
    """A tiny model with an MTP layer; GLM-5's schedule has layers 1 and 3 reuse the top-k of the layer before."""
    raw = tiny_kwargs(arch, num_nextn_predict_layers=1, **over)
    raw["architectures"] = [ARCHS[arch]]
    return ModelConfig.from_dict(raw)


def _build(cfg: ModelConfig, dtype=torch.float32, **kw) -> DeepseekV32ForCausalLM:
    return build_model(cfg, None, dtype, torch.device("cpu"), seed=3, init_std=0.1, progress=False, **kw)


def _unfused(mp: pytest.MonkeyPatch) -> None:
    """Within `mp`: every layer runs q_b_proj and wq_b as two GEMMs, on the same weights (the fused tensor's views)."""
    mp.setattr(MLAttention, "fuses_index_q", property(lambda self: False))


def _generate(model, cfg: ModelConfig, dtype, steps: int = 4) -> torch.Tensor:
    """Logits of every prompt position (longer than index_topk: sparse attention), then of `steps` greedy decodes."""
    d = PagedDriver(model, cfg, dtype=dtype)
    d.add([(7 * i) % (cfg.vocab_size - 2) + 2 for i in range(cfg.index_topk + 9)], reserve=steps)
    out = [d.prefill([0], logits="all")[0][1].logits]
    for _ in range(steps):
        out.append(d.decode([0], [int(out[-1][-1].argmax())]).logits)
    d.release_all()
    return torch.cat(out)


CASES = {
    "fp32": (dict(), torch.float32, dict()),
    "glm5-fp32": (dict(arch="glm_moe_dsa"), torch.float32, dict()),
    "fp8-reference": (WIDE, torch.bfloat16, dict(quantization="fp8")),
    # As a GPU serves it: the Triton w8a8 GEMM (interpreted here), fed by q_a_layernorm's quantisation.
    "fp8-triton": (WIDE, torch.bfloat16, dict(quantization="fp8", gemm="triton", norm_quant="triton")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_qr_projection_gives_the_two_gemms_logits(case, monkeypatch):
    over, dtype, build = CASES[case]
    cfg = _config(**over)
    model = _build(cfg, dtype, **build)
    for layer in model.model.layers:
        attn = layer.self_attn
        assert hasattr(attn, "qr_proj") == (attn.indexer is not None and attn.computes_topk), attn.layer_id
        if not hasattr(attn, "qr_proj"):
            continue
        fused, wq_b, q_b = attn.qr_proj, attn.indexer.wq_b, attn.q_b_proj
        assert not fused._separate and fused.is_fp8 == ("quantization" in build)
        # wq_b's rows then q_b_proj's, unpadded; the members' parameters are views of the fused weight
        assert fused.weight.shape[0] == wq_b.out_features + q_b.out_features
        assert wq_b.weight.data_ptr() == fused.weight.data_ptr()
        assert q_b.weight.data_ptr() == fused.weight[wq_b.out_features:].data_ptr()
        if fused.is_fp8:
            assert q_b.weight_scale_inv.data_ptr() == fused.weight_scale_inv[wq_b.out_features // 128:].data_ptr()
    with torch.device("meta"):
        unbuilt = DeepseekV32ForCausalLM(cfg)
    if "quantization" in build:
        unbuilt.make_fp8_()
    assert list(model.state_dict()) == list(unbuilt.state_dict())  # the checkpoint's names, nothing more

    fused_logits = _generate(model, cfg, dtype)
    with monkeypatch.context() as mp:
        _unfused(mp)
        apart = _generate(model, cfg, dtype)
    assert torch.equal(fused_logits, apart)


def test_layers_that_reuse_a_topk_keep_wq_b_apart():
    """A layer without an indexer has no wq_b; the MTP layer that by default reuses the top-k it is handed must not
    read wq_b's weight every step: its wq_b stays its own tensor. Where a schedule has the MTP layer run its own
    indexer (GLM-5's every other layer reaches it), it is fused like the main layers."""
    model = _build(_config())
    mtp = model.mtp_layer.self_attn
    assert not mtp.computes_topk and not hasattr(mtp, "qr_proj")
    for lin in (mtp.indexer.wq_b, mtp.q_b_proj):
        assert lin.weight.untyped_storage().nbytes() == lin.weight.nbytes
    assert all(hasattr(layer.self_attn, "qr_proj") for layer in model.main_layers)

    glm = _build(_config("glm_moe_dsa"))
    assert [hasattr(layer.self_attn, "qr_proj") for layer in glm.model.layers] == [True, False, True, False, True]
    assert glm.config.mtp_indexer_full and glm.mtp_layer.self_attn.computes_topk


def _mtp_extend(model, cfg: ModelConfig, prev_topk_from_main: bool):
    """The MTP layer over a prompt (as the engine's draft extend runs it), after the main model's prefill: its
    logits, and how many times its wq_b ran."""
    d = PagedDriver(model, cfg)
    tokens = [(5 * i) % (cfg.vocab_size - 2) + 2 for i in range(cfg.index_topk + 9)]
    d.add(tokens, reserve=1)
    _, out, batch, _ = d.prefill([0], logits="all")[0]
    nxt = tokens[1:] + [int(out.logits[-1].argmax())]
    draft = ForwardBatch.build(StepKind.EXTEND, nxt, [d.reqs[0]["row"]], [0], [len(tokens)], batch.out_cache_loc, "cpu",
                               logits="all")
    calls = []
    hook = model.mtp_layer.self_attn.indexer.wq_b.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            mtp = model.forward_mtp(draft, d.attn, out.hidden, out.topk if prev_topk_from_main else None)
    finally:
        hook.remove()
    d.release_all()
    return mtp.logits, len(calls)


def test_mtp_layer_computes_its_indexer_query_itself_when_handed_no_topk():
    """Handed no top-k, the unfused MTP layer's indexer runs its own wq_b: the logits of the same weights whose MTP
    layer runs its indexer every step (fused, `indexer_types` covering it). Handed one, wq_b does not run."""
    cfg = _config()
    own = _config(indexer_types=["full"] * (cfg.num_hidden_layers + 1))
    assert own.mtp_indexer_full and own.indexer_full == cfg.indexer_full
    reusing, computing = _build(cfg), _build(own)
    assert not hasattr(reusing.mtp_layer.self_attn, "qr_proj") and hasattr(computing.mtp_layer.self_attn, "qr_proj")
    ours, wq_b_runs = _mtp_extend(reusing, cfg, prev_topk_from_main=False)
    assert wq_b_runs == 1
    theirs, fused_wq_b_runs = _mtp_extend(computing, own, prev_topk_from_main=False)
    assert fused_wq_b_runs == 0  # the fused GEMM computed its query
    assert torch.equal(ours, theirs)
    _, reused_wq_b_runs = _mtp_extend(reusing, cfg, prev_topk_from_main=True)
    assert reused_wq_b_runs == 0


TP_FP8 = dict(WIDE, intermediate_size=512, moe_intermediate_size=256, qk_nope_head_dim=48, v_head_dim=64)


@pytest.mark.parametrize("quantization", ["auto", "fp8"])
def test_tensor_parallel_rank_fuses_its_q_b_heads_with_the_whole_indexer_query(quantization):
    """Rank r of 2 (no processes: only its weights are used) fuses its half of q_b_proj's heads with the replicated
    wq_b: its fused GEMM gives the one-process model's indexer query whole and rank r's slice of q. In FP8 each
    rank's q_b_proj is whole 128-row blocks (4 heads x 64 / 2), so the scales stack as they are."""
    cfg = _config(**TP_FP8)
    full = _build(cfg, quantization=quantization).model.layers[1].self_attn
    qr = torch.randn(3, cfg.q_lora_rank, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_index_q, want_q = full.indexer.wq_b(qr), full.q_b_proj(qr)
    for rank in range(2):
        with building_with(TensorParallel(rank=rank, size=2)):
            shard = _build(cfg, quantization=quantization)
        attn = shard.model.layers[1].self_attn
        rows = attn.q_b_proj.out_features
        assert rows == want_q.shape[1] // 2 and attn.qr_proj.is_fp8 == (quantization == "fp8")
        assert attn.qr_proj.weight.shape[0] == attn.indexer.wq_b.out_features + rows
        with torch.no_grad():
            index_q, q = attn.qr_proj(qr)
        assert torch.equal(index_q, want_index_q)
        assert torch.equal(q, want_q[:, rank * rows:(rank + 1) * rows])


def test_fp8_q_b_with_a_high_precision_wq_b_runs_them_apart(monkeypatch):
    """A checkpoint storing wq_b in high precision and q_b_proj in FP8 (`fp8_modules` as stored): no fused tensor,
    the two GEMMs run one by one inside `qr_proj`, and the logits are those of the unfused layers."""
    fp8_modules = loader.fp8_modules

    def wq_b_as_stored_high_precision(model, quantization, files):
        return model.make_fp8_(lambda name: not name.endswith("indexer.wq_b"))

    monkeypatch.setattr(loader, "fp8_modules", wq_b_as_stored_high_precision)
    cfg = _config(**WIDE)
    model = _build(cfg, torch.bfloat16, quantization="fp8")
    monkeypatch.setattr(loader, "fp8_modules", fp8_modules)
    attn = model.model.layers[0].self_attn
    assert attn.q_b_proj.is_fp8 and not attn.indexer.wq_b.is_fp8
    assert attn.qr_proj._separate == (attn.indexer.wq_b, attn.q_b_proj) and attn.qr_proj.weight is None
    fused_logits = _generate(model, cfg, torch.bfloat16)
    with monkeypatch.context() as mp:
        _unfused(mp)
        apart = _generate(model, cfg, torch.bfloat16)
    assert torch.equal(fused_logits, apart)


def test_fused_gemv_at_the_real_width_is_the_two_gemvs_bit_for_bit():
    """qr 1536 wide (DeepSeek-V3.2), decode rows, through the Triton w8a8 GEMM a decode step runs: with K = 12 blocks
    its tiles do not depend on N (`fp8_gemm.pick_tiles`, checked at the real heights: wq_b 64 x 128 rows, q_b_proj
    128 x 192 over 1 to 8 ranks, and the fused ones), so each output column is the separate GEMV's, bit for bit.
    The GEMM runs at fewer rows than the real ones (the interpreter takes ~1 s per 1024)."""
    from minidsa.kernels.fp8_gemm import pick_tiles

    for m in (1, 2, 8, 16, 64):
        heights = [64 * 128] + [128 * 192 // tp + fused for tp in (1, 2, 4, 8) for fused in (0, 64 * 128)]
        assert len({pick_tiles(m, n, 1536, 132) for n in heights}) == 1, m
    g = torch.Generator().manual_seed(0)
    members = [random_fp8_linear(1536, rows, g, "triton") for rows in (512, 768)]
    qr = torch.randn(2, 1536, generator=g).bfloat16()
    with torch.no_grad():
        apart = [lin(qr) for lin in members]
        fused = FusedLinear(*members)
        together = fused(qr)
    assert fused.weight.dtype == FP8_DTYPE and fused.weight.shape == (1280, 1536)
    assert all(torch.equal(a, b) for a, b in zip(together, apart))
