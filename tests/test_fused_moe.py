"""The fused MoE (minidsa.kernels.fused_moe) against a per-token reference, on CPU.

Routing is the model's Router on random inputs with the real models' shape: 256 experts, top-8 among
4 of 8 groups. The per-token reference below runs, for each token, only its own chosen experts.
Both implementations are checked: the torch reference (the CPU path of the custom op) for 1 to 1000
tokens, and the Triton kernels through Triton's interpreter (tiny widths, explicit tiles so the
interpreter runs few programs; outputs poisoned with NaN so a row the kernels forget shows).

Tolerances (relative Frobenius error against the per-token reference):
- fp32: 1e-5 (only the summation order differs).
- bf16 / fp16: 1e-2 (the intermediate and each pair's output are rounded to the model dtype).
- FP8 w8a8: the reference quantises activations exactly as fp8.quant_act_per_token_group (the same
  quantisation, done in torch), so with fp32 activations it agrees to 1e-4 (a summation-order
  difference can still move an intermediate value across an e4m3 rounding edge) and with bf16 to 1e-2;
  the result must also differ from the same weights without activation quantisation by far more
  than that (proof that the activations are quantised).
The interpreter's own float casts mis-round at binade carries; `torch_rounded_casts` makes them round
as the GPU (and torch) do.

The addend (the shared experts' output, added in the launch that sums each token's routed rows) is checked on every
path by what one rounding of the fp32 sum implies: in fp32 the output is the routed output plus the addend, bit for
bit; in bf16, with the addend the negated rounded routed output, what is left is the rounding residual of the fp32
sum (nonzero, under half a bf16 ulp), where two roundings would leave exactly zero.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_fused_moe_gpu.py checks the compiled kernels", allow_module_level=True)

from triton_interp import import_kernels_interpreted, run_file_interpreted, torch_rounded_casts  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import fp8, moe_layout, reference  # noqa: E402
from minidsa.kernels import fused_moe as fm  # noqa: E402
from minidsa.models.deepseek_v32 import Router  # noqa: E402

E, TOP_K, N_GROUP, TOPK_GROUP = 256, 8, 8, 4


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_fused_moe_kernels_in_child_process():
    run_file_interpreted(__file__, timeout=900)


def route(num_tokens: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] fp32 and the model Router's (ids, weights) for it (random gate and correction bias)."""
    g = torch.Generator().manual_seed(seed)
    router = Router(SimpleNamespace(num_experts_per_tok=TOP_K, n_routed_experts=E, n_group=N_GROUP,
                                    topk_group=TOPK_GROUP, norm_topk_prob=True, routed_scaling_factor=2.5,
                                    hidden_size=hidden))
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, hidden, generator=g) * hidden**-0.5)
        router.e_score_correction_bias.copy_(torch.rand(E, generator=g) * 0.1)
        x = torch.randn(num_tokens, hidden, generator=g)
        ids, weights = router(x)
    return x, ids, weights


def make_weights(hidden: int, inter: int, seed: int, dtype: torch.dtype):
    """(gate_up [E, 2I, H], down [E, H, I], gate_up_scale_inv, down_scale_inv); FP8 when dtype is e4m3."""
    return tuple(None if t is None else t.clone() for t in _make_weights(hidden, inter, seed, dtype))


@functools.lru_cache(maxsize=None)
def _make_weights(hidden: int, inter: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(E, hidden, inter, generator=g) * inter**-0.5
    if dtype != fp8.FP8_DTYPE:
        return gate_up.to(dtype), down.to(dtype), None, None
    (gu, gu_s), (dn, dn_s) = fp8.quant_block(gate_up), fp8.quant_block(down)
    # blocks of different magnitudes, so a scale read from the wrong block shows
    gu_s = gu_s * torch.rand(gu_s.shape, generator=g).add(0.5)
    dn_s = dn_s * torch.rand(dn_s.shape, generator=g).add(0.5)
    return gu, dn, gu_s, dn_s


def per_token_reference(x, ids, weights, gate_up, down, gate_up_s=None, down_s=None, quant_act=True):
    """For each token alone: sum over its chosen experts e of w * down_e(silu(gate_e x) * up_e x), fp32.

    The intermediate is rounded to x's dtype (the model's activation dtype); FP8 weights are dequantised
    and (quant_act) activations quantised per token per 128 channels, as fp8.quant_act_per_token_group.
    """
    if gate_up_s is not None:
        gate_up, down = fp8.dequant_block(gate_up, gate_up_s), fp8.dequant_block(down, down_s)

    def act(a):
        if gate_up_s is None or not quant_act:
            return a.float()
        q, s = fp8.quant_act_per_token_group(a)
        return q.float() * s.repeat_interleave(fp8.FP8_BLOCK, 1)[:, :a.shape[1]]

    inter = down.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        chosen = ids[t]  # this token's k experts, one row each below
        gu = torch.einsum("h,kih->ki", act(x[t:t + 1])[0], gate_up[chosen].float())
        h = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(x.dtype)
        y = torch.einsum("ki,khi->kh", act(h), down[chosen].float())
        out[t] = (y * weights[t, :, None].float()).sum(0)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
FP8_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def tolerance(act_dtype: torch.dtype, weight_dtype: torch.dtype) -> float:
    return FP8_TOL[act_dtype] if weight_dtype == fp8.FP8_DTYPE else TOL[act_dtype]


@pytest.mark.parametrize("num_tokens", [1, 7, 130, 600, 1000])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, fp8.FP8_DTYPE], ids=["fp32", "bf16", "fp8"])
def test_reference_matches_per_token(num_tokens, weight_dtype):
    hidden, inter = (256, 128) if weight_dtype == fp8.FP8_DTYPE else (128, 64)
    act_dtype = torch.float32 if weight_dtype == fp8.FP8_DTYPE else weight_dtype
    x, ids, weights = route(num_tokens, hidden, seed=num_tokens)
    x = x.to(act_dtype)
    params = make_weights(hidden, inter, seed=1, dtype=weight_dtype)
    got = fm.fused_moe_reference(x, ids, weights, *params)
    assert got.shape == x.shape and got.dtype == act_dtype
    assert rel_err(got, per_token_reference(x, ids, weights, *params)) < tolerance(act_dtype, weight_dtype)
    # the custom op's CPU implementation is this reference
    assert torch.equal(torch.ops.minidsa.fused_moe(x, ids, weights, *params), got)


# tokens, activation dtype, weight dtype, hidden, intermediate,
# tiles (block_m, block_n, block_k, group_m, warps, stages)
TRITON_CASES = [
    (1, torch.float32, torch.float32, 128, 64, fm.TileConfig(16, 64, 128, 1, 4, 2)),
    (4, torch.float32, torch.float32, 96, 48, fm.TileConfig(16, 32, 64, 4, 4, 2)),  # K and N tails
    (12, torch.float16, torch.float16, 128, 64, fm.TileConfig(32, 64, 128, 8, 4, 2)),
    (9, torch.bfloat16, torch.bfloat16, 128, 64, fm.TileConfig(16, 64, 128, 2, 4, 2)),
    (600, torch.float32, torch.float32, 64, 32, fm.TileConfig(32, 64, 64, 8, 4, 2)),  # busiest experts: 2 blocks
    (3, torch.float32, fp8.FP8_DTYPE, 256, 128, fm.TileConfig(16, 128, 128, 1, 4, 2)),  # 2 K groups, 2 scale rows
    (6, torch.bfloat16, fp8.FP8_DTYPE, 256, 128, fm.TileConfig(16, 128, 128, 4, 4, 2)),
    (2, torch.float32, fp8.FP8_DTYPE, 200, 72, fm.TileConfig(16, 64, 128, 1, 4, 2)),  # partial K groups
    # gate/up as one GEMM over 2I rows, silu * up (and the FP8 quantisation) in a pass of its own
    (4, torch.float32, torch.float32, 96, 48, fm.TileConfig(16, 32, 64, 4, 4, 2, split_gate_up=True)),
    (6, torch.bfloat16, fp8.FP8_DTYPE, 256, 128, fm.TileConfig(16, 128, 128, 4, 4, 2, split_gate_up=True)),
    (2, torch.float32, fp8.FP8_DTYPE, 200, 72, fm.TileConfig(16, 64, 128, 1, 4, 2, split_gate_up=True)),
    # gate/up split along K (fp32 partials summed by the pass that quantises the down GEMM's input): even ranges,
    # an uneven last range with a partial K group, and bf16 activations (the product rounded to bf16 first)
    (3, torch.float32, fp8.FP8_DTYPE, 512, 128, fm.TileConfig(16, 128, 128, 1, 4, 2, gate_up_split_k=2)),
    (2, torch.float32, fp8.FP8_DTYPE, 456, 72, fm.TileConfig(16, 64, 128, 1, 4, 2, gate_up_split_k=3)),
    (5, torch.bfloat16, fp8.FP8_DTYPE, 384, 128, fm.TileConfig(16, 64, 128, 4, 4, 2, gate_up_split_k=3)),
    (4, torch.float32, torch.float32, 96, 48, fm.TileConfig(16, 32, 32, 4, 4, 2, gate_up_split_k=2)),
]

_real_empty = torch.empty


@pytest.fixture
def poisoned_outputs(monkeypatch):
    def empty(*a, **k):  # NaN in float buffers, a large bogus value in integer ones
        t = _real_empty(*a, **k)
        return t.fill_(float("nan") if t.is_floating_point() else 123456789)

    monkeypatch.setattr(torch, "empty", empty)


@in_this_process
@pytest.mark.parametrize("case", range(len(TRITON_CASES)),
                         ids=[f"T{c[0]}-{str(c[2]).split('.')[-1]}-{str(c[1]).split('.')[-1]}"
                              + ("-split" if c[5].split_gate_up else "")
                              + (f"-splitk{c[5].gate_up_split_k}" if c[5].gate_up_split_k else "")
                              for c in TRITON_CASES])
def test_triton_matches_per_token(case, poisoned_outputs):
    num_tokens, act_dtype, weight_dtype, hidden, inter, tiles = TRITON_CASES[case]
    x, ids, weights = route(num_tokens, hidden, seed=100 + case)
    x = x.to(act_dtype)
    if num_tokens * TOP_K > 2 * E:  # the many-token case must fill several M-blocks of one expert
        assert torch.bincount(ids.flatten(), minlength=E).max() > tiles.block_m
    gate_up, down, gate_up_s, down_s = make_weights(hidden, inter, seed=case, dtype=weight_dtype)
    # experts nobody chose: NaN weights, so reading them would show
    unchosen = torch.ones(E, dtype=torch.bool)
    unchosen[ids.unique()] = False
    if weight_dtype == fp8.FP8_DTYPE:
        gate_up_s, down_s = gate_up_s.clone(), down_s.clone()
        gate_up_s[unchosen], down_s[unchosen] = float("nan"), float("nan")
    else:
        gate_up[unchosen], down[unchosen] = float("nan"), float("nan")
    with torch_rounded_casts():
        got = fm.fused_moe_triton(x, ids.int(), weights, gate_up, down, gate_up_s, down_s, config=tiles)
    assert got.shape == x.shape and got.dtype == act_dtype
    want = per_token_reference(x, ids, weights, gate_up, down, gate_up_s, down_s)
    tol = tolerance(act_dtype, weight_dtype)
    if tiles.split_gate_up and weight_dtype == fp8.FP8_DTYPE and act_dtype != torch.float32:
        # gate and up are stored in the activation dtype before silu * up (one more rounding than the
        # reference), and e4m3 quantisation of the product turns ~0.3% there into ~1.3% rms here
        tol *= 2
    assert rel_err(got, want) < tol
    if weight_dtype == fp8.FP8_DTYPE:
        no_act_quant = per_token_reference(x, ids, weights, gate_up, down, gate_up_s, down_s, quant_act=False)
        assert rel_err(got, no_act_quant) > 3 * tolerance(act_dtype, weight_dtype)


@in_this_process
def test_triton_chunks_and_chosen_tiles_agree(poisoned_outputs):
    """Tokens in chunks (bounded buffers) and the tiles tile_config picks give the same result."""
    x, ids, weights = route(6, 64, seed=5)
    params = make_weights(64, 32, seed=5, dtype=torch.float32)
    whole = fm.fused_moe_triton(x, ids, weights, *params, config=fm.TileConfig(16, 64, 64, 2, 4, 2))
    chunked = fm.fused_moe_triton(x, ids, weights, *params, config=fm.TileConfig(16, 64, 64, 2, 4, 2),
                                  max_chunk_tokens=4)
    assert torch.allclose(whole, chunked, rtol=1e-6, atol=1e-6)
    x, ids, weights = route(1, 128, seed=6)
    x, params = x.bfloat16(), make_weights(128, 64, seed=6, dtype=torch.bfloat16)
    with torch_rounded_casts():
        default_tiles = fm.fused_moe_triton(x, ids, weights, *params)
    assert rel_err(default_tiles, per_token_reference(x, ids, weights, *params)) < 1e-2


def test_gate_up_splits_along_k_only_where_the_programs_leave_sms_idle():
    """V3.2's gate/up at decode on an H200 (132 SMs, K = 7168: 56 steps): one GPU at batch 1 (8 experts x 32 N-blocks)
    is not split; under --tp 4 (I = 512: 8 N-blocks) it is, to about two programs per SM; a short K keeps 4 steps a
    range; bf16 weights are never split."""
    assert fm.gate_up_splits(8 * 32, 56, 132, True) == 1
    assert fm.gate_up_splits(8 * 8, 56, 132, True) == 5
    assert fm.gate_up_splits(16 * 8, 56, 132, True) == 3
    assert fm.gate_up_splits(2, 12, 132, True) == 3
    assert fm.gate_up_splits(8 * 8, 56, 132, False) == 1


@in_this_process
def test_triton_splits_gate_up_by_itself_where_few_programs_run(poisoned_outputs, monkeypatch):
    """On 16 SMs (a stand-in), one token's 8 experts in one N-block each are 8 programs of a 1024-deep K: split in
    two; the result is the unsplit one's up to fp32 summation order."""
    monkeypatch.setattr(fm, "num_sms", lambda device: 16)
    x, ids, weights = route(1, 1024, seed=41)
    params = make_weights(1024, 128, seed=41, dtype=fp8.FP8_DTYPE)
    assert fm.gate_up_splits(8, 8, 16, True) == 2
    with torch_rounded_casts():
        auto = fm.fused_moe_triton(x, ids.int(), weights, *params, config=fm.TileConfig(16, 128, 128, 1, 4, 2))
        whole = fm.fused_moe_triton(x, ids.int(), weights, *params,
                                    config=fm.TileConfig(16, 128, 128, 1, 4, 2, gate_up_split_k=1))
    assert rel_err(auto, whole) < 1e-5
    assert rel_err(auto, per_token_reference(x, ids, weights, *params)) < tolerance(torch.float32, fp8.FP8_DTYPE)


def one_rounding_residual(routed: torch.Tensor, fused) -> torch.Tensor:
    """`fused(addend)`'s output with the addend -routed (routed: the same op's output without an addend, bf16): the
    residual of rounding the routed fp32 sum, checked to be what one rounding leaves (two would leave 0)."""
    residual = fused(-routed)
    half_ulp = torch.finfo(torch.bfloat16).eps / 2 * routed.float().abs()
    assert (residual.float().abs() <= half_ulp).all()
    assert (residual != 0).float().mean() > 0.5  # most fp32 sums are not bf16 values
    return residual


def test_reference_adds_the_addend_before_its_one_rounding():
    """The reference (the op's CPU implementation) adds the addend to the routed rows' fp32 sum: in fp32 the
    routed output plus the addend, bit for bit; in bf16 one rounding of the sum."""
    x, ids, weights = route(7, 128, seed=31)
    params = make_weights(128, 64, seed=3, dtype=torch.float32)
    addend = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    got = torch.ops.minidsa.fused_moe(x, ids, weights, *params, addend=addend)
    assert torch.equal(got, fm.fused_moe_reference(x, ids, weights, *params) + addend)
    assert torch.equal(fm.fused_moe_reference(x, ids, weights, *params, addend=addend), got)
    x, params = x.bfloat16(), make_weights(128, 64, seed=3, dtype=torch.bfloat16)
    routed = fm.fused_moe_reference(x, ids, weights, *params)
    one_rounding_residual(routed, lambda a: torch.ops.minidsa.fused_moe(x, ids, weights, *params, addend=a))
    with pytest.raises(ValueError, match="addend"):
        fm.fused_moe_reference(x, ids, weights, *params, addend=addend)  # fp32 addend, bf16 x


@in_this_process
def test_triton_adds_the_addend_in_the_combine(poisoned_outputs):
    """The Triton path adds the addend in the launch that sums the routed rows: in fp32 the output without it plus
    the addend, bit for bit, also in chunks of tokens (each chunk its own rows of the addend) and with skipped
    pairs; in bf16 one rounding of the sum."""
    tiles = fm.TileConfig(16, 64, 64, 2, 4, 2)
    x, ids, weights = route(6, 64, seed=5)
    params = make_weights(64, 32, seed=5, dtype=torch.float32)
    addend = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    for chunk in (fm.MAX_CHUNK_TOKENS, 4):
        routed = fm.fused_moe_triton(x, ids, weights, *params, config=tiles, max_chunk_tokens=chunk)
        got = fm.fused_moe_triton(x, ids, weights, *params, config=tiles, max_chunk_tokens=chunk, addend=addend)
        assert torch.equal(got, routed + addend)
    skipped = _skip_some(ids, 6)
    routed = fm.fused_moe_triton(x, skipped, weights, *params, config=tiles, has_skipped=True)
    got = fm.fused_moe_triton(x, skipped, weights, *params, config=tiles, has_skipped=True, addend=addend)
    assert torch.equal(got, routed + addend)
    everything_skipped = torch.full_like(ids, fm.SKIP)  # another rank computes all: the addend alone
    got = fm.fused_moe_triton(x, everything_skipped, weights, *params, config=tiles, has_skipped=True, addend=addend)
    assert torch.equal(got, addend)
    x, params = x.bfloat16(), make_weights(64, 32, seed=5, dtype=torch.bfloat16)
    with torch_rounded_casts():
        routed = fm.fused_moe_triton(x, ids, weights, *params, config=tiles)
        one_rounding_residual(routed, lambda a: fm.fused_moe_triton(x, ids, weights, *params, config=tiles, addend=a))


def grouped_gemm_stand_in(alignment: int, calls: list):
    """DeepGEMM's m_grouped_fp8_gemm_nt_contiguous contract in torch: row r of a (e4m3, one fp32 scale per 128
    columns) times expert m_indices[r]'s block-scaled weight, each expert's rows one segment starting at a multiple
    of `alignment`, padding rows (-1) only after an expert's rows in its last block. The outputs of padding rows
    are NaN here (DeepGEMM leaves them zero or unmultiplied), so a caller that reads one shows. It also checks
    that activation scales come MN-major and TMA-aligned (DeepGEMM's SM90 layout: no transpose per call)."""
    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices):
        (a8, a_s), (w8, w_s) = a, b
        rows = a8.shape[0]
        assert a8.dtype == w8.dtype == fp8.FP8_DTYPE and d.dtype == torch.bfloat16 and rows % alignment == 0
        assert m_indices.shape == (rows,) and m_indices.dtype == torch.int32 and m_indices.is_contiguous()
        assert a_s.shape == (rows, a8.shape[1] // 128) and a_s.stride() == (1, -(-rows // 4) * 4), a_s.stride()
        seg = m_indices.view(-1, alignment)
        assert (seg[:, 0] >= 0).all(), "a block starts with padding"
        real = seg >= 0
        assert (real[:, 1:] <= real[:, :-1]).all(), "a real row after padding within a block"
        assert (torch.where(real, seg, seg[:, :1]) == seg[:, :1]).all(), "an aligned block mixes experts"
        first = seg[:, 0]
        assert first.unique_consecutive().numel() == first.unique().numel(), "an expert's rows are not one segment"
        calls.append(rows)
        acts = a8.float() * a_s.repeat_interleave(fp8.FP8_BLOCK, 1)[:, :a8.shape[1]]
        d.fill_(float("nan"))
        for e in m_indices[m_indices >= 0].unique().tolist():
            r = m_indices == e
            d[r] = (acts[r] @ fp8.dequant_block(w8[e], w_s[e]).T).to(d.dtype)

    return SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=m_grouped_fp8_gemm_nt_contiguous,
                           get_mk_alignment_for_contiguous_layout=lambda: alignment, __name__="stand-in")


@in_this_process
@pytest.mark.parametrize("num_tokens,skip", [(3, False), (70, False), (40, True)])
def test_deepgemm_grouped_moe_matches_per_token(num_tokens, skip, monkeypatch, poisoned_outputs):
    """The DeepGEMM grouped-GEMM MoE (sort and pad per expert, gather, two GEMMs, silu * up, weighted combine)
    through a stand-in that checks the contiguous layout, against the per-token reference; padding rows are
    computed but never summed (outputs start as NaN). With an addend: one rounding of the fp32 sum, in chunks of
    tokens too."""
    from minidsa.kernels import deepgemm

    calls: list[int] = []
    stand_in = grouped_gemm_stand_in(8, calls)  # handed in as the library module, as the op hands in deep_gemm
    x, ids, weights = route(num_tokens, 256, seed=7 + num_tokens)
    x = x.bfloat16()
    params = make_weights(256, 128, seed=7, dtype=fp8.FP8_DTYPE)
    if skip:  # expert parallelism: another rank's pairs get no rows and add nothing
        ids = _skip_some(ids, num_tokens)
        kept = ids >= 0
        ref_ids, ref_weights = torch.where(kept, ids, 0), torch.where(kept, weights, 0.0)
    else:
        ref_ids, ref_weights = ids, weights
    with torch_rounded_casts():
        got = deepgemm.moe_contiguous(stand_in, x, ids, weights, *params)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == x.shape
    counts = torch.bincount(ids.flatten()[ids.flatten() >= 0], minlength=E)
    assert calls == [int(((counts + 7) // 8 * 8).sum())] * 2  # both GEMMs, rows padded per expert exactly
    assert torch.isfinite(got).all()  # no padding row (NaN out of the stand-in) was summed
    # gate and up come out of the first GEMM in bf16 (as with split_gate_up tiles): twice the bf16 tolerance
    assert rel_err(got, per_token_reference(x, ref_ids, ref_weights, *params)) < 2 * FP8_TOL[torch.bfloat16]
    with torch_rounded_casts():
        one_rounding_residual(got, lambda a: deepgemm.moe_contiguous(stand_in, x, ids, weights, *params, addend=a))
        # in chunks of 16 tokens (the grouped GEMMs' rows differ per chunk: the stand-in's matmul may round them
        # differently, so within the tolerance above, not bit for bit), each chunk its addend's rows
        addend = torch.randn(x.shape, generator=torch.Generator().manual_seed(num_tokens)).bfloat16()
        chunked = deepgemm.moe_contiguous(stand_in, x, ids, weights, *params, max_chunk_tokens=16, addend=addend)
    want = per_token_reference(x, ref_ids, ref_weights, *params) + addend.float()
    assert rel_err(chunked, want) < 2 * FP8_TOL[torch.bfloat16]
    if skip:  # a token every pair of which is another rank's: the addend alone
        alone = deepgemm.moe_contiguous(stand_in, x, torch.full_like(ids, fm.SKIP), weights, *params, addend=addend)
        assert torch.equal(alone, addend)
    # at decode sizes (and where the build has no grouped GEMM) the Triton fused MoE serves
    assert deepgemm.moe_contiguous_wins(E * deepgemm.MOE_CONTIGUOUS_MIN_PAIRS_PER_EXPERT // TOP_K, TOP_K, E)
    assert not deepgemm.moe_contiguous_wins(num_tokens, TOP_K, E)
    assert deepgemm.moe_contiguous(SimpleNamespace(), x, ids, weights, *params) is None


def _skip_some(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Expert parallelism's view on one rank: about 3 of 4 choices belong to other ranks (SKIP)."""
    g = torch.Generator().manual_seed(seed)
    return ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.75, fm.SKIP)


@pytest.mark.parametrize("num_tokens", [5, 300])
def test_skipped_pairs_add_nothing_reference(num_tokens):
    x, ids, weights = route(num_tokens, 128, seed=40 + num_tokens)
    params = make_weights(128, 64, seed=4, dtype=torch.float32)
    skipped = _skip_some(ids, num_tokens)
    kept = skipped >= 0
    # the reference over the kept pairs only: their weights, the others' set to 0 on a real expert
    want = per_token_reference(x, torch.where(kept, ids, 0), torch.where(kept, weights, 0.0), *params)
    got = fm.fused_moe_reference(x, skipped, weights, *params)
    assert rel_err(got, want) < TOL[torch.float32]
    blocks = fm.align_pairs_to_blocks(skipped, E, 16)
    placed = blocks.sorted_pair_ids[blocks.sorted_pair_ids < skipped.numel()]
    assert sorted(placed.tolist()) == torch.nonzero(kept.flatten()).flatten().tolist()  # each kept pair once


@in_this_process
@pytest.mark.parametrize("num_tokens", [3, 150])  # the one-program align kernel; the torch align (> 1024 pairs)
def test_skipped_pairs_add_nothing_triton(num_tokens, poisoned_outputs):
    x, ids, weights = route(num_tokens, 256, seed=60 + num_tokens)
    params = make_weights(256, 128, seed=6, dtype=fp8.FP8_DTYPE)
    skipped = _skip_some(ids, num_tokens)
    with torch_rounded_casts():
        got = fm.fused_moe_triton(x, skipped.int(), weights, *params, config=fm.TileConfig(16, 128, 128, 1, 4, 2),
                                  has_skipped=True)
    assert torch.isfinite(got).all()
    assert rel_err(got, fm.fused_moe_reference(x, skipped, weights, *params)) < FP8_TOL[torch.float32]
    if num_tokens * TOP_K <= fm.ALIGN_KERNEL_MAX_PAIRS:
        a = fm.align_pairs_to_blocks_triton(skipped, E, 16)
        b = fm.align_pairs_to_blocks(skipped, E, 16)
        assert torch.equal(a.sorted_pair_ids, b.sorted_pair_ids) and torch.equal(a.block_expert, b.block_expert)
        assert torch.equal(a.num_padded, b.num_padded)


@in_this_process
def test_combine_rows_equals_reference():
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 1100, generator=g).bfloat16()  # H past one 1024-wide block
    rows[35:] = float("nan")  # rows no pair names: never read
    row_of_pair = torch.randperm(35, generator=g)[:30].view(10, 3).int()
    row_of_pair[2, 1] = row_of_pair[7, 0] = -1  # pairs with no row (another rank's expert) add nothing
    weights = torch.rand(10, 3, generator=g)
    got = fm.combine_rows(rows, row_of_pair, weights)
    want = reference.combine_rows(rows, row_of_pair, weights)
    assert torch.isfinite(want).all()
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    dropped = reference.combine_rows(rows, row_of_pair.clamp(min=0), weights)  # the -1 pairs read as row 0
    assert not torch.allclose(got.float()[[2, 7]], dropped.float()[[2, 7]], rtol=1e-2, atol=1e-2)
    # the Triton path's k-sum: rows t * k + j, weights already applied
    contiguous = rows[:30]
    with torch_rounded_casts():  # the interpreter's own fp32 -> bf16 cast is not round-to-nearest-even
        got = fm.combine_rows(contiguous, None, None, 3)
    assert torch.equal(got, contiguous.float().view(10, 3, -1).sum(1).bfloat16())
    assert torch.equal(reference.combine_rows(contiguous, None, None, 3), got)
    # an addend joins the fp32 sum after the k rows, before the one rounding: the reference's bytes
    addend = torch.randn(10, 1100, generator=g).bfloat16()
    with torch_rounded_casts():
        got = fm.combine_rows(contiguous, None, None, 3, addend)
        gathered = fm.combine_rows(rows, row_of_pair, weights, addend=addend)
    assert torch.equal(got, (contiguous.float().view(10, 3, -1).sum(1) + addend.float()).bfloat16())
    assert torch.equal(reference.combine_rows(contiguous, None, None, 3, addend), got)
    want = reference.combine_rows(rows, row_of_pair, weights, addend=addend)
    assert torch.isfinite(want).all() and torch.equal(gathered, want)
    with pytest.raises(ValueError, match="addend"):
        fm.combine_rows(contiguous, None, None, 3, addend[:9])
    with pytest.raises(ValueError, match="addend"):
        fm.combine_rows(contiguous, None, None, 3, addend.float())


@in_this_process
@pytest.mark.parametrize("num_tokens,alignment,skip", [(3, 16, False), (40, 16, True), (300, 128, False),
                                                        (600, 16, True)])
def test_expert_rows_equal_reference(num_tokens, alignment, skip):
    """The chunked layout kernels (several chunks of 128 pairs from 40 tokens on) against the torch reference,
    element for element, and against align_pairs_to_blocks (the Triton fused MoE's layout) where they overlap."""
    _, ids, _ = route(num_tokens, 32, seed=11 + num_tokens)
    if skip:
        ids = _skip_some(ids, num_tokens)
    got = moe_layout.expert_rows(ids, E, alignment)
    row_expert, row_pair, block_expert, row_of_pair, num_rows = reference.expert_rows(ids, E, alignment)
    assert int(got.num_rows) == num_rows
    assert torch.equal(got.row_expert, row_expert) and torch.equal(got.row_pair, row_pair)
    assert torch.equal(got.block_expert, block_expert) and torch.equal(got.row_of_pair, row_of_pair)
    blocks = fm.align_pairs_to_blocks(ids, E, alignment)
    assert torch.equal(got.row_pair, blocks.sorted_pair_ids) and torch.equal(got.block_expert, blocks.block_expert)
    assert torch.equal(got.num_rows, blocks.num_padded)
    # each kept pair has one row, holding its expert; rows past the used ones are padding
    kept = ids.flatten() >= 0
    assert ((got.row_of_pair >= 0) == kept).all()
    assert torch.equal(got.row_expert[got.row_of_pair[kept].long()], ids.flatten()[kept].int())
    assert (got.row_expert[num_rows:] == -1).all()


@in_this_process
def test_quant_scatter_equals_reference(poisoned_outputs):
    """Each token quantised once into the rows of its pairs: the bytes and scales of fp8.quant_act_per_token_group
    at every row a pair names, MN-major scales; the rows no pair names are left as they were (NaN here)."""
    num_tokens, hidden = 37, 384
    x, ids, _ = route(num_tokens, hidden, seed=21)
    x = (x * torch.linspace(0.01, 30.0, hidden)).bfloat16()  # groups of very different magnitudes
    ids = _skip_some(ids, 5)
    layout = moe_layout.expert_rows(ids, E, 16)
    rows = int(layout.num_rows)
    with torch_rounded_casts():
        q, s = moe_layout.quant_scatter(x, layout.row_of_pair, rows)
    assert q.shape == (rows, hidden) and s.shape == (rows, hidden // 128) and s.stride() == (1, rows)
    want_q, want_s = reference.quant_scatter(x, layout.row_of_pair, rows)
    named = layout.row_of_pair[layout.row_of_pair >= 0].long()
    assert torch.equal(q.view(torch.uint8)[named], want_q.view(torch.uint8)[named])
    assert torch.equal(s[named], want_s[named])
    unnamed = torch.ones(rows, dtype=torch.bool)
    unnamed[named] = False
    assert unnamed.any() and torch.isnan(s[unnamed]).all() and torch.isnan(q[unnamed].float()).all()
    row_major = moe_layout.quant_scatter(x, layout.row_of_pair, rows, mn_major=False)[1]
    assert row_major.is_contiguous() and torch.equal(row_major[named], s[named])


@in_this_process
@pytest.mark.parametrize("skip_padding", [False, True])
def test_silu_mul_quantised_skips_padding(skip_padding, poisoned_outputs):
    """silu(gate) * up quantised (the down GEMM's input) against the reference; with row_expert, padding rows
    (-1) are neither read (NaN inputs there) nor written (outputs stay NaN)."""
    g = torch.Generator().manual_seed(4)
    rows, inter = 48, 256
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).bfloat16()
    row_expert = torch.randint(0, E, (rows,), generator=g, dtype=torch.int32)
    row_expert[[5, 6, 7, 30, 47]] = -1
    if skip_padding:
        gate_up[row_expert < 0] = float("nan")
    with torch_rounded_casts():
        q, s = fm.silu_mul(gate_up, quantise=True, row_expert=row_expert if skip_padding else None,
                           mn_major_scales=skip_padding)
    want_q, want_s = reference.silu_mul(gate_up, quantise=True)
    real = row_expert >= 0 if skip_padding else torch.ones(rows, dtype=torch.bool)
    assert s.stride() == ((1, rows) if skip_padding else (inter // 128, 1))
    deq = q.float()[real] * s[real].repeat_interleave(128, 1)
    want = want_q.float()[real] * want_s[real].repeat_interleave(128, 1)
    # the kernel's sigmoid and torch's differ in the last bits, which can move a value across a rounding edge
    assert rel_err(deq, want) < 1e-3 and torch.allclose(s[real], want_s[real], rtol=1e-2)
    if skip_padding:
        assert torch.isnan(s[~real]).all() and torch.isnan(q[~real].float()).all()


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_pairs_to_blocks(block_m):
    _, ids, _ = route(50, 32, seed=3)
    blocks = fm.align_pairs_to_blocks(ids.int(), E, block_m)
    num_pairs = ids.numel()
    assert blocks.sorted_pair_ids.numel() == fm.max_padded_rows(num_pairs, E, block_m)  # static, routing-free
    used = int(blocks.num_padded)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    rows = blocks.sorted_pair_ids[:used].long()
    real = rows < num_pairs
    assert sorted(rows[real].tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (blocks.sorted_pair_ids[used:] == num_pairs).all()  # the rest is the sentinel
    row_expert = blocks.block_expert[:used // block_m].long().repeat_interleave(block_m)
    assert torch.equal(row_expert[real], ids.flatten()[rows[real]])  # a block holds one expert's pairs
    assert (blocks.block_expert[used // block_m:] == -1).all()
    assert (counts[blocks.block_expert[:used // block_m].long()] > 0).all()  # no block for an unchosen expert


@in_this_process
@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (33, 16), (100, 64), (128, 128)])
def test_align_kernel_equals_torch(num_tokens, block_m):
    """The one-program Triton alignment (decode sizes) gives the torch version's output element for element."""
    _, ids, _ = route(num_tokens, 32, seed=num_tokens)
    assert ids.numel() <= fm.ALIGN_KERNEL_MAX_PAIRS
    want = fm.align_pairs_to_blocks(ids, E, block_m)
    for topk_ids in (ids, ids.int()):
        got = fm.align_pairs_to_blocks_triton(topk_ids, E, block_m)
        assert torch.equal(got.sorted_pair_ids, want.sorted_pair_ids)
        assert torch.equal(got.block_expert, want.block_expert)
        assert torch.equal(got.num_padded, want.num_padded)


def test_custom_op_fake_and_bad_input():
    x, ids, weights = route(3, 64, seed=4)
    gu, dn, gu_s, dn_s = make_weights(64, 32, seed=4, dtype=fp8.FP8_DTYPE)
    with torch._subclasses.FakeTensorMode():
        fake = torch.ops.minidsa.fused_moe(torch.empty(3, 64, dtype=torch.bfloat16),
                                           torch.empty(3, 8, dtype=torch.long),
                                           torch.empty(3, 8), torch.empty(E, 64, 64, dtype=fp8.FP8_DTYPE),
                                           torch.empty(E, 64, 32, dtype=fp8.FP8_DTYPE), torch.empty(E, 1, 1),
                                           torch.empty(E, 1, 1))
        assert fake.shape == (3, 64) and fake.dtype == torch.bfloat16
        fake = torch.ops.minidsa.fused_moe(torch.empty(3, 64, dtype=torch.bfloat16),
                                           torch.empty(3, 8, dtype=torch.long),
                                           torch.empty(3, 8), torch.empty(E, 64, 64, dtype=fp8.FP8_DTYPE),
                                           torch.empty(E, 64, 32, dtype=fp8.FP8_DTYPE), torch.empty(E, 1, 1),
                                           torch.empty(E, 1, 1), addend=torch.empty(3, 64, dtype=torch.bfloat16))
        assert fake.shape == (3, 64) and fake.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="down_proj_scale_inv"):
        fm.fused_moe_reference(x, ids, weights, gu, dn, gu_s, None)
    with pytest.raises(ValueError, match="gate_up_proj_scale_inv"):
        fm.fused_moe_reference(x, ids, weights, gu, dn, gu_s.repeat(1, 2, 1), dn_s)
    f32 = make_weights(64, 32, seed=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        fm.fused_moe_reference(x.bfloat16(), ids, weights, *f32)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fm.fused_moe_reference(x, ids, weights[:, :2], *f32)
    with pytest.raises(ValueError, match="block_k == 128"):
        fm.fused_moe_triton(x, ids, weights, gu, dn, gu_s, dn_s, config=fm.TileConfig(16, 64, 64, 1, 4, 2))
