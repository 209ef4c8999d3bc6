"""Every Triton kernel against its pure-torch reference, on CPU through Triton's interpreter.

Tiny sizes, fresh random inputs per case, and outputs poisoned before each
run (new tensors come from a torch.empty that fills NaN / sentinels; caches
are filled with random bytes), so an element a kernel forgets to write fails.

Triton only interprets kernels decorated while TRITON_INTERPRET=1, and
decides that for its own library when it is first imported. The variable is
set around our imports and while each test runs (the rest of the suite
never sees it); if a
compiled-mode triton was imported earlier in this process, the file re-runs
itself in a child process. On a machine with CUDA, tests/gpu covers this.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)


from triton_interp import (import_kernels_interpreted, poison_new_tensors, run_file_interpreted,  # noqa: E402
                           torch_rounded_casts)

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import kv_move as kv_move_mod  # noqa: E402
from minidsa.kernels import reference as ref  # noqa: E402
from minidsa.kernels import sparse_mla as sparse_mla_mod  # noqa: E402
from minidsa.kernels import topk as topk_mod  # noqa: E402
from minidsa.kernels import indexer  # noqa: E402
from minidsa.common.kv_cache import IndexerLayout, KVCache, MLALayout  # noqa: E402
from fp8_checks import assert_quant_index_q_matches  # noqa: E402


def _kv_cache(num_layers: int, num_pages: int, page_size: int, index_fp8: bool, mla: str = "auto",
              indexer_layers=None) -> KVCache:
    """bf16 caches of MLA rows 32 + 16 and indexer keys of 32."""
    return KVCache(num_layers, num_pages, MLALayout.for_model(32, 16, torch.bfloat16, mla),
                   IndexerLayout(32, torch.bfloat16, index_fp8, page_size), "cpu", indexer_layers)


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_kernels_in_child_process():
    run_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every torch.empty / empty_like made during a test comes back full of garbage (TRITON_INTERPRET=1 meanwhile)."""
    poison_new_tensors(monkeypatch)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_cache(num_pages: int, page_size: int, d: int, g: torch.Generator) -> torch.Tensor:
    """A paged fp8 indexer cache holding real keys at every slot (so any wrong slot read shows)."""
    cache = torch.zeros(num_pages, page_size * (d + 4), dtype=torch.uint8)
    ref.store_index_k(cache, torch.arange(num_pages * page_size), torch.randn(num_pages * page_size, d, generator=g),
                      page_size)
    return cache


def _rows_table(num_rows: int, width: int, page_size: int, num_pages: int, g: torch.Generator) -> torch.Tensor:
    """req_to_token rows built the way KVCache allocates: whole pages, slots page-aligned, random page order."""
    pages_per_row = -(-width // page_size)
    pages = torch.randperm(num_pages - 1, generator=g)[: num_rows * pages_per_row] + 1
    pages = pages.view(num_rows, pages_per_row)
    pos = torch.arange(width)
    return (pages[:, pos // page_size] * page_size + pos % page_size).to(torch.int32)


# ---------------------------------------------------------------------------
# quant_index_q
# ---------------------------------------------------------------------------
def _index_queries(tokens: int, heads: int, d: int, dtype: torch.dtype, g: torch.Generator):
    """Queries of varied magnitude, with an all-zero row (the scale floor), a one-hot row of 3e4 (every rotated
    value at the amax: 448) and a row 1e4 times the rest; signed non-zero weights."""
    q = torch.randn(tokens, heads, d, generator=g) * torch.rand(tokens, heads, 1, generator=g) * 10
    q[0, 1] = 0
    q[-1, 0] = 0
    q[-1, 0, 3] = 3e4
    q[tokens // 2, heads - 1] *= 1e4
    w = torch.randn(tokens, heads, generator=g)
    return q.to(dtype), torch.where(w == 0, 1.0, w)


@in_this_process
@pytest.mark.parametrize("tokens,heads,d,dtype", [
    (1, 64, 128, torch.bfloat16), (3, 64, 64, torch.float32), (17, 64, 128, torch.float32),
    (64, 64, 128, torch.bfloat16), (1, 4, 64, torch.float32), (3, 8, 128, torch.bfloat16),
    (17, 4, 64, torch.bfloat16), (64, 8, 128, torch.float32),
])
def test_quant_index_q_matches_reference(tokens, heads, d, dtype):
    """Without a rope, and with the indexer's rope on the first half of each head (as DeepSeek-V3.2's 64 of 128),
    pairs interleaved and half-split; the rope in the query dtype bit for bit (`torch_rounded_casts`: the
    interpreter's bf16 cast rounds as torch's)."""
    g = _gen(tokens * 7 + heads + d)
    q, w = _index_queries(tokens, heads, d, dtype, g)
    cos, sin = _rope_tables(tokens, d // 2, g)
    with torch_rounded_casts():
        assert_quant_index_q_matches(q, w, indexer.quant_index_q(q, w))
        for interleave in (True, False):
            got = indexer.quant_index_q(q, w, None, cos, sin, interleave)
            assert_quant_index_q_matches(q, w, got, rope=(cos, sin, interleave))
        # Strided rows: heads apart by 2 D, weights by 2, cos / sin rows by rope (the kernel reads the strides it
        # is given).
        q_wide = torch.cat([q, q.flip(-1)], dim=-1)[..., :d]
        w_wide = torch.stack([w, -w], dim=-1)[..., 0]
        cos_wide, sin_wide = torch.cat([cos, sin], dim=-1).split(d // 4, dim=-1)
        got = indexer.quant_index_q(q_wide, w_wide, ref.hadamard_matrix(d), cos_wide, sin_wide, tokens % 2 == 0)
        assert_quant_index_q_matches(q_wide, w_wide, got, rope=(cos_wide, sin_wide, tokens % 2 == 0))


def _rope_tables(tokens: int, rope: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos / sin [tokens, rope/2] of far-apart positions, times a YaRN-like attention factor."""
    angles = torch.randint(0, 1 << 17, (tokens, 1), generator=g).float() * torch.rand(rope // 2, generator=g)
    return angles.cos() * 1.3, angles.sin() * 1.3


@in_this_process
def test_quant_index_q_rope_covers_the_whole_head_or_a_few_columns():
    """A rope as wide as the head (no column passes through) and one of 6 columns (3 pairs, no power of two)."""
    g = _gen(5)
    q, w = _index_queries(5, 4, 32, torch.bfloat16, g)
    with torch_rounded_casts():
        for rope in (32, 6):
            cos, sin = _rope_tables(5, rope, g)
            for interleave in (True, False):
                got = indexer.quant_index_q(q, w, None, cos, sin, interleave)
                assert_quant_index_q_matches(q, w, got, rope=(cos, sin, interleave))


@in_this_process
def test_quant_index_q_rejects_bad_input_and_takes_no_tokens():
    q, w = torch.randn(3, 4, 32), torch.randn(3, 4)
    with pytest.raises(ValueError, match="weights"):
        indexer.quant_index_q(q, w[:2])
    with pytest.raises(ValueError, match="power of two"):
        indexer.quant_index_q(torch.randn(3, 4, 24), w)
    with pytest.raises(ValueError, match="Hadamard"):
        indexer.quant_index_q(q, w, ref.hadamard_matrix(64))
    with pytest.raises(ValueError, match="float64"):
        indexer.quant_index_q(q.double(), w)
    cos = torch.randn(3, 8)
    with pytest.raises(ValueError, match="cos / sin"):
        indexer.quant_index_q(q, w, None, cos[:2], cos[:2])
    with pytest.raises(ValueError, match="cos / sin"):
        indexer.quant_index_q(q, w, None, torch.randn(3, 20), torch.randn(3, 20))
    with pytest.raises(ValueError, match="cos / sin"):
        indexer.quant_index_q(q, w, None, cos, None)
    q8, sw = indexer.quant_index_q(q[:0], w[:0])
    assert q8.shape == (0, 4, 32) and q8.dtype == torch.float8_e4m3fn and sw.shape == (0, 4)


@in_this_process
def test_quant_index_q_op_traces_once_for_every_token_count():
    """Opaque under torch.compile (fullgraph, dynamic shapes): the fake gives the shapes, one graph serves any T."""
    from torch._dynamo.testing import CompileCounterWithBackend

    had = ref.hadamard_matrix(32)

    def step(q, w, cos, sin):
        q8, sw = torch.ops.minidsa.quant_index_q(q, w, had, cos, sin, True)
        return q8.float().sum(-1) * sw

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    g = _gen(31)
    for tokens in (3, 9):
        q, w = torch.randn(tokens, 16, 32, generator=g).bfloat16(), torch.randn(tokens, 16, generator=g)
        cos, sin = _rope_tables(tokens, 16, g)
        assert torch.equal(compiled(q, w, cos, sin), step(q, w, cos, sin))
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------
# paged index logits
# ---------------------------------------------------------------------------
def _logits_case(seed: int, page_size: int, fp8: bool, tree: bool):
    g = _gen(seed)
    heads, d, width = 16, 32, 150
    rows_of_tokens = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 0, 4])  # runs that share a row, and singles
    num_rows = 5
    num_pages = num_rows * -(-width // page_size) + 2
    r2t = _rows_table(num_rows, width, page_size, num_pages, g)
    num_tokens = rows_of_tokens.shape[0]
    tree_w = 4 if tree else 0
    kv_lens = torch.randint(0, width - tree_w + 1, (num_tokens,), generator=g)
    kv_lens[4] = 0  # sees nothing (unless its tree bits say so)
    kv_lens[1] = width - tree_w
    tree_mask = torch.rand(num_tokens, tree_w, generator=g) > 0.5 if tree else None
    q = torch.randn(num_tokens, heads, d, generator=g)
    w = torch.rand(num_tokens, heads, generator=g) - 0.3
    if fp8:
        cache = _random_cache(num_pages, page_size, d, g)
        q, w = ref.quant_index_q(q, w)
    else:
        cache = torch.randn(num_pages * page_size, d, generator=g)
    return q, w, cache, r2t, rows_of_tokens, kv_lens, width, tree_mask


@in_this_process
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("tree", [False, True])
def test_index_logits_matches_reference(page_size, fp8, tree):
    q, w, cache, r2t, rows, kv_lens, width, tree_mask = _logits_case(page_size + 2 * fp8 + 5 * tree, page_size,
                                                                     fp8, tree)
    want = ref.index_logits(q, w, cache, page_size, r2t, rows, kv_lens, width, tree_mask)
    # One token per program, then pairs sharing key tiles when the batch says rows repeat (5 requests);
    # one chunk per row, and several (chunk tails, skipped invisible chunks).
    for num_requests, chunk_len in ((0, None), (5, None), (5, 64)):
        got = indexer.index_logits(q, w, cache, page_size, r2t, rows, kv_lens, width, tree_mask,
                                   num_requests=num_requests, chunk_len=chunk_len)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@in_this_process
def test_index_logits_page_size_4_and_bad_input():
    q, w, cache, r2t, rows, kv_lens, width, tree_mask = _logits_case(11, 4, True, False)
    want = ref.index_logits(q, w, cache, 4, r2t, rows, kv_lens, width)
    torch.testing.assert_close(indexer.index_logits(q, w, cache, 4, r2t, rows, kv_lens, width), want,
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="e4m3 queries"):
        indexer.index_logits(q.float(), w, cache, 4, r2t, rows, kv_lens, width)
    with pytest.raises(ValueError, match="weights"):
        indexer.index_logits(q, w[:, :3], cache, 4, r2t, rows, kv_lens, width)


@in_this_process
@pytest.mark.parametrize("fp8", [True, False])
def test_one_request_extend_paths_match_reference(fp8):
    q, w, cache, r2t, _, _, width, _ = _logits_case(30 + fp8, 4, fp8, False)
    rows = torch.full((7,), 2)
    kv_lens = torch.arange(width - 6, width + 1)  # the last 7 tokens of a prefill chunk
    want = ref.index_logits(q[:7], w[:7], cache, 4, r2t, rows, kv_lens, width)
    for got in (torch.ops.minidsa.index_logits(q[:7], w[:7], cache, 4, r2t, rows, kv_lens, width, None, 1),
                indexer.extend_index_logits(q[:7], w[:7], cache, 4, r2t, rows, kv_lens, width)):  # gather + ragged
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@in_this_process
def test_mask_invisible_matches_visible_mask():
    g = _gen(3)
    logits = torch.randn(6, 40, generator=g)
    strided = torch.randn(6, 64, generator=g)[:, :40]
    strided.copy_(logits)
    kv_lens = torch.tensor([0, 5, 40, 17, 3, 39])
    tree = torch.rand(6, 3, generator=g) > 0.5
    for tm in (None, tree):
        want = logits.masked_fill(~ref.visible_mask(kv_lens, 40, tm), float("-inf"))
        assert torch.equal(indexer.mask_invisible(strided, kv_lens, tm), want)


# ---------------------------------------------------------------------------
# ragged (prefill) logits
# ---------------------------------------------------------------------------
@in_this_process
@pytest.mark.parametrize("fp8", [False, True])
def test_ragged_index_logits_matches_reference(fp8):
    g = _gen(20 + fp8)
    heads, d, num_q, num_kv = 16, 32, 7, 90
    q = torch.randn(num_q, heads, d, generator=g)
    w = torch.rand(num_q, heads, generator=g)
    keys = torch.randn(num_kv, d, generator=g)
    ks = torch.tensor([0, 0, 10, 30, 50, 89, 40])
    ke = torch.tensor([1, 90, 70, 30, 51, 90, 45])  # includes an empty range
    if fp8:
        q, w = ref.quant_index_q(q, w)
        k8, k_scale = ref.quant_fp8_ue8m0(ref.hadamard_rotate(keys))
        got = indexer.ragged_index_logits(q, w, k8, ks, ke, k_scale)
        want = ref.ragged_index_logits(q, w, k8.float() * k_scale[:, None], ks, ke)
    else:
        got = indexer.ragged_index_logits(q, w, keys, ks, ke)
        want = ref.ragged_index_logits(q, w, keys, ks, ke)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------
def _topk_case(seed: int, width: int):
    g = _gen(seed)
    num_tokens = 6
    logits = torch.randn(num_tokens, width, generator=g)
    visible = torch.tensor([width, 0, 3, width // 2, width - 1, 17])
    logits[torch.arange(width)[None, :] >= visible[:, None]] = float("-inf")
    r2t = torch.randperm(4 * width, generator=g)[: 3 * width].view(3, width).to(torch.int32)
    rows = torch.tensor([0, 1, 2, 0, 1, 2])
    return logits, r2t, rows


@in_this_process
@pytest.mark.parametrize("impl", ["triton-8bit", "triton-11bit", "triton-split", "torch"])
@pytest.mark.parametrize("width,k", [(300, 40), (5000, 64), (30, 40)])
def test_topk_matches_reference_sets(impl, width, k):
    logits, r2t, rows = _topk_case(width + k, width)
    if impl == "torch":
        slots, pos = topk_mod.torch_topk_slots(logits, k, r2t, rows)
    elif impl == "triton-split":  # each row over 3 programs (histograms summed with atomics)
        slots, pos = topk_mod.topk_slots(logits, k, r2t, rows, num_chunks=3, split_block=64)
    else:  # both radix plans, and a block smaller than the row (several chunks per pass)
        config = (256, 8, 4) if impl == "triton-8bit" else (1024, 11, 4)
        slots, pos = topk_mod.topk_slots(logits, k, r2t, rows, config=config)
    want_slots, want_pos = ref.topk_slots(logits, k, r2t, rows)
    assert slots.shape == pos.shape == (logits.shape[0], k) and slots.dtype == pos.dtype == torch.int32
    for t in range(logits.shape[0]):
        assert sorted(pos[t].tolist()) == sorted(want_pos[t].tolist())
        assert sorted(slots[t].tolist()) == sorted(want_slots[t].tolist())
        ok = pos[t] >= 0
        assert torch.equal(slots[t][ok], r2t[rows[t], pos[t][ok].long()])
        assert (slots[t][~ok] == -1).all()


@in_this_process
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_topk_ties_take_lowest_positions(num_chunks):
    logits = torch.full((2, 1000), float("-inf"))
    logits[0, :600] = 1.0  # 600 equal values, k = 100
    logits[1, 500:] = torch.arange(500).float() % 7  # many ties at the threshold value
    r2t = torch.arange(2000, dtype=torch.int32).view(2, 1000)
    rows = torch.tensor([0, 1])
    slots, pos = topk_mod.topk_slots(logits, 100, r2t, rows, num_chunks=num_chunks, split_block=64)
    assert pos[0].tolist() == list(range(100))
    chosen = logits[1, pos[1].long()]
    want = logits[1].topk(100).values
    assert torch.equal(chosen.sort().values, want.sort().values)


# ---------------------------------------------------------------------------
# sparse MLA
# ---------------------------------------------------------------------------
@pytest.mark.smoke
@in_this_process
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_sparse_mla_matches_reference(num_splits):
    # fp32 only: the interpreter's dot multiplies bf16 as raw integers (bf16 is checked in tests/gpu).
    dtype = torch.float32
    g = _gen(40 + 3 * (num_splits or 0))
    num_tokens, heads, v_dim, rope, num_slots, k = 4, 16, 32, 16, 70, 80
    q = torch.randn(num_tokens, heads, v_dim + rope, generator=g).to(dtype)
    cache = torch.randn(num_slots, v_dim + rope, generator=g).to(dtype)
    topk = torch.randint(0, num_slots, (num_tokens, k), generator=g, dtype=torch.int32)
    topk[1, 7:] = -1  # fewer keys than top-k
    topk[2] = -1  # no key at all: zeros
    topk[3, ::3] = -1  # holes
    got = sparse_mla_mod.sparse_mla(q, cache, topk, 0.25, v_dim, num_splits=num_splits, config=(16, 16, 4, 1))
    want = ref.sparse_mla(q, cache, topk, 0.25, v_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[2] == 0).all()


# ---------------------------------------------------------------------------
# KV move
# ---------------------------------------------------------------------------
@in_this_process
@pytest.mark.parametrize("page_size,fp8,mla", [(1, True, "auto"), (4, True, "auto"), (64, True, "auto"),
                                                (1, False, "auto"), (1, True, "fp8"), (64, True, "fp8")])
def test_kv_move_matches_reference(page_size, fp8, mla):
    g = _gen(60 + page_size + fp8)
    num_pages = 40 if page_size == 1 else (12 if page_size == 4 else 3)
    kv = _kv_cache(3, num_pages, page_size, fp8, mla, indexer_layers=[True, False, True])
    if mla == "fp8":  # the 68-byte rows of latent 32 + rope 16, moved as 17 words
        kv.mla_buffer.copy_(torch.randint(0, 256, kv.mla_buffer.shape, generator=g, dtype=torch.uint8))
    else:
        kv.mla_buffer.copy_(torch.randn(kv.mla_buffer.shape, generator=g))
    if fp8:
        kv.index_buffer.copy_(torch.randint(0, 256, kv.index_buffer.shape, generator=g, dtype=torch.uint8))
    else:
        kv.index_buffer.copy_(torch.randn(kv.index_buffer.shape, generator=g))
    # Accepted tree path moved to the front: moves chain (a destination is another move's source).
    src = torch.tensor([3, 5, 9, 12, 20])
    dst = torch.tensor([2, 3, 4, 5, 6])
    want_mla, want_idx = kv.mla_buffer.clone(), kv.index_buffer.clone()
    ref.kv_move(list(want_mla.unbind(0)), list(want_idx.unbind(0)), src, dst, page_size, 32)
    kv_move_mod.kv_move(kv.mla_buffer, kv.index_buffer, src, dst, page_size, 32)
    assert torch.equal(kv.mla_buffer, want_mla)
    assert torch.equal(kv.index_buffer, want_idx)


@in_this_process
def test_kv_move_rejects_bad_input():
    kv = _kv_cache(1, 4, 1, True)
    with pytest.raises(ValueError, match="src"):
        kv_move_mod.kv_move(kv.mla_buffer, kv.index_buffer, torch.tensor([1, 2]), torch.tensor([1]), 1, 32)
    with pytest.raises(ValueError, match="head dim"):
        kv_move_mod.kv_move(kv.mla_buffer, kv.index_buffer, torch.tensor([1]), torch.tensor([2]), 1, 16)


# ---------------------------------------------------------------------------
# custom ops under torch.compile
# ---------------------------------------------------------------------------
@in_this_process
def test_custom_ops_trace_opaquely_under_compile():
    g = _gen(80)
    q, w, cache, r2t, rows, kv_lens, width, _ = _logits_case(81, 4, True, False)
    mla = torch.randn(200, 48, generator=g)
    qm = torch.randn(q.shape[0], 16, 48, generator=g)

    def step(q, w, cache, r2t, rows, kv_lens, qm, mla):
        logits = torch.ops.minidsa.index_logits(q, w, cache, 4, r2t, rows, kv_lens, width, None)
        slots, _ = torch.ops.minidsa.topk_slots(logits, 8, r2t, rows)
        slots = torch.where(slots >= 0, slots % 200, -1)
        return torch.ops.minidsa.sparse_mla(qm, mla, slots, 0.3, 32) * 2

    args = (q, w, cache, r2t, rows, kv_lens, qm, mla)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), step(*args))


# ---------------------------------------------------------------------------
# MoE router (kernels/router.py)

@in_this_process
@pytest.mark.parametrize("experts,groups,topk_group,top_k,norm", [
    (256, 8, 4, 8, True),  # DeepSeek-V3.2
    (256, 1, 1, 8, True),  # GLM-5: no groups
    (8, 2, 1, 2, True),  # the tiny preset
    (64, 4, 2, 6, False),
])
def test_router_matches_reference(experts, groups, topk_group, top_k, norm):
    from minidsa.kernels import router
    g = _gen(experts + groups + top_k)
    logits = torch.randn(37, experts, generator=g) * 3
    bias = torch.randn(experts, generator=g) * 0.1
    ids, weights = router.route(logits, bias, top_k, groups, topk_group, norm, 2.5)
    want_ids, want_weights = ref.route(logits, bias, top_k, groups, topk_group, norm, 2.5)
    assert ids.dtype == torch.int64 and ids.shape == (37, top_k)
    assert torch.equal(ids, want_ids)  # same experts, same (descending) order
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


@in_this_process
def test_router_ties_and_group_limits():
    """Equal scores: the lower expert wins (torch.topk leaves the order of ties open: compare sets there). An
    expert outside the kept groups is never chosen, even when its unbiased score is the best of the row."""
    from minidsa.kernels import router
    logits = torch.zeros(2, 16)
    bias = torch.zeros(16)
    ids, weights = router.route(logits, bias, 3, 4, 1, True, 1.0)
    assert ids.tolist() == [[0, 1, 2]] * 2  # all equal: group 0, then its lowest experts, in order
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))
    logits = torch.linspace(-1, 1, 16).repeat(2, 1)
    bias = torch.zeros(16)
    bias[:4] = 1.0 + torch.arange(4) * 0.01  # group 0 wins on its biased scores
    logits[1, 4] = 8.0  # row 1: expert 4 (group 1) has the best sigmoid score of all
    ids, weights = router.route(logits, bias, 3, 4, 1, True, 2.0)
    want_ids, want_weights = ref.route(logits, bias, 3, 4, 1, True, 2.0)
    assert torch.equal(ids, want_ids) and ids.tolist() == [[3, 2, 1]] * 2
    torch.testing.assert_close(weights, want_weights)


def test_router_refuses_shapes_it_cannot_take():
    from minidsa.kernels import router
    assert router.supported(256, 8) is None and router.supported(256, 1) is None
    assert "power-of-two" in router.supported(96, 4)
    assert "two best" in router.supported(8, 8)
    with pytest.raises(ValueError, match="power-of-two"):
        router.route(torch.zeros(2, 96), torch.zeros(96), 2, 4, 2, True, 1.0)


_COMPILE_INDEXER_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minidsa.kernels import indexer
target = GPUTarget("cuda", 90, 32)
# the engine's tiles at decode and prefill, with DeepSeek-V3.2's half-split rope and GLM's interleaved one
for block_m, interleave in ((16, False), (64, False), (16, True)):
    src = ASTSource(indexer._quant_index_q_kernel, {
        "q_ptr": "*bf16", "w_ptr": "*fp32", "had_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
        "q8_ptr": "*u8", "w_out_ptr": "*fp32", "num_rows": "i32", "stride_qt": "i32", "stride_qh": "i32",
        "stride_wt": "i32", "stride_wh": "i32", "stride_ct": "i32", "H": "constexpr", "D": "constexpr",
        "ROPE": "constexpr", "INTERLEAVE": "constexpr", "BLOCK_M": "constexpr", "PDL": "constexpr"},
        constexprs={"H": 64, "D": 128, "ROPE": 64, "INTERLEAVE": interleave, "BLOCK_M": block_m, "PDL": True})
    assert triton.compile(src, target=target, options={"num_warps": 8, "enable_fp_fusion": False}).asm["cubin"]
print("compiled")
"""


def test_indexer_query_kernel_compiles_for_h100():
    """The query quantisation (with its rope) compiled for sm_90 without a GPU (the key store:
    tests/test_key_store.py)."""
    from triton_interp import compile_for_h100

    compile_for_h100(_COMPILE_INDEXER_FOR_H100, "indexer")
