"""The cache stores that finish the keys (kernels/mla_store.py `norm_rope_store_mla`, kernels/indexer.py
`norm_rope_store_index_k`) against their torch references, on CPU through Triton's interpreter, and their wiring:
the custom ops traced opaquely under torch.compile, the sm_90 compile.

Same set-up as tests/test_mla_absorb.py: kernels imported interpreted (or the file re-runs itself in a child
process), new torch.empty outputs poisoned. Inputs as the model holds them: `kv` / `k` row-strided views of a wider
projection, slots scattered over a cache of random bytes (slots not stored must keep theirs).

What is compared how: the kernels sum the norms' statistics (and the Hadamard rotation) in another order than
torch. fp32 rows within a few fp32 ulps; bf16 values never more than one bf16 ulp apart and mostly equal (a
statistic's last-bit difference moves a bf16 rounding only near a tie); e4m3 bytes mostly equal and never more
than one e4m3 step apart, scales equal.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)

from triton_interp import (SPILL_CHECK, import_kernels_interpreted, poison_new_tensors,  # noqa: E402
                           run_file_interpreted, torch_rounded_casts)

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import custom_ops  # noqa: E402,F401
from minidsa.kernels import indexer, mla_store  # noqa: E402
from minidsa.kernels import reference as ref  # noqa: E402
# Before any torch.empty is patched: Dynamo takes torch's functions as it finds them when imported, and would
# refuse the real one after a poisoned test had imported it.
import torch._dynamo  # noqa: E402,F401

EPS = 1e-6
TOKENS = (1, 3, 17, 70)


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_key_store_in_child_process():
    run_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_new_tensors(monkeypatch)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cos_sin(num_tokens: int, rope: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, rope / 2] fp32 tables at scattered positions, with a YaRN-like factor (not a pure rotation)."""
    pos = torch.randint(0, 5000, (num_tokens, 1), generator=g).float()
    freqs = pos * 10000.0 ** (-torch.arange(0, rope, 2).float() / rope)
    return freqs.cos() * 1.1, freqs.sin() * 1.1


def _projection(num_tokens: int, width: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A row-strided view [T, width] of a wider projection output, rows of varied magnitude, one all-zero row."""
    wide = torch.randn(num_tokens, width + 24, generator=g) * torch.exp2(torch.randint(-4, 5, (num_tokens, 1),
                                                                                        generator=g).float())
    wide[num_tokens // 2] = 0
    return wide.to(dtype)[:, 24:]


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b's dtype at b (0 where equal)."""
    eps = torch.finfo(b.dtype).eps
    ulp = torch.where(b.float() != 0, b.float().abs() * eps, torch.finfo(b.dtype).tiny)
    return (a.float() - b.float()).abs() / ulp


def _check_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.float().isnan().any()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(want.abs().max().item(), 1.0))
        return
    apart = _ulps_apart(got, want)
    assert apart.max() <= 1.0, apart.max()
    assert (apart == 0).float().mean() >= 0.98, (apart == 0).float().mean()


def _check_e4m3(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3 values (fp32 views): mostly equal, never more than one e4m3 step (1/8 relative, or a subnormal) apart."""
    diff = (got - want).abs()
    assert (diff > 0).float().mean() < 0.01
    assert (diff <= want.abs() / 8 + 2**-9).all()


def _untouched(num_slots: int, loc: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(num_slots, dtype=torch.bool)
    keep[loc] = False
    return keep


# ---------------------------------------------------------------------------
# MLA: RMSNorm'd latent + interleaved rope, into a model-dtype cache or the FP8 layout
# ---------------------------------------------------------------------------
MLA_CASES = ([(t, 32, 16, dtype, fp8) for t in TOKENS for dtype in (torch.float32, torch.bfloat16)
              for fp8 in (False, True)]
             + [(t, 512, 64, torch.bfloat16, fp8) for t in (1, 17) for fp8 in (False, True)]
             + [(5, 256, 64, torch.float32, True), (5, 48, 16, torch.bfloat16, False)])  # two groups; L not 2^n


@in_this_process
@pytest.mark.parametrize("tokens,latent,rope,dtype,fp8", MLA_CASES)
def test_mla_store_matches_reference(tokens, latent, rope, dtype, fp8):
    g = _gen(tokens * 31 + latent + fp8)
    num_slots = 2 * tokens + 9
    kv = _projection(tokens, latent + rope, dtype, g)
    weight = (torch.rand(latent, generator=g) + 0.5).to(dtype)
    cos, sin = _cos_sin(tokens, rope, g)
    loc = torch.randperm(num_slots, generator=g)[:tokens]
    row_bytes = ref.mla_fp8_row_bytes(latent, rope) if fp8 else (latent + rope) * dtype.itemsize
    got = torch.randint(0, 256, (num_slots, row_bytes), generator=g, dtype=torch.uint8)
    if not fp8:
        got = got.view(dtype)
        got[got.isnan()] = 0  # random bytes, compared as numbers below
    want = got.clone()
    mla_store.norm_rope_store_mla(got, loc, kv, weight, EPS, cos, sin)
    ref.norm_rope_store_mla(want, loc, kv, weight, EPS, cos, sin)
    keep = _untouched(num_slots, loc)
    assert torch.equal(got[keep].view(torch.uint8), want[keep].view(torch.uint8))
    if not fp8:
        _check_rows(got[loc], want[loc])
        return
    g_lat, g_sc, g_rope = ref.mla_fp8_views(got, latent)
    w_lat, w_sc, w_rope = ref.mla_fp8_views(want, latent)
    assert torch.equal(g_sc[loc], w_sc[loc])
    _check_e4m3(g_lat[loc].float(), w_lat[loc].float())
    _check_rows(g_rope[loc], w_rope[loc])


@in_this_process
def test_mla_store_with_an_fp32_weight_keeps_the_latent_in_fp32():
    """A norm weight in fp32 beside a bf16 projection: the reference's latent is fp32 (weight * bf16-rounded normed
    values), rounded once by the cache's dtype; the kernel follows the promotion."""
    g = _gen(5)
    kv = _projection(9, 48, torch.bfloat16, g)
    weight = torch.rand(32, generator=g) + 0.5
    cos, sin = _cos_sin(9, 16, g)
    loc = torch.randperm(30, generator=g)[:9]
    for cache in (torch.zeros(30, 48, dtype=torch.float32), torch.zeros(30, ref.mla_fp8_row_bytes(32, 16),
                                                                        dtype=torch.uint8)):
        want = cache.clone()
        mla_store.norm_rope_store_mla(cache, loc, kv, weight, EPS, cos, sin)
        ref.norm_rope_store_mla(want, loc, kv, weight, EPS, cos, sin)
        if cache.dtype == torch.float32:
            _check_rows(cache[loc], want[loc])
        else:
            _check_e4m3(ref.load_mla(cache, loc, 32)[:, :32], ref.load_mla(want, loc, 32)[:, :32])


def test_mla_store_refuses_what_it_cannot_take():
    kv, w = torch.zeros(2, 48), torch.ones(32)
    cos = sin = torch.zeros(2, 8)
    loc = torch.arange(2)
    with pytest.raises(ValueError, match="FP8 MLA cache"):
        mla_store.norm_rope_store_mla(torch.zeros(4, 64, dtype=torch.uint8), loc, kv, w, EPS, cos, sin)
    with pytest.raises(ValueError, match="rope part|cos / sin"):
        mla_store.norm_rope_store_mla(torch.zeros(4, 48), loc, kv, w, EPS, cos[:, :4], sin[:, :4])
    with pytest.raises(ValueError, match="MLA cache must be"):
        mla_store.norm_rope_store_mla(torch.zeros(4, 40), loc, kv, w, EPS, cos, sin)


# ---------------------------------------------------------------------------
# indexer: LayerNorm + rope (interleaved or half) on the first dims, into the paged fp8 cache or a model-dtype one
# ---------------------------------------------------------------------------
INDEX_CASES = ([(t, 32, 16, dtype, fp8, inter, 4) for t in TOKENS for dtype in (torch.float32, torch.bfloat16)
                for fp8 in (False, True) for inter in (True, False)]
               + [(t, 128, 64, torch.bfloat16, fp8, inter, 64) for t in (1, 17) for fp8 in (False, True)
                  for inter in (True, False)]
               + [(3, 32, 16, torch.bfloat16, True, True, 1)])


@in_this_process
@pytest.mark.parametrize("tokens,d,rope,dtype,fp8,interleaved,page_size", INDEX_CASES)
def test_index_k_store_matches_reference(tokens, d, rope, dtype, fp8, interleaved, page_size):
    g = _gen(tokens * 13 + d + 2 * fp8 + interleaved)
    num_pages = -(-(2 * tokens + 9) // page_size)
    num_slots = num_pages * page_size
    k = _projection(tokens, d, dtype, g)
    weight = (torch.rand(d, generator=g) + 0.5).to(dtype)
    bias = (torch.randn(d, generator=g) * 0.2).to(dtype)
    cos, sin = _cos_sin(tokens, rope, g)
    loc = torch.randperm(num_slots, generator=g)[:tokens]
    if fp8:
        got = torch.randint(0, 256, (num_pages, page_size * (d + 4)), generator=g, dtype=torch.uint8)
    else:
        got = torch.randn(num_slots, d, generator=g).to(dtype)
    want = got.clone()
    with torch_rounded_casts():  # a bf16 key's Hadamard is a bf16 tl.dot, which the interpreter gets wrong bare
        indexer.norm_rope_store_index_k(got, loc, k, weight, bias, EPS, cos, sin, interleaved, page_size)
    ref.norm_rope_store_index_k(want, loc, k, weight, bias, EPS, cos, sin, interleaved, page_size)
    keep = _untouched(num_slots, loc)
    if not fp8:
        assert torch.equal(got[keep], want[keep])
        _check_rows(got[loc], want[loc])
        return
    gk, gs = ref.fp8_views(got, page_size, d)
    wk, ws = ref.fp8_views(want, page_size, d)
    page, off = loc // page_size, loc % page_size
    assert torch.equal(gs[page, off], ws[page, off])
    _check_e4m3(gk[page, off].float(), wk[page, off].float())
    kp, ko = keep.nonzero()[:, 0] // page_size, keep.nonzero()[:, 0] % page_size
    assert torch.equal(gk[kp, ko].view(torch.uint8), wk[kp, ko].view(torch.uint8))
    assert torch.equal(gs[kp, ko].view(torch.int32), ws[kp, ko].view(torch.int32))


def test_index_k_store_refuses_what_it_cannot_take():
    k, w, b = torch.zeros(2, 32), torch.ones(32), torch.zeros(32)
    cos = sin = torch.zeros(2, 8)
    loc = torch.arange(2)
    with pytest.raises(ValueError, match="fp8 cache"):
        indexer.norm_rope_store_index_k(torch.zeros(4, 100, dtype=torch.uint8), loc, k, w, b, EPS, cos, sin, True, 4)
    with pytest.raises(ValueError, match="power of two"):
        indexer.norm_rope_store_index_k(torch.zeros(4, 24), loc, k[:, :24], w[:24], b[:24], EPS, cos, sin, True, 4)
    with pytest.raises(ValueError, match="cos / sin"):
        indexer.norm_rope_store_index_k(torch.zeros(4, 32), loc, k, w, b, EPS, cos[:1], sin[:1], True, 4)


# ---------------------------------------------------------------------------
# the ops: opaque under torch.compile, the same writes
# ---------------------------------------------------------------------------
@in_this_process
@pytest.mark.parametrize("fp8", [False, True])
def test_store_ops_trace_opaquely_under_compile(fp8):
    g = _gen(7 + fp8)
    tokens, latent, rope, d, page_size = 5, 32, 16, 32, 4
    wide = torch.randn(tokens, 8 + d + latent + rope, generator=g).bfloat16()  # [q_a | indexer k | kv] as fused
    k, kv = wide[:, 8:8 + d], wide[:, 8 + d:]
    mla_w = torch.rand(latent, generator=g).bfloat16() + 0.5
    norm_w, norm_b = torch.rand(d, generator=g).bfloat16() + 0.5, torch.randn(d, generator=g).bfloat16()
    cos, sin = _cos_sin(tokens, rope, g)
    loc = torch.tensor([4, 9, 11, 0, 17])
    mla = (torch.zeros(20, ref.mla_fp8_row_bytes(latent, rope), dtype=torch.uint8) if fp8 else
           torch.zeros(20, latent + rope, dtype=torch.bfloat16))
    index = (torch.zeros(5, page_size * (d + 4), dtype=torch.uint8) if fp8 else
             torch.zeros(20, d, dtype=torch.bfloat16))

    def step(mla, index, loc, kv, k, cos, sin):
        torch.ops.minidsa.norm_rope_store_mla(mla, loc, kv, mla_w, EPS, cos, sin)
        torch.ops.minidsa.norm_rope_store_index_k(index, loc, k, norm_w, norm_b, EPS, cos, sin, False, page_size)

    want_mla, want_index = mla.clone(), index.clone()
    step(want_mla, want_index, loc, kv, k, cos, sin)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(mla, index, loc, kv, k, cos, sin)
    assert torch.equal(mla, want_mla) and torch.equal(index, want_index)


_COMPILE_FOR_H100 = SPILL_CHECK + """
from minidsa.kernels import indexer, mla_store
for fp8 in (True, False):
    src = ASTSource(mla_store._norm_rope_store_mla_kernel, {
        "kv_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "loc_ptr": "*i64",
        "cache_ptr": "*u8" if fp8 else "*bf16", "scale_ptr": "*fp32" if fp8 else "*bf16",
        "rope_ptr": "*bf16", "num_tokens": "i32", "stride_kv": "i32", "stride_cs": "i32", "stride_cache": "i32",
        "eps": "fp32", "L": "constexpr", "R": "constexpr", "R_BLOCK": "constexpr", "CHUNK": "constexpr",
        "FP8": "constexpr", "ROUND_KV": "constexpr", "ROUND_LATENT": "constexpr", "ROUND_CACHE": "constexpr",
        "BLOCK_T": "constexpr", "PDL": "constexpr"}, constexprs={"L": 512, "R": 64, "R_BLOCK": 64, "CHUNK": 128,
                                             "FP8": fp8, "ROUND_KV": 1, "ROUND_LATENT": 1,
                                             "ROUND_CACHE": 0 if fp8 else 1,
                                             "BLOCK_T": 16, "PDL": True})
    compile_without_spills(src, 4)
    for interleaved in (True, False):
        src = ASTSource(indexer._norm_rope_store_index_k_kernel, {
            "k_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "loc_ptr": "*i64", "had_ptr": "*fp32" if fp8 else "*bf16", "cache_ptr": "*u8" if fp8 else "*bf16",
            "scale_ptr": "*fp32" if fp8 else "*bf16", "num_tokens": "i32", "stride_k": "i32", "stride_cs": "i32",
            "stride_cache": "i32", "eps": "fp32", "D": "constexpr", "R": "constexpr", "INTERLEAVED": "constexpr",
            "ROUND_K": "constexpr", "FP8": "constexpr", "ROUND_CACHE": "constexpr", "PAGE_SIZE": "constexpr",
            "BLOCK_T": "constexpr", "PDL": "constexpr"}, constexprs={"D": 128, "R": 64, "INTERLEAVED": interleaved,
                                                 "ROUND_K": 1,
                                                 "FP8": fp8, "ROUND_CACHE": 0 if fp8 else 1, "PAGE_SIZE": 64,
                                                 "BLOCK_T": 16, "PDL": True})
        compile_without_spills(src, 8)
print("compiled")
"""


def test_key_store_kernels_compile_for_h100():
    """Both stores, both cache layouts (and both rope styles of the indexer key) compiled for sm_90 without a GPU, with
    no register spills by ptxas's count: the indexer key's store once spilled 9 KB a thread (73 us a call on an
    H100, 2026-11-27) where the kernel alone took ~5."""
    from triton_interp import compile_for_h100

    compile_for_h100(_COMPILE_FOR_H100, "store")
