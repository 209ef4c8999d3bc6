"""Where a batch-1 decode step quantises activations for its FP8 GEMMs, counted per layer (tests/op_census.py).

bench-dsv32:6 on an H100 ran `fp8_gemm.quant_act` (`_act_quant_kernel`) 6 times per decode step: in each dense
layer, DeepGEMM (serving gate|up: its weight is large) re-quantising the post-attention norm's row-major output
into its 16 padded rows with MN-major scales (`deepgemm.run_fp8_gemm`); in each MoE layer, the Triton fused MoE
quantising silu(gate) * up for the down GEMM. Now the norm writes DeepGEMM's layout where DeepGEMM serves every
linear reading it (`set_norm_quant`). The experts' quantisation stays: doing it in the gate/up launch's epilogue needs N tiles
of whole 128-column groups, and those tiles made the expert GEMMs 15.6 us per step slower on an H100 (half the
programs at batch 1), more than the 3 launches cost (benchmarks/archive/TAIL.md section 8). Here a tiny FP8 model is served as bench-dsv32 is at one token: DeepGEMM
(a torch stand-in) for the dense gate|up, the dense down and o_proj, the Triton GEMM for the rest, the Triton fused
MoE for the routed experts (its CUDA implementation, run by the interpreter), and every launch is counted.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch._dynamo  # noqa: F401  (before torch.empty is patched: see tests/test_norm_quant.py)

if torch.cuda.is_available():
    pytest.skip("CUDA present: the step's kernels are profiled on the GPU", allow_module_level=True)

from triton_interp import import_kernels_interpreted, run_file_interpreted, torch_rounded_casts  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

import op_census  # noqa: E402
from minidsa.kernels import custom_ops  # noqa: E402,F401
from minidsa.kernels import deepgemm  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_act_quant_census_in_child_process():
    run_file_interpreted(__file__)


def _decode_census(model, cfg, d, decode):
    census = op_census.OpCensus()
    from minidsa.models.deepseek_v32 import call_layer

    with torch.no_grad(), torch_rounded_casts(), census.triton_launches(), census:
        logits = model.forward(decode, d.attn, run_layer=census.counting_layers(call_layer)).logits
    layers = sorted(p for p in census.ops if p.startswith("layer"))
    quant = {p: census.ops[p].get("triton:_act_quant_kernel", 0) for p in layers}
    return logits, quant, census


@in_this_process
def test_batch1_decode_quantises_activations_only_for_the_experts(monkeypatch):
    from harness import PagedDriver
    from test_residual_fold import same_bits, unfolded_forward
    from test_swiglu_quant import _fp8_model, _recording_deep_gemm
    from torch._library.custom_ops import OPDEFS

    from minidsa.common.batch import ForwardBatch
    from minidsa.models.deepseek_v32 import MLP, RMSNorm
    from minidsa.common.plan import StepKind

    seen: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _recording_deep_gemm(seen))
    model, cfg = _fp8_model("deepgemm", fused=True)
    h, inter, o_width = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.v_head_dim
    big = {(2 * inter, h), (h, inter), (h, o_width)}  # dense gate|up, dense down, o_proj: DeepGEMM's at one row
    monkeypatch.setattr(deepgemm, "fp8_gemm_wins", lambda m, n, k: m >= 17 or (n, k) in big)
    # The routed experts as a GPU serves them (the Triton fused MoE), counted launch by launch
    fused_moe_op = OPDEFS["minidsa::fused_moe"]
    monkeypatch.setitem(fused_moe_op._backend_fns, "cpu", fused_moe_op._backend_fns["cuda"])
    monkeypatch.setattr(op_census, "OPAQUE", set())

    d = PagedDriver(model, cfg, page_size=1, max_len=64, dtype=torch.bfloat16)
    d.add(list(range(3, 3 + 20)), reserve=4)
    with torch_rounded_casts():
        d.prefill([0])
    row = d.reqs[0]["row"]
    decode = ForwardBatch.build(StepKind.DECODE, [7], [row], [20], [1], d.table.req_to_token[row, 20:21].long(), "cpu")
    dense = {f"layer {i}" for i, layer in enumerate(model.main_layers) if isinstance(layer.mlp, MLP)}
    assert dense and len(dense) < len(model.main_layers)

    logits, quant, census = _decode_census(model, cfg, d, decode)
    assert {quant[p] for p in dense} == {0}, census.describe()
    with torch.no_grad(), torch_rounded_casts():  # the residual adds in the norms' Triton launches: the same bytes
        assert same_bits(logits, unfolded_forward(model, decode, d.attn)[1])
    for place in set(quant) - dense:  # the experts ran the Triton kernels: the product quantised between them
        assert quant[place] == 1 and census.ops[place]["triton:_expert_gemm_kernel"] == 2, census.describe()
    assert census.ops["outside"].get("triton:_act_quant_kernel", 0) == 0
    assert any(s[0] == inter and s[2] == (1, 16) for s in seen)  # gate|up read the norm's padded MN-major rows
    # Six FP8 linears per layer: in_proj (q_a|wk|kv_a), q_b_proj, the indexer's wq_b, o_proj, and gate|up and down
    # (dense, or the shared expert's). The Triton GEMM serves those DeepGEMM does not take at one row: in_proj,
    # q_b_proj and wq_b, and a MoE layer's shared expert.
    for place in quant:
        assert census.ops[place]["minidsa.fp8_linear"] == 6, census.describe()
        assert census.ops[place]["triton:_w8a8_gemm_kernel"] == (3 if place in dense else 5), census.describe()

    # As before: the norms' output row-major, which DeepGEMM re-quantised in a launch of its own.
    for norm in model.modules():
        if isinstance(norm, RMSNorm):
            norm.quant_for_deep_gemm = False
    before, quant_before, census = _decode_census(model, cfg, d, decode)
    assert set(quant_before.values()) == {1}, census.describe()
    assert torch.equal(logits, before)  # the same bytes quantised, laid out for DeepGEMM by the norm
    d.release_all()
