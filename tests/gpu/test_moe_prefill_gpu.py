"""The prefill MoE passes around the grouped GEMMs, compiled, at DeepSeek-V3.2's expert shapes (CUDA only).

256 routed experts, top-8 among 4 of 8 groups (the model's Router), hidden 7168, expert intermediate 2048, FP8
weights with 128x128 block scales. Checks against the torch references (kernels/reference.py) at 8192 and 32768
tokens: the per-expert row layout (`moe_layout.expert_rows`, exact), each token quantised into its pairs' rows
(`quant_scatter`, exact bytes and scales), silu * up skipping padding rows, the one-pass combine; then the whole
op (Triton path, and DeepGEMM's grouped GEMMs where built, both the served chunk and one call of 16384) against
`fused_moe_reference`; that the layout has no host sync and replays in a CUDA graph (extend graphs of more than
1024 pairs use it), and that the op compiles with fullgraph=True, dynamic=True at prefill sizes.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from triton.runtime.jit import JITFunction  # noqa: E402

from minidsa.kernels import custom_ops, deepgemm, fp8, moe_layout, reference  # noqa: E402,F401 (custom_ops: torch.ops.minidsa)
from minidsa.kernels import fused_moe as fm  # noqa: E402
# The expert shapes, the router fixture and the helpers of the decode-size tests beside this file.
from test_fused_moe_gpu import DEV, E, H, I, K, captured, inputs, rel_err, router  # noqa: E402,F401 (router: a fixture)

if not isinstance(moe_layout._place_kernel, JITFunction):
    pytest.skip("Triton kernels were imported as interpreted functions in this process", allow_module_level=True)


@pytest.fixture(scope="module")
def fp8_weights():
    """(gate_up, down, gate_up_scale_inv, down_scale_inv), quantised one expert at a time (11 GiB, no bf16 copy)."""
    g = torch.Generator(device=DEV).manual_seed(1)
    out = []
    for rows, cols in ((2 * I, H), (H, I)):
        q = torch.empty(E, rows, cols, dtype=fp8.FP8_DTYPE, device=DEV)
        s = torch.empty(E, *fp8.block_scale_shape(rows, cols), device=DEV)
        for e in range(E):
            q[e], s[e] = fp8.quant_block(torch.randn(rows, cols, device=DEV, generator=g) * cols**-0.5)
        out.append((q, s))
    (gu, gus), (dn, dns) = out
    return gu, dn, gus, dns


def skip_some(ids: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return ids.masked_fill(torch.rand(ids.shape, device=DEV, generator=g) < 0.75, fm.SKIP)


@pytest.mark.parametrize("num_tokens,alignment,skip", [(8192, 128, False), (32768, 128, False), (8192, 64, True),
                                                        (300, 16, False)])
def test_expert_rows_equal_reference(router, num_tokens, alignment, skip):
    _, ids, _ = inputs(router, num_tokens, seed=num_tokens)
    if skip:
        ids = skip_some(ids, num_tokens)
    got = moe_layout.expert_rows(ids, E, alignment)
    row_expert, row_pair, block_expert, row_of_pair, num_rows = reference.expert_rows(ids, E, alignment)
    assert int(got.num_rows) == num_rows
    for name, want in (("row_expert", row_expert), ("row_pair", row_pair), ("block_expert", block_expert),
                       ("row_of_pair", row_of_pair)):
        assert torch.equal(getattr(got, name), want), name
    blocks = fm.align_pairs_to_blocks(ids, E, alignment)  # the Triton fused MoE's layout: the same rows
    assert torch.equal(got.row_pair, blocks.sorted_pair_ids) and torch.equal(got.block_expert, blocks.block_expert)


def test_quant_scatter_and_silu_mul_equal_reference(router, monkeypatch):
    x, ids, _ = inputs(router, 8192, seed=2)
    layout = moe_layout.expert_rows(ids, E, 128)
    rows = int(layout.num_rows)
    q, s = moe_layout.quant_scatter(x, layout.row_of_pair, rows)
    want_q, want_s = reference.quant_scatter(x, layout.row_of_pair, rows)
    named = layout.row_of_pair.long()
    assert s.stride() == (1, rows)  # MN-major, TMA-aligned: DeepGEMM's SM90 layout
    assert torch.equal(q.view(torch.uint8)[named], want_q.view(torch.uint8)[named])
    assert torch.equal(s[named], want_s[named])

    g = torch.Generator(device=DEV).manual_seed(3)
    gate_up = (torch.randn(rows, 2 * I, device=DEV, generator=g) * 2).bfloat16()
    m_indices = layout.row_expert[:rows]
    real = m_indices >= 0
    assert (~real).sum() > rows // 10  # a fifth of the rows are padding at this size
    gate_up[~real] = float("nan")
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    got_q, got_s = fm.silu_mul(gate_up, quantise=True, row_expert=m_indices, mn_major_scales=True)
    monkeypatch.undo()
    assert torch.isnan(got_s[~real]).all()  # padding rows left unwritten
    want_q, want_s = reference.silu_mul(gate_up[real], quantise=True)
    deq = got_q[real].float() * got_s[real].repeat_interleave(128, 1)
    want = want_q.float() * want_s.repeat_interleave(128, 1)
    assert torch.isfinite(deq).all() and rel_err(deq, want) < 1e-3


@pytest.mark.parametrize("skip", [False, True])
def test_combine_rows_equals_reference(router, skip):
    x, ids, weights = inputs(router, 8192, seed=4)
    if skip:
        ids = skip_some(ids, 4)
    layout = moe_layout.expert_rows(ids, E, 128)
    rows = int(layout.num_rows)
    down = torch.randn(rows, H, device=DEV).bfloat16()
    down[layout.row_expert[:rows] < 0] = float("nan")  # padding rows: never read
    row_of_pair = layout.row_of_pair.view(8192, K)
    got = fm.combine_rows(down, row_of_pair, weights)
    want = reference.combine_rows(down, row_of_pair, weights)
    assert torch.isfinite(got).all() and rel_err(got, want) < 5e-3


@pytest.mark.parametrize("num_tokens", [8192, 16384])
@pytest.mark.parametrize("path", ["triton", "deepgemm", "deepgemm one call"])
def test_moe_matches_reference(router, fp8_weights, num_tokens, path):
    x, ids, weights = inputs(router, num_tokens, seed=num_tokens + 1)
    if path == "triton":
        got = fm.fused_moe_triton(x, ids, weights, *fp8_weights)
        tol = 1e-2
    else:
        module, status = deepgemm.probe(DEV, deepgemm.GEMM_API)
        if module is None or deepgemm.grouped_contiguous(module) is None:
            pytest.skip(f"DeepGEMM's contiguous grouped GEMM is not available here ({status.reason})")
        chunk = num_tokens if path == "deepgemm one call" else None
        got = deepgemm.moe_contiguous(module, x, ids, weights, *fp8_weights, max_chunk_tokens=chunk)
        assert got is not None, "DeepGEMM's grouped GEMM declined the call"
        tol = 2e-2  # gate and up come out of the first GEMM in bf16: one more rounding than the reference
    want = fm.fused_moe_reference(x, ids, weights, *fp8_weights)
    err = rel_err(got, want)
    print(f"\n{path} T={num_tokens}: rel err vs reference {err:.2e}")
    assert got.shape == (num_tokens, H) and torch.isfinite(got).all() and err < tol


def test_deepgemm_skipped_pairs(router, fp8_weights):
    """Expert parallelism: pairs of another rank's experts (SKIP) get no row and add nothing."""
    module, status = deepgemm.probe(DEV, deepgemm.GEMM_API)
    if module is None or deepgemm.grouped_contiguous(module) is None:
        pytest.skip(f"DeepGEMM's contiguous grouped GEMM is not available here ({status.reason})")
    x, ids, weights = inputs(router, 8192, seed=9)
    skipped = skip_some(ids, 9)
    got = deepgemm.moe_contiguous(module, x, skipped, weights, *fp8_weights)
    want = fm.fused_moe_reference(x, skipped, weights, *fp8_weights)
    assert torch.isfinite(got).all() and rel_err(got, want) < 2e-2


def test_layout_no_sync_graph_and_compile(router, fp8_weights):
    """The chunked layout serves the Triton fused MoE above 1024 pairs (extend graphs of 129+ tokens): no host
    sync, it replays in a CUDA graph with new routing, and the op compiles fullgraph at prefill sizes."""
    x, ids, weights = inputs(router, 256, seed=5)  # 2048 pairs: the chunked layout
    assert ids.numel() > fm.ALIGN_KERNEL_MAX_PAIRS
    op = torch.ops.minidsa.fused_moe
    expect = op(x, ids, weights, *fp8_weights)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_layout.expert_rows(ids, E, 64)
        fm.fused_moe_triton(x, ids, weights, *fp8_weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, out = captured(lambda: op(x, ids, weights, *fp8_weights))
    graph.replay()
    assert torch.equal(out, expect)
    nx, nids, nw = inputs(router, 256, seed=6)
    x.copy_(nx), ids.copy_(nids), weights.copy_(nw)
    graph.replay()
    assert torch.equal(out, op(nx, nids, nw, *fp8_weights))

    compiled = torch.compile(lambda a, i, w, dg: op(a, i, w, *fp8_weights, dg) * 2, fullgraph=True, dynamic=True)
    module, _ = deepgemm.probe(DEV, deepgemm.GEMM_API)
    use_dg = module is not None and deepgemm.grouped_contiguous(module) is not None
    for n in (300, 4096, 8192):  # 4096 and 8192: DeepGEMM's path where built (128+ pairs per expert)
        a, i, w = inputs(router, n, seed=n)
        got, want = compiled(a, i, w, use_dg), op(a, i, w, *fp8_weights, use_dg) * 2
        assert torch.isfinite(got).all() and rel_err(got, want) < 1e-6
