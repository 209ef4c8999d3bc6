"""FP8 block-scaled GEMMs and FP8 models on the GPU (CUDA only).

- The Triton w8a8 GEMM (and DeepGEMM's fp8_gemm_nt when `deep_gemm` imports) against the torch reference
  at DeepSeek-V3.2 / GLM-5 projection shapes, for decode (M = 1, 8, 32) and prefill (M = 128, 2048) sizes.
- The custom op inside a CUDA graph replays what it computed eagerly.
- RMSNorm + FP8 input quantisation in one launch (kernels/norm_quant.py) at the real widths against the torch norm
  and the GEMM's own quantisation, and the GEMMs reading it.
- Random init of the bench-dsv32 preset (3 dense + 1 MoE layer + MTP, FP8) peaks at <= 1.1x its weights.
- A few greedy tokens of bench-dsv32 in FP8 through the engine (eager vs CUDA graphs + compile).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from triton.runtime.jit import JITFunction  # noqa: E402

from minidsa.kernels import custom_ops, deepgemm, fp8_gemm, norm_quant, num_sms  # noqa: E402,F401
from minidsa.kernels import reference as ref  # noqa: E402
from minidsa.kernels.fp8 import FP8_DTYPE, quant_block, w8a8_block_matmul_reference  # noqa: E402

if not isinstance(fp8_gemm._w8a8_gemm_kernel, JITFunction):
    pytest.skip("Triton kernels were imported as interpreted functions in this process", allow_module_level=True)

DEV = torch.device("cuda")
# (name, N, K): out x in of the FP8 projections a decode step runs
SHAPES = [
    ("dsv32 q_a|wk|kv_a", 1536 + 128 + 576, 7168),
    ("dsv32 q_b", 128 * 192, 1536),
    ("dsv32 o_proj", 7168, 128 * 128),
    ("dsv32 dense down", 7168, 18432),
    ("dsv32 shared gate_up", 2 * 2048, 7168),
    ("glm5 q_a|wk|kv_a", 2048 + 128 + 576, 6144),
    ("glm5 o_proj", 6144, 64 * 256),
]
MS = (1, 8, 32, 128, 300, 2048)  # 300: DeepGEMM runs it as a 320-row class (deepgemm.gemm_rows)


def _weights(n: int, k: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=DEV) * 0.02
    return quant_block(w, pow2_scale=True)


@pytest.fixture(scope="module", params=SHAPES, ids=[s[0] for s in SHAPES])
def shape(request):
    name, n, k = request.param
    wq, ws = _weights(n, k)
    return name, wq, ws


@pytest.mark.parametrize("m", MS)
def test_triton_fp8_gemm_matches_reference(shape, m):
    name, wq, ws = shape
    x = torch.randn(m, wq.shape[1], device=DEV, dtype=torch.bfloat16)
    y = fp8_gemm.w8a8_block_gemm(x, wq, ws)
    ref = w8a8_block_matmul_reference(x.float(), wq, ws)
    # Same e4m3 operands and fp32 accumulation; the output is rounded to bf16 (2^-8 relative).
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2, (name, m, float(err))


@pytest.mark.parametrize("m", MS)
def test_deepgemm_fp8_gemm_matches_reference(shape, m):
    module, status = deepgemm.probe(DEV, deepgemm.GEMM_API)
    if not status.available:
        pytest.skip(status.reason)
    name, wq, ws = shape
    x = torch.randn(m, wq.shape[1], device=DEV, dtype=torch.bfloat16)
    y = deepgemm.fp8_gemm_nt(module, x, wq, ws)  # raises LibraryCallFailed (with DeepGEMM's error) if it fails
    if y is None:
        pytest.skip(f"DeepGEMM does not take {name} at M={m} (shape)")
    ref = w8a8_block_matmul_reference(x.float(), wq, ws)
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2, (name, m, float(err))


def test_split_k_in_kernel_sum_is_the_same_every_call():
    """Decode split-K (V3.2's fused q_a|wk|kv_a at one row): the last K range of a tile adds the partials, in K order.
    Many calls give the same bits, and every tile's arrival count is back at 0 after each."""
    wq, ws = _weights(2240, 7168)
    x = torch.randn(1, 7168, device=DEV, dtype=torch.bfloat16)
    assert fp8_gemm.pick_tiles(1, 2240, 7168, num_sms(DEV)).split_k > 1
    first = fp8_gemm.w8a8_block_gemm(x, wq, ws)
    outs = [fp8_gemm.w8a8_block_gemm(x, wq, ws) for _ in range(300)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for o in outs)
    assert int(fp8_gemm.arrival_counts(x.device).abs().sum()) == 0
    ref = w8a8_block_matmul_reference(x.float(), wq, ws)
    assert (first.float() - ref).abs().max() / ref.abs().max() < 1e-2


def test_fp8_linear_op_replays_in_a_cuda_graph():
    wq, ws = _weights(2240, 7168)
    x = torch.randn(4, 7168, device=DEV, dtype=torch.bfloat16)
    for use_deep_gemm in (False, True):
        eager = torch.ops.minidsa.fp8_linear(x, wq, ws, use_deep_gemm)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.minidsa.fp8_linear(x, wq, ws, use_deep_gemm)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), use_deep_gemm


@pytest.mark.parametrize("tokens", [1, 32, 8192])
@pytest.mark.parametrize("hidden,residual", [(7168, True), (7168, False), (1536, False), (6144, True)])
def test_rmsnorm_quant_real_size(tokens, hidden, residual):
    """DeepSeek-V3.2's hidden 7168 (after the attention's residual add, and the layer's input norm), its q_lora 1536,
    GLM-5's 6144: the residual sum exact; the normed bf16 row within an ulp of the torch norm, almost all exactly;
    e4m3 bytes and scales exactly what the GEMM's own quantisation (`fp8_gemm.quant_act`) makes of that row; the
    w8a8 GEMM and the fused MoE reading them give what they give quantising themselves; in a CUDA graph too."""
    g = torch.Generator(device=DEV).manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, device=DEV, generator=g).bfloat16()
    res = torch.randn(tokens, hidden, device=DEV, generator=g).bfloat16() * 4 if residual else None
    weight = (1 + 0.2 * torch.randn(hidden, device=DEV, generator=g)).bfloat16()
    h, normed, q, s = norm_quant.rmsnorm_quant(x, weight, 1e-6, res)
    want_h, want_normed, _, want_s = ref.rmsnorm_quant(x, weight, 1e-6, res)
    if residual:
        assert torch.equal(h, want_h)
    ulp = want_normed.float().abs().clamp_min(1e-30) * torch.finfo(torch.bfloat16).eps
    apart = (normed.float() - want_normed.float()).abs() / ulp
    assert apart.max() <= 2 and (apart == 0).float().mean() >= 0.98, (apart.max(), (apart == 0).float().mean())
    own_q, own_s = fp8_gemm.quant_act(normed)
    assert torch.equal(s, own_s) and torch.equal(q.view(torch.uint8), own_q.view(torch.uint8))
    torch.testing.assert_close(s, want_s, rtol=1e-2, atol=0)
    wq, ws = _weights(2 * 2048, hidden)
    for rows in sorted({tokens, min(tokens, 200)}):  # above 64 rows the GEMM quantises outside; at decode sizes inside
        y = torch.ops.minidsa.fp8_linear(normed[:rows], wq, ws, False, q[:rows], s[:rows])
        assert torch.equal(y, torch.ops.minidsa.fp8_linear(normed[:rows], wq, ws, False))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = (torch.ops.minidsa.add_rmsnorm_quant(x, res, weight, 1e-6) if residual else
                 (None, *torch.ops.minidsa.rmsnorm_quant(x, weight, 1e-6)))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(g_out[1:], (normed, q, s)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b)


def test_fused_moe_reads_the_norms_quantisation():
    """The Triton fused MoE at V3.2's per-expert shapes (hidden 7168, intermediate 2048, top 8; 16 of the 256
    experts, to keep the random weights small), 1 and 32 tokens: handed the norm's quantisation of x, the same output
    as quantising x itself."""
    from minidsa.kernels.fused_moe import fused_moe_triton

    g = torch.Generator(device=DEV).manual_seed(11)
    experts, hidden, inter = 16, 7168, 2048
    gu, gu_s = quant_block(torch.randn(experts, 2 * inter, hidden, device=DEV, generator=g) * 0.02, pow2_scale=True)
    dn, dn_s = quant_block(torch.randn(experts, hidden, inter, device=DEV, generator=g) * 0.02, pow2_scale=True)
    weight = torch.ones(hidden, device=DEV, dtype=torch.bfloat16)
    for tokens in (1, 32):
        x = torch.randn(tokens, hidden, device=DEV, generator=g).bfloat16()
        _, normed, q, s = norm_quant.rmsnorm_quant(x, weight, 1e-6)
        ids = torch.stack([torch.randperm(experts, device=DEV, generator=g)[:8] for _ in range(tokens)])
        w = torch.rand(tokens, 8, device=DEV, generator=g)
        base = fused_moe_triton(normed, ids, w, gu, dn, gu_s, dn_s)
        assert torch.equal(fused_moe_triton(normed, ids, w, gu, dn, gu_s, dn_s, act=(q, s)), base)
    del gu, dn
    torch.cuda.empty_cache()


def test_bench_preset_random_init_peaks_at_its_weights():
    from minidsa.config import ModelConfig
    from minidsa.models.loader import build_model
    from minidsa.common.presets import preset_config

    config = ModelConfig.from_dict(preset_config("bench-dsv32"))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(config, None, torch.bfloat16, DEV, seed=0, progress=False, gemm="triton")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    peak = torch.cuda.max_memory_allocated() - base
    print(f"\nbench-dsv32 random init: weights {weights / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB "
          f"({peak / weights:.3f}x)")
    assert model.model.layers[3].mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    assert peak <= 1.1 * weights
    del model
    torch.cuda.empty_cache()


# How far apart two correct paths may put the likeliest tokens (nats). With random bf16 weights the top logits of
# bench-dsv32 nearly tie, and eager modules against the compiled layer and graph (other fusion, other split-K sums,
# padding) round the bf16 hidden state differently, which FP8 activation quantisation amplifies (an e4m3 step is
# 6%). Measured on an H100 (2026-11-27), first prompt, prefill: at 54a21fb the top-5 logprobs moved by 0.001-0.19
# nats and the picks differed (0.031 apart in the eager run); at 785fd6e the picks agree but one logprob moved by
# 0.28, so this fails there (benchmarks/archive/TAIL.md section 6: not settled whether that is only rounding).
NEAR_TIE_NATS = 0.25


def test_bench_preset_fp8_decodes_the_same_with_graphs():
    from minidsa import LLM, SamplingParams

    prompts = [[100 + 7 * i + j for j in range(40 + 9 * i)] for i in range(3)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
    runs = []
    for fast in (False, True):
        llm = LLM(model="bench-dsv32", max_total_tokens=4096, max_model_len=1024, max_running_requests=4,
                  enable_cuda_graph=fast, enable_compile=fast, cuda_graph_max_bs=4, progress=False)
        assert llm.engine.runner.model.model.layers[0].self_attn.o_proj.is_fp8
        runs.append([(o.token_ids, o.top_logprobs) for o in llm.generate(prompts, greedy)])
        del llm
        torch.cuda.empty_cache()
    # The first token comes from the prefill, the second from the first decode step: eager modules in one run,
    # the compiled layer (prefill) and the compiled CUDA graph (decode) in the other. Up to the first token they part
    # on, each run's distribution must be the other's: the same likeliest tokens with the same logprobs, and where
    # the two picks differ, each pick within NEAR_TIE_NATS of the other in both runs (a near tie, not a bug). Later
    # tokens are not compared: after a different pick the contexts differ.
    for (eager_ids, eager_top), (graph_ids, graph_top) in zip(*runs):
        for pos in range(2):
            a, b = eager_ids[pos], graph_ids[pos]
            report = f"position {pos}: eager {eager_ids} {eager_top[pos]}, graphs {graph_ids} {graph_top[pos]}"
            print(report)
            for tok in set(eager_top[pos]) & set(graph_top[pos]):
                assert abs(eager_top[pos][tok] - graph_top[pos][tok]) <= NEAR_TIE_NATS, report
            if a != b:
                for top in (eager_top[pos], graph_top[pos]):
                    assert a in top and b in top and abs(top[a] - top[b]) <= NEAR_TIE_NATS, report
                break
