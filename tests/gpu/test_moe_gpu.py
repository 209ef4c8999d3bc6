"""The routed-expert Triton kernels, compiled, at DeepSeek-V3.2 expert sizes (CUDA only).

bench-dsv32's MoE: hidden 7168, expert intermediate 2048, 16 routed experts,
top-8, bf16. Checks the kernels against an fp32 reference for 1, 2, 8 and 16
tokens, that they are deterministic, replay inside a CUDA graph, and serve
Experts.forward up to MOE_KERNEL_MAX_PAIRS pairs; prints their time next to
Experts' dense and gather paths (run with -s to see it).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from triton.runtime.jit import JITFunction  # noqa: E402

from minidsa.kernels import custom_ops, moe  # noqa: E402,F401
from minidsa.models import deepseek_v32  # noqa: E402
from minidsa.models.deepseek_v32 import Experts  # noqa: E402

if not isinstance(moe._gate_up_kernel, JITFunction):
    pytest.skip("Triton kernels were imported as interpreted functions in this process", allow_module_level=True)

DEV = torch.device("cuda")
E, H, I, K = 16, 7168, 2048, 8
TOKENS = (1, 2, 8, 16)
EXPERT_BYTES = 3 * H * I * 2


@pytest.fixture(scope="module")
def experts() -> Experts:
    with torch.device(DEV):
        ex = Experts(SimpleNamespace(n_routed_experts=E, hidden_size=H, moe_intermediate_size=I))
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0.0, H**-0.5, generator=g)
        ex.down_proj.normal_(0.0, I**-0.5, generator=g)
    return ex.to(torch.bfloat16).requires_grad_(False)


def inputs(num_tokens: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, H, device=DEV, generator=g).bfloat16()
    ids = torch.rand(num_tokens, E, device=DEV, generator=g).topk(K, dim=-1).indices
    weights = torch.rand(num_tokens, K, device=DEV, generator=g) * 2.5 / K
    return x, ids, weights


def reference_fp32(ex: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], H, device=DEV)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        g, u = (x[t].float() @ ex.gate_up_proj[e].float().T).chunk(2, dim=-1)
        y = (F.silu(g) * u) @ ex.down_proj[e].float().T
        out.index_add_(0, t, y * weights[t, j, None])
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def kernel(ex: Experts, x, ids, weights, tiles: moe.MoETiles | None = None) -> torch.Tensor:
    return moe.moe_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj, tiles)


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_matches_fp32_reference_and_is_deterministic(experts, num_tokens):
    x, ids, weights = inputs(num_tokens, seed=num_tokens)
    got = kernel(experts, x, ids, weights)
    want = reference_fp32(experts, x, ids, weights)
    err, dense_err = rel_err(got, want), rel_err(experts.dense(x, ids, weights), want)
    print(f"\nT={num_tokens}: rel err vs fp32 kernel {err:.2e}, dense bf16 path {dense_err:.2e}")
    assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, H)
    assert err < 1e-2 and err < 2 * dense_err + 2e-3
    for _ in range(3):
        assert torch.equal(kernel(experts, x, ids, weights), got)
    # Experts.forward dispatches here while the pairs are few, to the dense path past the threshold
    assert torch.equal(experts(x, ids, weights), torch.ops.minidsa.moe_experts(x, ids, weights,
                                                                               experts.gate_up_proj,
                                                                               experts.down_proj))


def test_forward_past_threshold_is_dense(experts):
    num_tokens = deepseek_v32.MOE_KERNEL_MAX_PAIRS // K + 1
    x, ids, weights = inputs(num_tokens, seed=99)
    assert torch.equal(experts(x, ids, weights), experts.dense(x, ids, weights))


def test_replays_in_cuda_graph(experts):
    x, ids, weights = inputs(8, seed=5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            experts(x, ids, weights)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, ids, weights)
    for seed in (6, 7):
        nx, nids, nw = inputs(8, seed)
        x.copy_(nx), ids.copy_(nids), weights.copy_(nw)
        graph.replay()
        assert torch.equal(out, kernel(experts, nx, nids, nw))


def time_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2] * 1e3


def test_timing_vs_dense_and_gather(experts):
    """Prints median us per call; the kernels must beat the dense path where they read fewer experts."""
    print(f"\n{'T':>3} {'experts hit':>11} {'kernel us':>10} {'GB/s':>6} {'dense us':>9} {'gather us':>10}")
    for num_tokens in TOKENS:
        x, ids, weights = inputs(num_tokens, seed=num_tokens)
        hit = ids.unique().numel()
        t_kernel = time_us(lambda: kernel(experts, x, ids, weights))
        t_dense = time_us(lambda: experts.dense(x, ids, weights))
        t_gather = time_us(lambda: experts.gathered(x, ids, weights), iters=5) if num_tokens <= 2 else float("nan")
        print(f"{num_tokens:>3} {hit:>11} {t_kernel:>10.1f} {hit * EXPERT_BYTES / t_kernel / 1e3:>6.0f} "
              f"{t_dense:>9.1f} {t_gather:>10.1f}")
        if hit <= E // 2:
            assert t_kernel < t_dense
    # other tile shapes, for later tuning (printed only)
    for tiles in (moe.MoETiles(32, 128, 32, 128, 4, 4), moe.MoETiles(128, 64, 128, 64, 3, 8)):
        for num_tokens in (1, 8):
            x, ids, weights = inputs(num_tokens, seed=num_tokens)
            try:
                t = f"{time_us(lambda: kernel(experts, x, ids, weights, tiles)):.1f} us"
            except Exception as e:  # e.g. out of shared memory: a tuning note, not a failure
                t = f"{type(e).__name__}: {str(e)[:80]}"
            print(f"tiles {tiles}: T={num_tokens}: {t}")
