"""The fused MoE compiled on a GPU at DeepSeek-V3.2's expert shapes (CUDA only).

256 routed experts, top-8 among 4 of 8 groups (the model's Router), hidden 7168, expert intermediate
2048; bf16 weights (22.5 GiB) and the same weights in FP8 (e4m3, 128x128 block scales). Checks the
Triton kernels against the torch reference (minidsa.kernels.fused_moe.fused_moe_reference, the same
rounding points and the same activation quantisation) from decode to prefill sizes, that results are
deterministic, that nothing syncs with the host, that the op replays in a CUDA graph and compiles
without graph breaks, that decode needs no more than its O(T * k * (H + I)) buffers, and that
Experts.forward serves FP8 weights through the *_scale_inv parameters.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from triton.runtime.jit import JITFunction  # noqa: E402

from minidsa.kernels import deepgemm, fp8  # noqa: E402
from minidsa.kernels import fused_moe as fm  # noqa: E402
from minidsa.models.deepseek_v32 import Experts, Router  # noqa: E402

if not isinstance(fm._expert_gemm_kernel, JITFunction):
    pytest.skip("Triton kernels were imported as interpreted functions in this process", allow_module_level=True)

DEV = torch.device("cuda")
E, H, I, K, N_GROUP, TOPK_GROUP = 256, 7168, 2048, 8, 8, 4
CONFIG = SimpleNamespace(n_routed_experts=E, hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=K,
                         n_group=N_GROUP, topk_group=TOPK_GROUP, norm_topk_prob=True, routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def router() -> Router:
    r = Router(CONFIG).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        r.weight.normal_(0.0, H**-0.5, generator=g)
        r.e_score_correction_bias.uniform_(0.0, 0.1, generator=g)
    return r


@pytest.fixture(scope="module")
def bf16_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(1)
    gate_up = torch.empty(E, 2 * I, H, device=DEV, dtype=torch.bfloat16).normal_(0.0, H**-0.5, generator=g)
    down = torch.empty(E, H, I, device=DEV, dtype=torch.bfloat16).normal_(0.0, I**-0.5, generator=g)
    return gate_up, down


@pytest.fixture(scope="module")
def fp8_weights(bf16_weights):
    """The bf16 weights quantised per 128x128 block (one expert at a time: no fp32 copy of all 256)."""
    out = []
    for w in bf16_weights:
        q = torch.empty_like(w, dtype=fp8.FP8_DTYPE)
        s = torch.empty(E, *fp8.block_scale_shape(w.shape[1], w.shape[2]), device=DEV)
        for e in range(E):
            q[e], s[e] = fp8.quant_block(w[e])
        out += [q, s]
    gate_up, gate_up_s, down, down_s = out
    return gate_up, down, gate_up_s, down_s


def inputs(router: Router, num_tokens: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, H, device=DEV, generator=g).to(dtype)
    with torch.no_grad():
        ids, weights = router(x)
    return x, ids, weights


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def captured(fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn run once on a side stream (its lazy initialisation out of the capture), then captured: (graph, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("num_tokens", [1, 8, 32, 256, 2048])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_matches_reference_and_is_deterministic(router, bf16_weights, fp8_weights, kind, num_tokens):
    params = bf16_weights if kind == "bf16" else fp8_weights
    x, ids, weights = inputs(router, num_tokens, seed=num_tokens)
    got = fm.fused_moe_triton(x, ids, weights, *params)
    want = fm.fused_moe_reference(x, ids, weights, *params)
    err = rel_err(got, want)
    print(f"\n{kind} T={num_tokens}: rel err vs reference {err:.2e}, tiles "
          f"{fm.tile_config(num_tokens, K, E, params[0].dtype, x.dtype)}")
    assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, H)
    assert err < 1e-2
    for _ in range(2):
        assert torch.equal(fm.fused_moe_triton(x, ids, weights, *params), got)


def tp_shard(params: tuple, ranks: int) -> tuple:
    """Rank 0's FP8 experts under --tp `ranks`: the first I / ranks gate rows, up rows and down columns."""
    gate_up, down, gate_up_s, down_s = params
    i, b = I // ranks, I // ranks // fp8.FP8_BLOCK
    blocks = I // fp8.FP8_BLOCK
    return (torch.cat([gate_up[:, :i], gate_up[:, I:I + i]], 1).contiguous(), down[:, :, :i].contiguous(),
            torch.cat([gate_up_s[:, :b], gate_up_s[:, blocks:blocks + b]], 1).contiguous(),
            down_s[:, :, :b].contiguous())


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_tp_rank_shapes_split_gate_up_along_k(router, fp8_weights, num_tokens):
    """Under --tp 4 a rank's experts have I = 512: at 1 and 2 tokens the gate/up GEMM has fewer programs than SMs and
    is split along K (`gate_up_splits`); against the reference, and against the same op unsplit; in a CUDA graph."""
    params = tp_shard(fp8_weights, 4)
    x, ids, weights = inputs(router, num_tokens, seed=50 + num_tokens)
    cfg = fm.tile_config(num_tokens, K, E, fp8.FP8_DTYPE, x.dtype)
    blocks = fm.align_for(num_tokens * K)(ids.int(), E, cfg.block_m).block_expert.numel()
    splits = fm.gate_up_splits(blocks * (I // 4 // cfg.block_n), H // fp8.FP8_BLOCK, fm.num_sms(DEV), True)
    assert splits > 1
    got = fm.fused_moe_triton(x, ids, weights, *params)
    whole = fm.fused_moe_triton(x, ids, weights, *params,
                                config=fm.TileConfig(**{**cfg.__dict__, "gate_up_split_k": 1}))
    want = fm.fused_moe_reference(x, ids, weights, *params)
    print(f"\nTP4 T={num_tokens}: {splits} K ranges, rel err vs reference {rel_err(got, want):.2e}, vs unsplit "
          f"{rel_err(got, whole):.2e}")
    assert rel_err(got, want) < 1e-2 and rel_err(got, whole) < 1e-2
    graph, out = captured(lambda: fm.fused_moe_triton(x, ids, weights, *params))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_split_gate_up_tiles_match_reference(router, bf16_weights, fp8_weights, kind):
    """The sweep's split gate/up variant (one GEMM over 2I, silu * up in its own pass) at a prefill size."""
    params = bf16_weights if kind == "bf16" else fp8_weights
    x, ids, weights = inputs(router, 2048, seed=3)
    for tiles in (fm.TileConfig(128, 128, 128, 8, 8, 3, split_gate_up=True),
                  fm.TileConfig(64, 128, 128, 8, 4, 3, split_gate_up=True)):
        got = fm.fused_moe_triton(x, ids, weights, *params, config=tiles)
        err = rel_err(got, fm.fused_moe_reference(x, ids, weights, *params))
        print(f"\n{kind} split {tiles}: rel err vs reference {err:.2e}")
        assert err < 2e-2  # one more rounding point (gate, up in bf16) than the reference


@pytest.mark.parametrize("path", ["triton", "deepgemm"])
def test_fp8_prefill_size_matches_reference(router, fp8_weights, path):
    """8192 tokens (256 pairs per expert): the Triton prefill tiles, and DeepGEMM's grouped GEMMs where built
    (what the fused_moe op serves at this size with DeepGEMM on)."""
    x, ids, weights = inputs(router, 8192, seed=8)
    if path == "deepgemm":
        module, status = deepgemm.probe(DEV, deepgemm.GEMM_API)
        if module is None or deepgemm.grouped_contiguous(module) is None:
            pytest.skip(f"DeepGEMM's contiguous grouped GEMM is not available here ({status.reason})")
        assert deepgemm.moe_contiguous_wins(8192, K, E)
        got = deepgemm.moe_contiguous(module, x, ids, weights, *fp8_weights)  # raises LibraryCallFailed if it fails
        assert got is not None, "DeepGEMM's grouped GEMM declined the call"
    else:
        got = fm.fused_moe_triton(x, ids, weights, *fp8_weights)
    err = rel_err(got, fm.fused_moe_reference(x, ids, weights, *fp8_weights))
    print(f"\nfp8 T=8192 {path}: rel err vs reference {err:.2e}")
    # DeepGEMM returns gate and up in bf16 before silu * up: one more rounding than the reference (as split tiles)
    assert got.shape == (8192, H) and err < (2e-2 if path == "deepgemm" else 1e-2)


@pytest.mark.parametrize("path,num_tokens", [("triton", 1), ("triton", 32), ("triton", 8192), ("deepgemm", 8192)])
def test_addend_joins_the_routed_sum_before_its_one_rounding(router, fp8_weights, path, num_tokens):
    """`addend` (the shared experts' output, as `MoE.forward` hands it over) is added to the routed rows' fp32 sum
    in the launch that sums them: against the reference with the addend; and with the addend the negated routed
    output, what is left is the rounding residual of the fp32 sum (under half a bf16 ulp, mostly nonzero), where
    two roundings would leave zero."""
    x, ids, weights = inputs(router, num_tokens, seed=20 + num_tokens)
    addend = torch.randn(x.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)).bfloat16()
    if path == "deepgemm":
        module, status = deepgemm.probe(DEV, deepgemm.GEMM_API)
        if module is None or deepgemm.grouped_contiguous(module) is None:
            pytest.skip(f"DeepGEMM's contiguous grouped GEMM is not available here ({status.reason})")

        def run(a=None):
            return deepgemm.moe_contiguous(module, x, ids, weights, *fp8_weights, addend=a)
    else:
        def run(a=None):
            return fm.fused_moe_triton(x, ids, weights, *fp8_weights, addend=a)

    got = run(addend)
    # DeepGEMM: gate and up rounded to bf16 before silu * up, one more rounding than the reference
    assert rel_err(got, fm.fused_moe_reference(x, ids, weights, *fp8_weights, addend=addend)) < (
        2e-2 if path == "deepgemm" else 1e-2)
    routed = run()
    residual = run(-routed).float()
    assert (residual.abs() <= torch.finfo(torch.bfloat16).eps / 2 * routed.float().abs()).all()
    assert (residual != 0).float().mean() > 0.5


def test_fp8_activation_quantisation_is_torchs(router, fp8_weights):
    """fp32 activations: the in-kernel per-token-group quantisation equals fp8.quant_act_per_token_group's."""
    x, ids, weights = inputs(router, 16, seed=3, dtype=torch.float32)
    got = fm.fused_moe_triton(x, ids, weights, *fp8_weights)
    want = fm.fused_moe_reference(x, ids, weights, *fp8_weights)
    no_quant = fm.fused_moe_reference(x.bfloat16(), ids, weights, *fp8_weights).float()
    print(f"\nfp8 with fp32 activations: rel err {rel_err(got, want):.2e} (vs bf16 activations "
          f"{rel_err(no_quant, want):.2e})")
    assert rel_err(got, want) < 1e-3


def test_no_host_sync_cuda_graph_and_compile(router, fp8_weights):
    x, ids, weights = inputs(router, 32, seed=5)
    op = torch.ops.minidsa.fused_moe
    expect = op(x, ids, weights, *fp8_weights)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        op(x, ids, weights, *fp8_weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, out = captured(lambda: op(x, ids, weights, *fp8_weights))
    graph.replay()
    assert torch.equal(out, expect)
    for seed in (6, 7):  # new routing in the same buffers
        nx, nids, nw = inputs(router, 32, seed)
        x.copy_(nx), ids.copy_(nids), weights.copy_(nw)
        graph.replay()
        assert torch.equal(out, op(nx, nids, nw, *fp8_weights))

    compiled = torch.compile(lambda a, i, w: op(a, i, w, *fp8_weights) * 2, fullgraph=True, dynamic=True)
    for n in (3, 32):
        a, i, w = inputs(router, n, seed=n)
        assert torch.equal(compiled(a, i, w), op(a, i, w, *fp8_weights) * 2)


def test_decode_memory_is_per_token(router, bf16_weights):
    """Decode at batch 32 allocates O(T * k * (H + I)), not O(E) weight copies (the old dense path: 28 GiB)."""
    x, ids, weights = inputs(router, 32, seed=9)
    fm.fused_moe_triton(x, ids, weights, *bf16_weights)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fm.fused_moe_triton(x, ids, weights, *bf16_weights)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    print(f"\nT=32 extra memory: {extra / 2**20:.1f} MiB")
    assert extra < 64 * 2**20


def test_experts_forward_fp8_parameters(router, fp8_weights):
    gate_up, down, gate_up_s, down_s = fp8_weights
    with torch.device("meta"):
        ex = Experts(CONFIG)
    ex.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    ex.down_proj = torch.nn.Parameter(down, requires_grad=False)
    ex.gate_up_proj_scale_inv = torch.nn.Parameter(gate_up_s, requires_grad=False)
    ex.down_proj_scale_inv = torch.nn.Parameter(down_s, requires_grad=False)
    x, ids, weights = inputs(router, 4, seed=11)
    with torch.no_grad():
        assert torch.equal(ex(x, ids, weights), fm.fused_moe_triton(x, ids, weights, *fp8_weights))
