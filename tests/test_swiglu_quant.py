"""Activations quantised for FP8 GEMMs by the kernels that produce them: SwiGLU's product for the down projections
(kernels/swiglu_quant.py) and absorb_o's output for o_proj (`mla_absorb.absorb_o_quant`, tested beside its kernel in
tests/test_mla_absorb.py), on CPU through Triton's interpreter, and their wiring: the custom ops' fakes under
torch.compile(fullgraph=True, dynamic=True), DeepGEMM's layout (padded rows, MN-major scales) read as it is, the
model choosing them at build, and the launches they spare in a decode step with DeepGEMM serving the linears.

Same set-up as tests/test_norm_quant.py. What is compared exactly: in bf16 the product (silu and the product each
rounded as eager torch rounds them; the kernel's exp and torch's differ in fp32 ulps, which the rounding to bf16
absorbs here), the e4m3 bytes and the scales against `fp8.quant_act_per_token_group` of it; in fp32 (no rounding to
absorb the exp's ulps) the product within fp32 noise, the bytes and scales exactly those of the kernel's own product.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch._dynamo  # noqa: F401  (before torch.empty is patched: see tests/test_norm_quant.py)

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)

from triton_interp import (SPILL_CHECK, compile_for_h100, import_kernels_interpreted,  # noqa: E402
                           poison_new_tensors, run_file_interpreted, torch_rounded_casts)

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import custom_ops  # noqa: E402,F401
from minidsa.kernels import deepgemm, fp8_gemm, swiglu_quant  # noqa: E402
from minidsa.kernels.fp8 import quant_act_per_token_group, quant_block  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_swiglu_quant_in_child_process():
    run_file_interpreted(__file__)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """For the kernel tests only: Dynamo builds its tables of torch functions on first use, and would take the
    patched torch.empty for an untraceable function if that use came under the patch (the tracing tests here)."""
    poison_new_tensors(monkeypatch)


def _halves(rows: int, inter: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up as the MLP holds them: the two halves of one fused gate|up output (row stride 2I)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype)
    return gate_up[:, :inter], gate_up[:, inter:]


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@in_this_process
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("inter", [384, 200])
@pytest.mark.parametrize("deep_gemm_layout", [False, True])
def test_kernel_matches_reference_bit_for_bit(rows, inter, deep_gemm_layout, poisoned_outputs):
    gate, up = _halves(rows, inter, torch.bfloat16, rows * inter)
    with torch_rounded_casts():
        mid, q, s = swiglu_quant.swiglu_quant(gate, up, deep_gemm_layout)
    want_mid, want_q, want_s = swiglu_quant.swiglu_quant_reference(gate, up, deep_gemm_layout)
    assert torch.equal(mid, torch.nn.functional.silu(gate) * up) and torch.equal(want_mid, mid)
    assert q.shape == want_q.shape and s.shape == want_s.shape and s.stride() == want_s.stride()
    padded = fp8_gemm.deep_gemm_act_rows(rows) if deep_gemm_layout else rows
    assert q.shape[0] == padded and (s.stride() == (1, padded) if deep_gemm_layout else s.is_contiguous())
    assert torch.equal(_bytes(q[:rows]), _bytes(want_q[:rows])) and torch.equal(s[:rows], want_s[:rows])
    if padded > rows:  # DeepGEMM's padding rows are left as they were (their outputs are never read)
        assert torch.isnan(s[rows:]).all()


@in_this_process
def test_fp32_rows_quantise_the_kernels_own_product(poisoned_outputs):
    gate, up = _halves(7, 256, torch.float32, 3)
    with torch_rounded_casts():
        mid, q, s = swiglu_quant.swiglu_quant(gate, up)
    torch.testing.assert_close(mid, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)
    want_q, want_s = quant_act_per_token_group(mid)
    assert torch.equal(_bytes(q), _bytes(want_q)) and torch.equal(s, want_s)


@in_this_process
def test_op_traces_with_dynamic_rows_and_refuses_what_does_not_fit():
    """The custom op under torch.compile(fullgraph=True, dynamic=True): the fake's padded rows and MN-major strides
    are the kernel's for every row count, so one graph serves 3 and 20 rows."""
    from torch._dynamo.backends.debugging import aot_eager

    def step(gate, up):
        return torch.ops.minidsa.swiglu_quant(gate, up, True)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=aot_eager, fullgraph=True, dynamic=True)
    for rows in (3, 20):
        gate, up = _halves(rows, 256, torch.bfloat16, rows)
        with torch_rounded_casts():
            got, want = compiled(gate, up), step(gate, up)
        assert got[2].stride() == want[2].stride() == (1, fp8_gemm.deep_gemm_act_rows(rows))
        assert torch.equal(got[0], want[0]) and torch.equal(_bytes(got[1][:rows]), _bytes(want[1][:rows]))
        assert torch.equal(got[2][:rows], want[2][:rows])
    gate, up = _halves(3, 256, torch.bfloat16, 1)
    with pytest.raises(ValueError, match="do not fit"):
        swiglu_quant.swiglu_quant(gate, up[:, :128])
    empty = swiglu_quant.swiglu_quant(gate[:0], up[:0], True)
    assert empty[0].shape == (0, 256) and empty[1].shape == (0, 256)


def _recording_deep_gemm(scales_seen: list):
    """A DeepGEMM whose fp8_gemm_nt records the activation scales it is handed (the product: the stand-in's)."""
    import importlib.util
    import os
    import types

    spec = importlib.util.spec_from_file_location(
        "deep_gemm_stand_in", os.path.join(os.path.dirname(__file__), "deep_gemm_stand_in", "deep_gemm.py"))
    stand_in = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stand_in)

    def fp8_gemm_nt(a, b, out):
        scales_seen.append((a[0].shape[1], a[1].shape, a[1].stride()))
        stand_in.fp8_gemm_nt(a, b, out)

    return types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt, __version__="stand-in")


@in_this_process
def test_deepgemm_reads_the_padded_mn_major_input_as_it_is(monkeypatch, poisoned_outputs):
    """Handed `act_buffers`' DeepGEMM layout, `run_fp8_gemm` passes it through (no quantisation launch, no
    transpose inside DeepGEMM); handed rows that are not its row class, it quantises x itself."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 256, generator=g).bfloat16()
    wq, ws = quant_block(torch.randn(128, 256, generator=g) * 0.05)
    seen: list = []
    module = _recording_deep_gemm(seen)
    launches = []
    real_quant_act = fp8_gemm.quant_act
    monkeypatch.setattr(fp8_gemm, "quant_act", lambda *a, **k: launches.append(1) or real_quant_act(*a, **k))
    with torch_rounded_casts():
        mid, q, s = swiglu_quant.swiglu_quant(x[:, :128], x[:, 128:], True)
        plain = deepgemm.run_fp8_gemm(module, mid, wq[:, :128].contiguous(), ws[:, :1].contiguous())
        assert launches == [1] and seen[-1][2] == (1, 16)
        got = deepgemm.run_fp8_gemm(module, mid, wq[:, :128].contiguous(), ws[:, :1].contiguous(), act=(q, s))
        assert launches == [1] and seen[-1][2] == (1, 16)
        assert torch.equal(got, plain)
        row_major = swiglu_quant.swiglu_quant(x[:, :128], x[:, 128:], False)
        deepgemm.run_fp8_gemm(module, mid, wq[:, :128].contiguous(), ws[:, :1].contiguous(), act=row_major[1:])
        assert launches == [1, 1]  # 3 rows, not DeepGEMM's 16: quantised again


def _fp8_model(gemm: str, fused: bool):
    """An FP8 bf16 model whose heads are one quantisation group wide (v_head_dim 128), dense and MoE layers with a
    shared expert; `fused`: activations quantised by the kernels producing them (norm_quant="triton")."""
    from minidsa.config import ModelConfig
    from minidsa.models.loader import build_model
    from minidsa.common.presets import preset_config

    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw.update(vocab_size=256, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, q_lora_rank=128,
               kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=128, num_attention_heads=4,
               num_key_value_heads=4)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, torch.bfloat16, torch.device("cpu"), seed=1, init_std=0.05, quantization="fp8",
                        gemm=gemm, norm_quant="triton" if fused else "torch", mla_absorb="triton")
    return model, cfg


@in_this_process
def test_model_chooses_the_producers_at_build():
    from minidsa.models.deepseek_v32 import MLAttention, MLP, set_mla_absorb, set_swiglu_quant

    model, cfg = _fp8_model("deepgemm", fused=True)
    attn = [m for m in model.modules() if isinstance(m, MLAttention)]
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert attn and all(m.quantizes_o and m.o_quant_for_deep_gemm for m in attn)
    assert len(mlps) == cfg.num_layers_with_mtp and all(m.quantizes_product and m.product_for_deep_gemm for m in mlps)
    assert set_swiglu_quant(model, "torch") == [] and not any(m.quantizes_product for m in mlps)
    set_mla_absorb(model, "torch")  # the torch bmm makes no quantisation
    assert not any(m.quantizes_o for m in attn)
    with pytest.raises(ValueError, match="swiglu_quant kernel"):
        set_swiglu_quant(model, "cuda")
    model, _ = _fp8_model("triton", fused=True)  # the Triton GEMM reads them too, in plain rows
    assert all(m.quantizes_o and not m.o_quant_for_deep_gemm for m in model.modules() if isinstance(m, MLAttention))
    assert all(m.quantizes_product and not m.product_for_deep_gemm for m in model.modules() if isinstance(m, MLP))
    model, _ = _fp8_model("torch", fused=True)  # the reference quantises for itself
    assert not any(getattr(m, "quantizes_o", False) or getattr(m, "quantizes_product", False)
                   for m in model.modules())


@in_this_process
def test_decode_with_deepgemm_launches_no_quantisation_for_o_proj_and_down_projections(monkeypatch):
    """A decode step of one token with DeepGEMM serving every FP8 linear (as it serves o_proj and the dense MLP at
    bench-dsv32 sizes): with the producers quantising, o_proj, every down projection (dense, shared expert) and
    every linear reading only a norm read their input as DeepGEMM's padded MN-major rows, and `quant_act` runs only
    where a norm also feeds the fused MoE; the logits equal the unfused model's within bf16 noise. The decode
    forward traces whole, holding both ops."""
    from harness import PagedDriver

    from minidsa.common.batch import ForwardBatch
    from minidsa.kernels import fused_moe
    from minidsa.models.deepseek_v32 import MLAttention, MLP
    from minidsa.common.plan import StepKind

    seen: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _recording_deep_gemm(seen))
    monkeypatch.setattr(deepgemm, "FP8_GEMM_DEEPGEMM_MIN_WEIGHT", 0)  # DeepGEMM at one row, for every weight
    launches: list = []
    real_quant_act = fp8_gemm.quant_act

    def counting(x, *args, **kwargs):
        launches.append(x.shape[1])
        return real_quant_act(x, *args, **kwargs)

    monkeypatch.setattr(fp8_gemm, "quant_act", counting)
    monkeypatch.setattr(fused_moe, "quant_act", counting)
    results = {}
    for fused in (True, False):
        model, cfg = _fp8_model("deepgemm", fused)
        if not fused:  # the same absorb_o kernel, its output left to o_proj's GEMM to quantise
            for m in model.modules():
                if isinstance(m, MLAttention):
                    m.quantizes_o = False
        d = PagedDriver(model, cfg, page_size=1, max_len=64, dtype=torch.bfloat16)
        d.add(list(range(3, 3 + 20)), reserve=4)
        with torch_rounded_casts():
            d.prefill([0])
        row = d.reqs[0]["row"]
        decode = ForwardBatch.build(StepKind.DECODE, [7], [row], [20], [1], d.table.req_to_token[row, 20:21].long(),
                                    "cpu")
        if fused:
            with torch.no_grad():
                ex = torch._dynamo.explain(model.forward)(decode, d.attn)
            assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
            ops = {str(n.target) for gm in ex.graphs for n in gm.graph.nodes if "minidsa" in str(n.target)}
            assert any("absorb_o_quant" in o for o in ops) and any("swiglu_quant" in o for o in ops), ops
        launches.clear()
        seen.clear()
        with torch.no_grad(), torch_rounded_casts():
            results[fused] = model.forward(decode, d.attn).logits
        results[fused, "launches"] = list(launches)
        results[fused, "scales"] = list(seen)
        attn = sum(isinstance(m, MLAttention) for m in model.main_layers[0].modules()) * cfg.num_hidden_layers
        mlps = sum(isinstance(m, MLP) for layer in model.main_layers for m in layer.modules())
        moe_layers = sum(not isinstance(layer.mlp, MLP) for layer in model.main_layers)
        d.release_all()
    o_width = cfg.num_attention_heads * cfg.v_head_dim
    assert o_width not in results[True, "launches"] and cfg.intermediate_size not in results[True, "launches"]
    assert len(results[False, "launches"]) > attn + mlps + len(results[True, "launches"])
    # What is left: the shared experts' gate|up re-quantising the MoE layers' post-attention norm output, which the
    # norm writes in plain rows for the fused MoE; the norms read only by DeepGEMM's linears write its layout.
    assert results[True, "launches"] == [cfg.hidden_size] * moe_layers
    # o_proj's and the dense down projection's inputs reach DeepGEMM as 16 padded rows with MN-major scales
    assert (o_width, (16, o_width // 128), (1, 16)) in results[True, "scales"]
    assert (cfg.intermediate_size, (16, 3), (1, 16)) in results[True, "scales"]
    err = (results[True].float() - results[False].float()).norm() / results[False].float().norm()
    assert err < 2e-2, err


_COMPILE_FOR_H100 = SPILL_CHECK + """
from minidsa.kernels import swiglu_quant
src = ASTSource(swiglu_quant._swiglu_quant_kernel, {
    "gate_ptr": "*bf16", "up_ptr": "*bf16", "mid_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32",
    "inter": "i32", "stride_g": "i32", "stride_u": "i32", "stride_m": "i32", "stride_q": "i32", "stride_sm": "i32",
    "stride_sg": "i32", "ROWS": "constexpr", "GROUP": "constexpr", "EMULATE_CAST": "constexpr", "PDL": "constexpr"},
    constexprs={"ROWS": swiglu_quant.ROWS, "GROUP": 128, "EMULATE_CAST": False, "PDL": True})
kernel = compile_without_spills(src, 4)
assert "div.rn.f32" in kernel.asm["ptx"]  # silu's IEEE division and the quantisation's exact reciprocal
print("compiled")
"""


def test_swiglu_quant_kernel_compiles_for_h100_without_spills():
    """The interpreter runs Python, not Triton's compiler: compile the kernel for sm_90 (no GPU needed) and count
    ptxas's spill bytes (none)."""
    compile_for_h100(_COMPILE_FOR_H100, "_swiglu_quant_kernel")
