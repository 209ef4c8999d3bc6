"""RMSNorm + FP8 input quantisation in one launch (kernels/norm_quant.py) against `reference.rmsnorm_quant`, on CPU
through Triton's interpreter, and its wiring: the GEMMs and the fused MoE reading the quantised input, the model
choosing it at build (`set_norm_quant`), the custom ops under torch.compile(fullgraph=True, dynamic=True).

Same set-up as tests/test_kernels.py: kernels imported interpreted (or the file re-runs itself in a child process),
new torch.empty outputs poisoned. Narrowing float casts round as torch's do (`torch_rounded_casts`; the
interpreter's own mis-round at binade carries, the GPU's do not).

What is compared exactly and what within a tolerance: the residual sum exactly (one rounded add); the normed row
within a few units in the last place of its dtype, in bf16 mostly exactly (the mean of squares is summed in another order
than torch's, which can move rsqrt by an ulp); the e4m3 bytes and scales exactly equal to what
`fp8.quant_act_per_token_group` makes of the kernel's own normed row (what a GEMM quantising that row itself would
read), and the scales within an ulp of the reference's.
"""

from __future__ import annotations

import pytest
import torch
# Imported before any test patches torch.empty (`poison_new_tensors`): imported lazily under the patch, by the first
# custom op called, Dynamo would take the patched torch.empty for an untraceable function, and a later
# `torch._dynamo.explain` of the model would break its graph there.
import torch._dynamo  # noqa: F401

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)

from triton_interp import (SPILL_CHECK, compile_for_h100, import_kernels_interpreted,  # noqa: E402
                           poison_new_tensors, run_file_interpreted, torch_rounded_casts)

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import custom_ops  # noqa: E402,F401
from minidsa.kernels import norm_quant  # noqa: E402
from minidsa.kernels import reference as ref  # noqa: E402
from minidsa.kernels.fp8 import FP8_DTYPE, quant_act_per_token_group, quant_block  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_norm_quant_in_child_process():
    run_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_new_tensors(monkeypatch)


def _rows(m: int, k: int, dtype: torch.dtype, seed: int, stride_pad: int = 0):
    """x (a row-strided view when stride_pad), residual, weight; channels of very different sizes (so groups'
    scales differ), one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 1.5, k)[torch.randperm(k, generator=g)]
    x = (torch.randn(m, k + stride_pad, generator=g)[:, :k] * spread).to(dtype)
    residual = (torch.randn(m, k, generator=g) * 3).to(dtype)
    weight = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype)
    if m > 2:
        x[2] = 0
        residual[2] = 0
    return x, residual, weight


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b's dtype at b (0 where equal)."""
    eps = torch.finfo(b.dtype).eps
    ulp = torch.where(b.float() != 0, b.float().abs() * eps, torch.finfo(b.dtype).tiny)
    return (a.float() - b.float()).abs() / ulp


def _check(got, want, residual_given: bool):
    g_sum, g_normed, g_q, g_s = got
    w_sum, w_normed, w_q, w_s = want
    if residual_given:
        assert torch.equal(g_sum, w_sum)
    else:
        assert g_sum is None
    assert g_normed.dtype == w_normed.dtype and g_normed.shape == w_normed.shape
    apart = _ulps_apart(g_normed, w_normed)
    assert apart.max() <= 4.0, apart.max()
    if w_normed.dtype.itemsize == 2:  # an ulp of rsqrt in fp32 rarely moves a bf16 rounding
        assert (apart == 0).float().mean() >= 0.98, (apart == 0).float().mean()
    own_q, own_s = quant_act_per_token_group(g_normed)
    assert g_q.dtype == FP8_DTYPE and g_s.dtype == torch.float32 and g_s.shape == w_s.shape
    assert torch.equal(g_s, own_s)
    assert torch.equal(g_q.float(), own_q.float())  # the same e4m3 values (a tiny negative may round to +0 or -0)
    assert torch.allclose(g_s, w_s, rtol=2 * torch.finfo(w_normed.dtype).eps, atol=0)


@in_this_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,stride_pad", [
    (3, 7168, 0),    # DeepSeek-V3.2 hidden: 56 groups in a 8192 block
    (4, 1536, 0),    # q_lora_rank: 12 groups in 2048
    (5, 300, 40),    # a partial last group; rows strided (a slice of a fused projection's output)
    (1, 128, 0),     # one group
])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_reference(dtype, m, k, stride_pad, with_residual):
    x, residual, weight = _rows(m, k, dtype, seed=m * k + stride_pad)
    res = residual if with_residual else None
    with torch_rounded_casts():
        got = norm_quant.rmsnorm_quant(x, weight, 1e-6, res)
    _check(got, ref.rmsnorm_quant(x, weight, 1e-6, res), with_residual)
    if m > 2:  # the all-zero row: zero values, scale 1 (the GEMMs' convention)
        assert (got[3][2] == 1).all() and (got[2][2].float() == 0).all()


@in_this_process
def test_kernel_fp32_weight_on_bf16_rows_and_custom_ops():
    """The normed dtype is weight x row's promoted one (an fp32 weight on bf16 rows: fp32, as torch gives); the
    custom ops return what the kernel does."""
    x, residual, weight = _rows(3, 640, torch.bfloat16, seed=5)
    weight = weight.float() * 1.01
    with torch_rounded_casts():
        got = norm_quant.rmsnorm_quant(x, weight, 1e-5, residual)
        op_h, op_normed, op_q, op_s = torch.ops.minidsa.add_rmsnorm_quant(x, residual, weight, 1e-5)
        op2 = torch.ops.minidsa.rmsnorm_quant(op_h, weight, 1e-5)
    assert got[1].dtype == torch.float32
    _check(got, ref.rmsnorm_quant(x, weight, 1e-5, residual), True)
    for a, b in zip((op_h, op_normed, op_q.float(), op_s), (got[0], got[1], got[2].float(), got[3])):
        assert torch.equal(a, b)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(op2, got[1:]))  # norm of the sum == the fused one


@in_this_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,stride_pad", [(3, 7168, 0), (5, 300, 40), (0, 64, 0)])
def test_add_rmsnorm_is_the_quantising_kernels_sum_and_norm(dtype, m, k, stride_pad):
    """`add_rmsnorm` (the norms no FP8 linear reads): the quantising launch's h and normed rows bit for bit, strided
    rows included, and the custom op returns the same; within a few ulps of the reference's h + norm."""
    x, residual, weight = _rows(m, k, dtype, seed=k + stride_pad + 3)
    with torch_rounded_casts():
        h, normed = norm_quant.add_rmsnorm(x, residual, weight, 1e-6)
        op_h, op_normed = torch.ops.minidsa.add_rmsnorm(x, residual, weight, 1e-6)
        want_h, want_normed, _, _ = norm_quant.rmsnorm_quant(x, weight, 1e-6, residual)
    assert h.shape == normed.shape == (m, k) and h.dtype == normed.dtype == dtype
    for a, b in ((h, want_h), (normed, want_normed), (op_h, h), (op_normed, normed)):
        assert torch.equal(a, b)
    assert torch.equal(h, x + residual)
    if m:
        assert _ulps_apart(normed, ref.rms_norm(x + residual, weight, 1e-6)).max() <= 4.0
    with pytest.raises(ValueError, match="add_rmsnorm"):
        norm_quant.add_rmsnorm(x, residual[:, :-1], weight, 1e-6)


def _tiny_fp32_driver(**overrides):
    """A tiny fp32 model of random weights and a PagedDriver over it."""
    from hf_tiny import tiny_kwargs
    from harness import PagedDriver
    from minidsa.config import ModelConfig
    from minidsa.models.loader import build_model

    raw = tiny_kwargs("deepseek_v32", **overrides)
    raw["architectures"] = ["DeepseekV32ForCausalLM"]
    config = ModelConfig.from_dict(raw)
    model = build_model(config, None, torch.float32, torch.device("cpu"), seed=0, init_std=0.1)
    return model, PagedDriver(model, config, page_size=1, max_len=64)


def _prefill_logits(d) -> torch.Tensor:
    """Every position's logits of one 37-token prompt, its KV released after."""
    d.add(list(range(3, 40)), reserve=2)
    (_, out, _, _), = d.prefill([0], logits="all")
    d.release_all()
    return out.logits


def _assert_within_norm_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@in_this_process
def test_set_norm_quant_runs_the_unquantised_norms_in_the_kernel():
    """A model without FP8 linears under `set_norm_quant("triton")`: every decoder norm runs the kernel without its
    quantisation (the residual adds inside it, `add_rmsnorm`), none quantises; the logits stay within the norm's
    rounding of the reference's, the same tokens; "torch" hands them back to the reference."""
    from minidsa.models.deepseek_v32 import DecoderLayer, set_norm_quant

    model, d = _tiny_fp32_driver()
    norms = [n for layer in model.modules() if isinstance(layer, DecoderLayer) for n, _ in layer.norm_consumers()]
    want = _prefill_logits(d)
    assert set_norm_quant(model, "triton") == []
    assert norms and all(n.kernel == "triton" and not n.quantizes_output for n in norms)
    _assert_within_norm_rounding(_prefill_logits(d), want)
    set_norm_quant(model, "torch")
    assert all(n.kernel == "torch" for n in norms)


@in_this_process
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_writes_deep_gemm_layout_bit_for_bit(m, with_residual):
    """`deep_gemm_layout`: e4m3 rows padded to 16 and MN-major scales (`fp8_gemm.act_buffers`, what DeepGEMM reads
    as it is), the padding rows unwritten; rows [:m] the same bytes and scales as the row-major output, which are
    `fp8.quant_act_per_token_group`'s (`_check`)."""
    from minidsa.kernels import fp8_gemm

    x, residual, weight = _rows(m, 7168, torch.bfloat16, seed=40 + m)
    res = residual if with_residual else None
    with torch_rounded_casts():
        plain = norm_quant.rmsnorm_quant(x, weight, 1e-6, res)
        deep = norm_quant.rmsnorm_quant(x, weight, 1e-6, res, deep_gemm_layout=True)
    rows = fp8_gemm.deep_gemm_act_rows(m)
    assert deep[2].shape == (rows, 7168) and deep[2].is_contiguous()
    assert deep[3].shape == (rows, 56) and deep[3].stride() == (1, rows)
    assert torch.equal(deep[2][:m].view(torch.uint8), plain[2].view(torch.uint8))
    assert torch.equal(deep[3][:m], plain[3])
    assert torch.isnan(deep[3][m:]).all()  # the padding rows' scales left as allocated (poisoned)
    assert (deep[0] is None) == (not with_residual) and torch.equal(deep[1], plain[1])
    if with_residual:
        assert torch.equal(deep[0], plain[0])


@in_this_process
def test_norm_ops_in_deep_gemm_layout_under_compile():
    """The norm ops' fakes give the layout the kernel writes (padded rows, MN-major scales) for a symbolic token
    count: a compiled step returns the eager ops' tensors, strides included."""
    from torch._dynamo.backends.debugging import aot_eager

    def step(a, h, weight):
        h, normed, q, s = torch.ops.minidsa.add_rmsnorm_quant(a, h, weight, 1e-6, True)
        return (h, normed, q, s, *torch.ops.minidsa.rmsnorm_quant(h, weight, 1e-6, True))

    compiled = torch.compile(step, backend=aot_eager, fullgraph=True, dynamic=True)
    for tokens in (3, 20):
        a, h, weight = _rows(tokens, 256, torch.bfloat16, seed=tokens)
        with torch_rounded_casts():
            got, want = compiled(a, h, weight), step(a, h, weight)
        rows = -(-tokens // 16) * 16
        for i in (3, 6):  # the two ops' scales
            assert got[i].stride() == want[i].stride() == (1, rows)
            assert torch.equal(got[i][:tokens], want[i][:tokens])
        for i in (2, 5):
            assert got[i].shape == (rows, 256)
            assert torch.equal(got[i][:tokens].view(torch.uint8), want[i][:tokens].view(torch.uint8))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[4], want[4])


def test_kernel_refuses_what_it_cannot_take():
    x = torch.zeros(2, norm_quant.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match="holds rows up to"):
        norm_quant.rmsnorm_quant(x, torch.ones(x.shape[1]), 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        norm_quant.rmsnorm_quant(torch.zeros(2, 256), torch.ones(256), 1e-6, torch.zeros(2, 256, dtype=torch.bfloat16))
    assert norm_quant.supported(7168, torch.bfloat16) is None and norm_quant.supported(6144, torch.bfloat16) is None


@in_this_process
def test_activation_quantisation_rounds_the_quotient_at_e4m3_ties_as_torch():
    """x / scale lands exactly on an e4m3 rounding tie in these rows: torch divides IEEE and rounds the tie to even;
    x times the rounded reciprocal (what a fast division computes) lands an ulp off and rounds the other way. The
    kernel's quotient (one exact reciprocal per row, then Markstein's fma correction) must give torch's bytes."""
    from minidsa.kernels.fp8_gemm import quant_act

    g = torch.Generator().manual_seed(11)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    codes = codes[torch.isfinite(codes) & (codes >= 0)].unique()
    ties = ((codes[:-1].double() + codes[1:].double()) / 2)[8:]
    amax = torch.rand(200000, generator=g, dtype=torch.float64).float() * 8 + 0.5
    tie = ties[torch.randint(len(ties), (amax.numel(),), generator=g)]
    rows = torch.zeros(amax.numel(), 128)
    rows[:, 0] = amax
    _, scale = quant_act_per_token_group(rows)
    x = (tie * scale[:, 0].double()).float()
    exact = (x.double() == tie * scale[:, 0].double()) & (x.abs() <= amax)
    rows[:, 1] = x
    want = quant_act_per_token_group(rows)[0][:, 1].view(torch.uint8)
    fast = (x * (1 / scale[:, 0])).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8)
    pick = exact & (fast != want)
    assert pick.sum() >= 8, "no discriminating ties found"
    rows = rows[pick][:64]
    q, s = quant_act(rows)
    ref_q, ref_s = quant_act_per_token_group(rows)
    assert torch.equal(s, ref_s) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@in_this_process
def test_deepgemm_gets_activation_scales_in_its_own_layout():
    """DeepGEMM's SM90 GEMM reads activation scales MN-major and TMA-aligned; handed row-major ones, it launches a
    transpose per call (11 per decode step of bench-dsv32:4 on an H100). `run_fp8_gemm` quantises x into that layout
    directly, values equal to the row-major quantisation."""
    import importlib.util
    import os

    from minidsa.kernels import deepgemm
    from minidsa.kernels.fp8_gemm import quant_act

    spec = importlib.util.spec_from_file_location(
        "deep_gemm_stand_in", os.path.join(os.path.dirname(__file__), "deep_gemm_stand_in", "deep_gemm.py"))
    stand_in = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stand_in)
    handed = []

    class Recording:
        def fp8_gemm_nt(self, a, b, out):
            handed.append(a[1])
            stand_in.fp8_gemm_nt(a, b, out)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 384, generator=g).bfloat16()
    wq, ws = quant_block(torch.randn(128, 384, generator=g) * 0.05)
    q_row, s_row = quant_act(x, 16)
    q_mn, s_mn = quant_act(x, 16, mn_major=True)
    assert s_mn.shape == (16, 3) and s_mn.stride() == (1, 16)
    assert torch.equal(q_mn[:3].view(torch.uint8), q_row[:3].view(torch.uint8)) and torch.equal(s_mn[:3], s_row[:3])
    out = deepgemm.run_fp8_gemm(Recording(), x, wq, ws)
    assert handed[0].stride() == (1, 16) and out.shape == (3, 128)
    want = (q_row[:3].float() * s_row[:3].repeat_interleave(128, 1)) @ (
        wq.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@in_this_process
def test_gemm_and_fused_moe_read_the_quantised_input():
    """The w8a8 GEMM (at any size) and the Triton fused MoE read (x_q, x_scale) instead of quantising x: given
    x's own quantisation they give what they give from x; given another one, they show they read it."""
    from minidsa.kernels.fp8_gemm import GemmTiles, w8a8_block_gemm
    from minidsa.kernels.fused_moe import fused_moe_triton

    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 256, generator=g)
    wq, ws = quant_block(torch.randn(192, 256, generator=g) * 0.05)
    act = quant_act_per_token_group(x)
    with torch_rounded_casts():
        plain = w8a8_block_gemm(x, wq, ws)  # 70 rows: quantised in a launch of its own
        assert torch.equal(w8a8_block_gemm(x, wq, ws, act=act), plain)
        assert not torch.equal(w8a8_block_gemm(x, wq, ws, act=quant_act_per_token_group(x * 2)), plain)
        # Decode tiles quantise inside from x, unless handed act: then they read it (in any scale strides).
        decode = GemmTiles(16, 64, 2, True, 4, 2)
        inside = w8a8_block_gemm(x[:5], wq, ws, decode)
        q5, s5 = quant_act_per_token_group(x[:5])
        assert torch.equal(w8a8_block_gemm(x[:5], wq, ws, decode, act=(q5, s5)), inside)
        assert torch.equal(w8a8_block_gemm(x[:5], wq, ws, decode, act=(q5, s5.t().contiguous().t())), inside)
        assert not torch.equal(w8a8_block_gemm(x[:5], wq, ws, decode, act=quant_act_per_token_group(x[:5] * 2)),
                               inside)
        experts, inter = 4, 128
        gu, gu_s = quant_block(torch.randn(experts, 2 * inter, 256, generator=g) * 0.05)
        dn, dn_s = quant_block(torch.randn(experts, 256, inter, generator=g) * 0.05)
        xs = x[:6].bfloat16()
        ids = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2], [0, 3]])
        w = torch.rand(6, 2, generator=g)
        base = fused_moe_triton(xs, ids, w, gu, dn, gu_s, dn_s)
        assert torch.equal(fused_moe_triton(xs, ids, w, gu, dn, gu_s, dn_s, act=quant_act_per_token_group(xs)), base)
        other = fused_moe_triton(xs, ids, w, gu, dn, gu_s, dn_s, act=quant_act_per_token_group(xs * 2))
        assert not torch.equal(other, base)
        chunked = fused_moe_triton(xs, ids, w, gu, dn, gu_s, dn_s, max_chunk_tokens=4,
                                   act=quant_act_per_token_group(xs))
        assert torch.equal(chunked, fused_moe_triton(xs, ids, w, gu, dn, gu_s, dn_s, max_chunk_tokens=4))


def _fp8_model(norm_quant_kernel: str, gemm: str = "triton"):
    from minidsa.config import ModelConfig
    from minidsa.models.loader import build_model
    from minidsa.common.presets import preset_config

    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw.update(vocab_size=256, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, q_lora_rank=128,
               kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=4,
               num_key_value_heads=4)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, torch.bfloat16, torch.device("cpu"), seed=1, init_std=0.05, quantization="fp8",
                        gemm=gemm, norm_quant=norm_quant_kernel)
    return model, cfg


@in_this_process
def test_set_norm_quant_picks_the_norms_fp8_linears_read():
    from minidsa.models.deepseek_v32 import DecoderLayer, set_norm_quant

    model, cfg = _fp8_model("triton")
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        assert layer.input_layernorm.quantizes_output and layer.self_attn.q_a_layernorm.quantizes_output
        assert layer.post_attention_layernorm.quantizes_output
        assert not layer.self_attn.kv_a_layernorm.quantizes_output  # its output goes to the cache, not a GEMM
    assert not model.model.norm.quantizes_output  # the final norm feeds the bf16 lm_head
    assert all(n.kernel == "torch" for layer in layers for n, _ in layer.norm_consumers())  # they quantise
    assert set_norm_quant(model, "torch") == []
    assert not any(layer.input_layernorm.quantizes_output for layer in layers)
    assert len(set_norm_quant(model, "triton")) == 3 * len(layers)
    assert not any(n.quant_for_deep_gemm for layer in layers for n in layer.modules()
                   if hasattr(n, "quant_for_deep_gemm"))  # the Triton GEMMs serve every size
    with pytest.raises(ValueError, match="norm_quant kernel"):
        set_norm_quant(model, "cuda")


@in_this_process
def test_set_norm_quant_picks_deep_gemm_layout_where_every_reader_is_deep_gemm():
    """With DeepGEMM given the linears: the norms read only by linears write DeepGEMM's layout (DeepGEMM reads it as
    it is, the Triton GEMM serving those linears at other sizes too); the MoE layers' post-attention norm, which
    the fused MoE reads in plain rows, does not."""
    from minidsa.models.deepseek_v32 import DecoderLayer, MLP

    model, cfg = _fp8_model("triton", gemm="deepgemm")
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    assert {isinstance(layer.mlp, MLP) for layer in layers} == {True, False}
    for layer in layers:
        assert layer.input_layernorm.quant_for_deep_gemm and layer.self_attn.q_a_layernorm.quant_for_deep_gemm
        assert layer.post_attention_layernorm.quant_for_deep_gemm == isinstance(layer.mlp, MLP)
        assert layer.post_attention_layernorm.quantizes_output


@in_this_process
def test_model_layers_with_fused_norms_equal_the_unfused_ones():
    """One decoder layer of an FP8 model (dense and MoE) on 70 tokens (the GEMMs quantise outside the kernel at
    that size, so they read the norms' quantisation) and on 3 (decode sizes: they quantise x themselves): fused and
    unfused norms give the same hidden states within bf16 noise, through the same GEMMs. Also under
    torch.compile(fullgraph=True, dynamic=True), where the norms are the opaque custom ops."""
    from torch._dynamo.backends.debugging import aot_eager

    from minidsa.models.deepseek_v32 import DecoderLayer, set_norm_quant

    model, cfg = _fp8_model("triton")
    layers = [m for m in model.model.layers if isinstance(m, DecoderLayer)][:cfg.num_hidden_layers]
    kinds = {type(layer.mlp).__name__: layer for layer in layers}
    assert set(kinds) == {"MLP", "MoE"}, kinds
    g = torch.Generator().manual_seed(7)
    for name, layer in kinds.items():
        for tokens in (70, 3):
            a = (torch.randn(tokens, cfg.hidden_size, generator=g) * 0.5).bfloat16()
            h = torch.randn(tokens, cfg.hidden_size, generator=g).bfloat16()
            set_norm_quant(model, "triton")
            with torch.no_grad(), torch_rounded_casts():
                h1, x1, xq1 = layer.post_attention_layernorm.add_normed(a, h)
                fused = h1 + layer.mlp(x1, xq1)
                step = torch.compile(lambda a, h: layer.post_attention_layernorm.add_normed(a, h),
                                     backend=aot_eager, fullgraph=True, dynamic=True)
                hc, xc, (qc, sc) = step(a, h)
            set_norm_quant(model, "torch")
            with torch.no_grad(), torch_rounded_casts():
                h0, x0, xq0 = layer.post_attention_layernorm.add_normed(a, h)
                plain = h0 + layer.mlp(x0)
            assert xq0 is None and torch.equal(h1, h0) and torch.equal(hc, h1)
            assert torch.equal(xc, x1) and torch.equal(qc.float(), xq1[0].float()) and torch.equal(sc, xq1[1])
            err = (fused.float() - plain.float()).norm() / plain.float().norm()
            assert err < 1e-2, (name, tokens, err)
    set_norm_quant(model, "triton")


@in_this_process
def test_attention_input_norms_under_compile_take_the_custom_ops():
    """The traced attention input path (input_layernorm, then q_a_layernorm after the fused projection) calls the
    two norm ops and hands their quantisation to the FP8 linears' op: no graph break, dynamic token count."""
    from torch._dynamo.backends.debugging import aot_eager

    model, cfg = _fp8_model("triton")
    layer = model.model.layers[0]
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return aot_eager(gm, inputs)

    def attention_inputs(h):
        x, xq = layer.input_layernorm.normed(h)
        q_in = layer.self_attn.in_proj(x, xq)[0]
        qr, qrq = layer.self_attn.q_a_layernorm.normed(q_in)
        return layer.self_attn.q_b_proj(qr, qrq)

    step = torch.compile(attention_inputs, backend=backend, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad(), torch_rounded_casts():
        for tokens in (70, 90):
            h = torch.randn(tokens, cfg.hidden_size, generator=g).bfloat16()
            assert torch.equal(step(h), attention_inputs(h))
    graphs = [gm for gm in graphs if len(gm.graph.nodes) > 0]  # Dynamo also hands over empty frames
    assert len(graphs) == 1  # both token counts, one graph
    targets = [str(n.target) for n in graphs[0].graph.nodes if "minidsa" in str(n.target)]
    assert sum("rmsnorm_quant" in t for t in targets) == 2 and sum("fp8_linear" in t for t in targets) == 2
    fp8_calls = [n for n in graphs[0].graph.nodes if "fp8_linear" in str(n.target)]
    assert all(len(n.args) == 6 and n.args[4] is not None for n in fp8_calls)  # the quantised input handed over


_COMPILE_FOR_H100 = SPILL_CHECK + """
from minidsa.kernels import norm_quant
sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16", "normed_ptr": "*bf16",
       "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32", "stride_r": "i32", "stride_sum": "i32",
       "stride_n": "i32", "stride_q": "i32", "stride_sm": "i32", "stride_sg": "i32", "num_groups": "i32",
       "eps": "fp32", "BLOCK": "constexpr", "GROUP": "constexpr", "HAS_RESIDUAL": "constexpr",
       "EMULATE_CAST": "constexpr", "QUANT": "constexpr", "PDL": "constexpr"}
for block in (2048, 8192):
    for residual, quant in ((False, True), (True, True), (True, False)):
        src = ASTSource(norm_quant._rmsnorm_quant_kernel, sig, constexprs={
            "BLOCK": block, "GROUP": 128, "HAS_RESIDUAL": residual, "EMULATE_CAST": False, "QUANT": quant,
            "PDL": True})
        compile_without_spills(src, 8 if block >= 4096 else 4)
print("compiled")
"""


def test_norm_quant_kernel_compiles_for_h100():
    """The interpreter runs Python, not Triton's compiler: compile the kernel for sm_90 (no GPU needed), with the
    warps `rmsnorm_quant` launches it with, and count ptxas's spill bytes (none)."""
    compile_for_h100(_COMPILE_FOR_H100, "_rmsnorm_quant_kernel")


@in_this_process
def test_fp8_model_with_fused_norms_traces_whole_and_decodes_like_the_unfused_one():
    """An FP8 model whose norms quantise (`norm_quant="triton"`): the decode forward traces as one graph with no
    break, holding the norm ops, and prefill + a decode step give the unfused model's logits within bf16 noise."""
    from harness import PagedDriver

    from minidsa.common.batch import ForwardBatch
    from minidsa.models.deepseek_v32 import set_norm_quant
    from minidsa.common.plan import StepKind

    model, cfg = _fp8_model("triton")
    d = PagedDriver(model, cfg, page_size=1, max_len=160, dtype=torch.bfloat16)
    d.add(list(range(3, 3 + 90)), reserve=4)  # 90 tokens: the prefill's GEMMs read the norms' quantisation
    d.add(list(range(5, 5 + 40)), reserve=4)
    with torch_rounded_casts():
        d.prefill([0, 1])
    rows, seq = [d.reqs[i]["row"] for i in range(2)], [90, 40]
    r2t = d.table.req_to_token
    decode = ForwardBatch.build(StepKind.DECODE, [7, 9], rows, seq, [1, 1],
                                torch.stack([r2t[r, n].long() for r, n in zip(rows, seq)]), "cpu")
    with torch.no_grad():
        ex = torch._dynamo.explain(model.forward)(decode, d.attn)
        assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
        ops = {str(n.target) for gm in ex.graphs for n in gm.graph.nodes if "minidsa" in str(n.target)}
        assert any("add_rmsnorm_quant" in o for o in ops) and any("rmsnorm_quant" in o and "add_" not in o for o in ops), ops
    logits = []
    for kernel in ("triton", "torch"):
        set_norm_quant(model, kernel)
        batch = ForwardBatch.build(StepKind.EXTEND, list(range(3, 93)), rows[:1], [0], [90],
                                   r2t[rows[0], :90].long(), "cpu")
        with torch.no_grad(), torch_rounded_casts():
            logits.append(model.forward(batch, d.attn).logits)
    err = (logits[0] - logits[1]).norm() / logits[1].norm()
    assert err < 2e-2, err
    d.release_all()


# ---------------------------------------------------------------------------
# the plain RMSNorm of some rows (`rmsnorm_rows`): the norms outside the decoder layers
# ---------------------------------------------------------------------------
@in_this_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,stride_pad", [(3, 7168, 0), (5, 300, 40), (1, 128, 0)])
@pytest.mark.parametrize("gather", [False, True])
def test_rmsnorm_rows_matches_reference(dtype, m, k, stride_pad, gather):
    """The normed rows (gathered in the launch where `rows` is given, repeated and out of order) within a few ulps
    of the reference, in bf16 mostly equal; exactly `rmsnorm_quant`'s normed rows (the layers' norms)."""
    x, _, weight = _rows(m, k, dtype, seed=m * k + stride_pad + 1)
    rows = torch.tensor([m - 1, 0, m - 1][: 1 if m == 1 else 3]) if gather else None
    with torch_rounded_casts():
        got = norm_quant.rmsnorm_rows(x, weight, 1e-6, rows)
        op = torch.ops.minidsa.rmsnorm_rows(x, weight, 1e-6, rows)
        fused = norm_quant.rmsnorm_quant(x, weight, 1e-6)[1]
    want = norm_quant.rmsnorm_rows_reference(x, weight, 1e-6, rows)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, op)
    apart = _ulps_apart(got, want)
    assert apart.max() <= 4.0, apart.max()
    if dtype.itemsize == 2:
        assert (apart == 0).float().mean() >= 0.98, (apart == 0).float().mean()
    assert torch.equal(got, fused if rows is None else fused[rows])


@in_this_process
def test_head_norms_take_the_kernel_where_chosen():
    """`set_head_norm("triton")`: the final norm and the MTP layer's norms run the one-launch kernel (the logits
    rows gathered in it), the decoder layers' norms stay the reference their compiled graph fuses; the model's
    logits stay within the norm's rounding of the reference's, the same tokens."""
    from minidsa.models.deepseek_v32 import RMSNorm, set_head_norm

    model, d = _tiny_fp32_driver(num_nextn_predict_layers=1)
    want = _prefill_logits(d)
    chosen = set_head_norm(model, "triton")
    assert [id(n) for n in chosen] == [id(n) for n in (model.model.norm, model.mtp_layer.enorm,
                                                        model.mtp_layer.hnorm, model.mtp_layer.shared_head.norm)]
    assert all(m.kernel == "torch" for layer in model.main_layers for m in layer.modules() if isinstance(m, RMSNorm))
    _assert_within_norm_rounding(_prefill_logits(d), want)
    with pytest.raises(ValueError, match="head_norm kernel"):
        set_head_norm(model, "cuda")


_ROWS_COMPILE_FOR_H100 = SPILL_CHECK + """
from minidsa.kernels import norm_quant
sig = {"x_ptr": "*bf16", "rows_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "K": "i32", "stride_x": "i32",
       "stride_out": "i32", "eps": "fp32", "BLOCK": "constexpr", "GATHER": "constexpr", "PDL": "constexpr"}
for block in (2048, 4096, 8192, 16384):
    for gather in (False, True):
        compile_without_spills(ASTSource(norm_quant._rmsnorm_rows_kernel, sig,
                                         constexprs={"BLOCK": block, "GATHER": gather, "PDL": True}),
                               norm_quant.rows_num_warps(block))
print("compiled")
"""


def test_rmsnorm_rows_kernel_compiles_for_h100_without_spills():
    """The kernel compiled for sm_90 at the widths it serves (DeepSeek-V3.2's 7168 in 8192 lanes, up to MAX_HIDDEN),
    0 spill bytes."""
    compile_for_h100(_ROWS_COMPILE_FOR_H100, "_rmsnorm_rows_kernel")
