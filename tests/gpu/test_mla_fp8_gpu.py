"""The FP8 MLA cache kernels compiled on the GPU, at DeepSeek-V3.2 / GLM-5 sizes, against the torch references.

Latent 512 + rope 64 (656-byte rows), 128 and 64 heads, top-k 2048: (the store kernel against its
reference: tests/gpu/test_kernels_gpu.py) sparse MLA over the FP8 cache equals the reference over the dequantised rows in
decode, verify (2 tokens a request) and prefill shapes; KV moves copy FP8 rows exactly; the ops
survive torch.compile and CUDA-graph capture. Run by scripts/gpu_check.sh (section `mla`).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from triton.runtime.jit import JITFunction  # noqa: E402

from minidsa.attention.backend import KernelChoice, bind_ops  # noqa: E402
from minidsa.kernels import kv_move, sparse_mla  # noqa: E402
from minidsa.kernels import reference as ref  # noqa: E402
from minidsa.common.kv_cache import MLALayout  # noqa: E402

if not isinstance(sparse_mla._sparse_mla_kernel, JITFunction):
    pytest.skip("Triton kernels were imported as interpreted functions in this process", allow_module_level=True)

DEV = torch.device("cuda")
D_V, D_R, TOPK, PAGE = 512, 64, 2048, 64
D_KV = D_V + D_R
LAYOUT = MLALayout.for_model(D_V, D_R, torch.bfloat16, "fp8")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _fp8_cache(num_slots: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    rows = torch.randn(num_slots, D_KV, device=DEV, generator=g)
    rows *= torch.exp2(torch.randint(-3, 4, (num_slots, 1), device=DEV, generator=g).float())
    cache = LAYOUT.allocate(1, num_slots, DEV)[0]
    ref.store_mla(cache, torch.arange(num_slots, device=DEV), rows.bfloat16(), D_V)
    return cache


@pytest.mark.parametrize("heads", [128, 64])
@pytest.mark.parametrize("batch,tokens_per_req", [(1, 1), (8, 1), (64, 1), (128, 1), (128, 2), (1, 4096)])
def test_sparse_mla_over_fp8_cache_real_size(heads, batch, tokens_per_req):
    num_tokens = batch * tokens_per_req
    g = _gen(batch * 7 + heads + tokens_per_req)
    num_slots = 65536
    cache = _fp8_cache(num_slots, seed=heads)
    q = (torch.randn(num_tokens, heads, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
    idx = torch.randint(0, num_slots, (num_tokens, TOPK), device=DEV, generator=g, dtype=torch.int32)
    idx[0, 1500:] = -1  # fewer keys than top-k
    if num_tokens > 1:
        idx[1] = -1  # none at all: zeros
    got = sparse_mla.sparse_mla(q, cache, idx, D_KV**-0.5 * 2, D_V)
    dequantised = ref.load_mla(cache, torch.arange(num_slots, device=DEV), D_V)
    rows = slice(0, 512)  # the reference in fp32 over [T, K, 576] gathers: bound its memory at prefill size
    want = ref.sparse_mla(q[rows].float(), dequantised, idx[rows], D_KV**-0.5 * 2, D_V)
    assert not got.isnan().any()
    assert _rel(got[rows], want) < 1e-2
    if num_tokens > 1:
        assert (got[1] == 0).all()
    # The same values in a bf16 cache give the same attention (up to bf16 rounding of the products).
    bf16 = sparse_mla.sparse_mla(q, dequantised.bfloat16(), idx, D_KV**-0.5 * 2, D_V)
    assert _rel(got, bf16) < 1e-2


@pytest.mark.parametrize("config", [(64, 64, 8, 2), (64, 32, 8, 3), (64, 64, 8, 1), (32, 64, 4, 2)])
def test_fp8_launch_configs_agree(config):
    """Every launch configuration benchmarks/scripts/bench_mla.py sweeps computes the same attention."""
    g = _gen(21)
    num_slots = 16384
    cache = _fp8_cache(num_slots, seed=21)
    q = (torch.randn(128, 128, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
    idx = torch.randint(0, num_slots, (128, TOPK), device=DEV, generator=g, dtype=torch.int32)
    idx[3, ::5] = -1
    got = sparse_mla.sparse_mla(q, cache, idx, 0.06, D_V, config=config)
    bf16 = sparse_mla.sparse_mla(q, ref.load_mla(cache, torch.arange(num_slots, device=DEV), D_V).bfloat16(), idx,
                                 0.06, D_V)
    assert _rel(got, bf16) < 1e-2


def test_kv_move_moves_fp8_rows_exactly():
    g = _gen(11)
    layers, pages = 61, 64
    mla = torch.randint(0, 256, (layers, pages * PAGE, LAYOUT.bytes_per_token), device=DEV, generator=g,
                        dtype=torch.uint8)
    index = torch.randint(0, 256, (layers, pages, PAGE * (128 + 4)), device=DEV, generator=g, dtype=torch.uint8)
    perm = torch.randperm(pages * PAGE, device=DEV, generator=g)[:513]
    src, dst = perm[:512], perm[1:]  # chained
    want_mla, want_index = mla.clone(), index.clone()
    ref.kv_move(list(want_mla.unbind(0)), list(want_index.unbind(0)), src, dst, PAGE, 128)
    kv_move.kv_move(mla, index, src, dst, PAGE, 128)
    assert torch.equal(mla, want_mla) and torch.equal(index, want_index)


def test_fp8_store_and_attention_compile_and_cuda_graph():
    ops = bind_ops(KernelChoice(store_mla="triton", sparse_mla="triton"))
    num_slots = 16384
    cache = _fp8_cache(num_slots, seed=3)
    g = _gen(4)
    loc = torch.arange(100, 108, device=DEV)
    slots = torch.randint(0, num_slots, (8, TOPK), device=DEV, generator=g, dtype=torch.int32)

    norm_weight = torch.rand(D_V, device=DEV, generator=g).bfloat16() + 0.5
    freqs = torch.arange(8, device=DEV).float()[:, None] * 10000.0 ** (-torch.arange(0, D_R, 2, device=DEV) / D_R)
    cos, sin = freqs.cos(), freqs.sin()

    def step(kv, q):
        ops.store_mla(cache, loc, kv, norm_weight, 1e-6, cos, sin)
        return ops.sparse_mla(q, cache, slots, 0.05, D_V)

    def inputs(seed):
        gg = _gen(seed)
        return (torch.randn(8, D_KV, device=DEV, generator=gg).bfloat16(),
                torch.randn(8, 128, D_KV, device=DEV, generator=gg).bfloat16())

    kv, q = inputs(5)
    eager = step(kv, q)
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(kv, q), eager)
    static = [x.clone() for x in (kv, q)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    kv2, q2 = inputs(6)
    static[0].copy_(kv2)
    static[1].copy_(q2)
    graph.replay()
    torch.testing.assert_close(out, step(kv2, q2))
