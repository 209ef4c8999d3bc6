"""The compiled Triton kernels against the torch references at real model sizes (CUDA only).

DeepSeek-V3.2 shapes: 128 heads, 576 / 512 latent dims, 64 indexer heads x 128,
index_topk 2048, page size 64; contexts from 1 to 128k, batches 1 to 128.
Run by scripts/gpu_check.sh (skipped cleanly without CUDA).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from triton.runtime.jit import JITFunction  # noqa: E402

from minidsa.kernels import custom_ops, deepgemm, indexer, kv_move, sparse_mla, topk  # noqa: E402,F401
from minidsa.kernels import reference as ref  # noqa: E402
from fp8_checks import assert_quant_index_q_matches  # noqa: E402

if not isinstance(indexer._paged_logits_kernel, JITFunction):
    pytest.skip("Triton kernels were imported as interpreted functions in this process", allow_module_level=True)

DEV = torch.device("cuda")
H_IDX, D_IDX, PAGE, TOPK = 64, 128, 64, 2048
H_MLA, D_KV, D_V = 128, 576, 512


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def paged_setup(kv_lens_per_row: list[int], seed: int, extra: int = 0):
    """A paged fp8 indexer cache with one req_to_token row per entry, pages in random order."""
    g = _gen(seed)
    width = max(kv_lens_per_row) + extra
    per_row = -(-width // PAGE)
    num_rows = len(kv_lens_per_row)
    num_pages = num_rows * per_row + 1
    cache = torch.empty(num_pages, PAGE * (D_IDX + 4), dtype=torch.uint8, device=DEV)
    keys, scales = ref.fp8_views(cache, PAGE, D_IDX)
    keys.copy_(torch.randn(num_pages, PAGE, D_IDX, device=DEV, generator=g).mul_(60).to(torch.float8_e4m3fn))
    scales.copy_(torch.exp2(torch.randint(-9, -5, (num_pages, PAGE), device=DEV, generator=g).float()))
    pages = (torch.randperm(num_pages - 1, device=DEV, generator=g) + 1)[: num_rows * per_row].view(num_rows, per_row)
    pos = torch.arange(width, device=DEV)
    r2t = (pages[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    return cache, r2t, width


def queries(num_tokens: int, seed: int):
    g = _gen(seed)
    q = torch.randn(num_tokens, H_IDX, D_IDX, device=DEV, generator=g)
    w = torch.randn(num_tokens, H_IDX, device=DEV, generator=g) * H_IDX**-0.5 * D_IDX**-0.5
    return ref.quant_index_q(q, w)


def check_logits(got: torch.Tensor, want: torch.Tensor, k: int, rows_to_check=None) -> None:
    assert not got.isnan().any()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    scale = want[fin].abs().max()
    # fp8 tensor-core products accumulate with fewer bits than fp32 (and in another order).
    assert (got[fin] - want[fin]).abs().max() <= 2e-3 * scale
    # The top-k sets they imply agree (>= 99% overlap; only near-ties may swap).
    s_got = topk.torch_topk_slots(got, k, torch.arange(got.shape[1], device=DEV, dtype=torch.int32)[None],
                                  torch.zeros(got.shape[0], dtype=torch.long, device=DEV))[1]
    s_want = ref.topk_slots(want, k, torch.arange(got.shape[1], device=DEV, dtype=torch.int32)[None],
                            torch.zeros(got.shape[0], dtype=torch.long, device=DEV))[1]
    overlap = _overlap(s_got, s_want)
    assert overlap >= 0.99, overlap


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    hits, total = 0, 0
    for x, y in zip(a.tolist(), b.tolist()):
        sx, sy = {v for v in x if v >= 0}, {v for v in y if v >= 0}
        hits += len(sx & sy)
        total += max(len(sy), 1)
    return hits / total


def _cos_sin(tokens: int, rope: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 100000, (tokens, 1), device=DEV, generator=g).float()
    freqs = pos * 10000.0 ** (-torch.arange(0, rope, 2, device=DEV).float() / rope)
    return freqs.cos() * 1.1, freqs.sin() * 1.1


def _projection(tokens: int, width: int, g: torch.Generator) -> torch.Tensor:
    """[T, width] bf16, a row-strided view of a wider projection (as the fused in_proj's parts are)."""
    wide = torch.randn(tokens, width + 64, device=DEV, generator=g) * 3
    return wide.bfloat16()[:, 64:]


def _check_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """The statistics sum in another order (and rsqrt is not rounded), so a normed value may round to the next bf16:
    mostly equal, and each row within one bf16 ulp of its norm. Not per element: where the rope (a cos - b sin) or
    the LayerNorm's bias cancels, one ulp of a term is many ulps of a value near zero (4 on an H100, 785fd6e)."""
    g, w = got.float().flatten(1), want.float().flatten(1)
    row_err = (g - w).norm(dim=1) / w.norm(dim=1).clamp_min(2.0**-126)
    equal = (g == w).float().mean()
    assert row_err.max() <= 2.0**-7 and equal >= 0.98, (row_err.max(), equal)


def _check_e4m3(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.float() - want.float()).abs()
    assert (diff > 0).float().mean() < 1e-2 and (diff <= want.float().abs() / 8 + 2**-9).all()


@pytest.mark.parametrize("tokens", [1, 32, 4096])
@pytest.mark.parametrize("fp8", [False, True])
def test_norm_rope_store_mla_real_size(tokens, fp8):
    """The MLA key finished in the store (RMSNorm + interleaved rope) == the torch reference, both cache layouts."""
    g = _gen(40 + tokens + fp8)
    num_slots = 2 * tokens + 7
    kv = _projection(tokens, D_KV, g)
    weight = (torch.rand(D_V, device=DEV, generator=g) + 0.5).bfloat16()
    cos, sin = _cos_sin(tokens, D_KV - D_V, g)
    loc = torch.randperm(num_slots, device=DEV, generator=g)[:tokens]
    got = (torch.randint(0, 256, (num_slots, ref.mla_fp8_row_bytes(D_V, D_KV - D_V)), device=DEV, generator=g,
                         dtype=torch.uint8) if fp8 else torch.randn(num_slots, D_KV, device=DEV, generator=g).bfloat16())
    want = got.clone()
    torch.ops.minidsa.norm_rope_store_mla(got, loc, kv, weight, 1e-6, cos, sin)
    ref.norm_rope_store_mla(want, loc, kv, weight, 1e-6, cos, sin)
    keep = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    keep[loc] = False
    assert torch.equal(got[keep], want[keep])
    if not fp8:
        _check_bf16(got[loc], want[loc])
        return
    g_lat, g_sc, g_rope = ref.mla_fp8_views(got, D_V)
    w_lat, w_sc, w_rope = ref.mla_fp8_views(want, D_V)
    assert torch.equal(g_sc[loc], w_sc[loc])
    _check_e4m3(g_lat[loc], w_lat[loc])
    _check_bf16(g_rope[loc], w_rope[loc])


@pytest.mark.parametrize("tokens", [1, 32, 4096])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
def test_norm_rope_store_index_k_real_size(tokens, fp8, interleaved):
    """The indexer key finished in the store (LayerNorm + rope) == the torch reference, both cache layouts."""
    g = _gen(60 + tokens + 2 * fp8 + interleaved)
    num_pages = -(-(2 * tokens + 7) // PAGE)
    k = _projection(tokens, D_IDX, g)
    weight = (torch.rand(D_IDX, device=DEV, generator=g) + 0.5).bfloat16()
    bias = (torch.randn(D_IDX, device=DEV, generator=g) * 0.2).bfloat16()
    cos, sin = _cos_sin(tokens, 64, g)
    loc = torch.randperm(num_pages * PAGE, device=DEV, generator=g)[:tokens]
    got = (torch.randint(0, 256, (num_pages, PAGE * (D_IDX + 4)), device=DEV, generator=g, dtype=torch.uint8)
           if fp8 else torch.randn(num_pages * PAGE, D_IDX, device=DEV, generator=g).bfloat16())
    want = got.clone()
    torch.ops.minidsa.norm_rope_store_index_k(got, loc, k, weight, bias, 1e-6, cos, sin, interleaved, PAGE)
    ref.norm_rope_store_index_k(want, loc, k, weight, bias, 1e-6, cos, sin, interleaved, PAGE)
    if not fp8:
        keep = torch.ones(num_pages * PAGE, dtype=torch.bool, device=DEV)
        keep[loc] = False
        assert torch.equal(got[keep], want[keep])
        _check_bf16(got[loc], want[loc])
        return
    gk, gs = ref.fp8_views(got, PAGE, D_IDX)
    wk, ws = ref.fp8_views(want, PAGE, D_IDX)
    p, o = loc // PAGE, loc % PAGE
    assert torch.equal(gs[p, o], ws[p, o])
    _check_e4m3(gk[p, o], wk[p, o])
    keep = torch.ones(num_pages * PAGE, dtype=torch.bool, device=DEV)
    keep[loc] = False
    kp, ko = keep.nonzero()[:, 0] // PAGE, keep.nonzero()[:, 0] % PAGE
    assert torch.equal(gk[kp, ko].view(torch.uint8), wk[kp, ko].view(torch.uint8))
    assert torch.equal(gs[kp, ko].view(torch.int32), ws[kp, ko].view(torch.int32))


def test_key_stores_replay_in_a_cuda_graph():
    """Both stores captured in one CUDA graph write what they write eagerly for new inputs."""
    g = _gen(80)
    tokens, num_slots = 8, 4096
    mla = torch.zeros(num_slots, ref.mla_fp8_row_bytes(D_V, 64), device=DEV, dtype=torch.uint8)
    index = torch.zeros(num_slots // PAGE, PAGE * (D_IDX + 4), device=DEV, dtype=torch.uint8)
    mla_w = (torch.rand(D_V, device=DEV, generator=g) + 0.5).bfloat16()
    norm_w, norm_b = torch.rand(D_IDX, device=DEV, generator=g).bfloat16(), torch.zeros(D_IDX, device=DEV).bfloat16()
    loc = torch.randperm(num_slots, device=DEV, generator=g)[:tokens]

    def step(kv, k, cos, sin):
        torch.ops.minidsa.norm_rope_store_mla(mla, loc, kv, mla_w, 1e-6, cos, sin)
        torch.ops.minidsa.norm_rope_store_index_k(index, loc, k, norm_w, norm_b, 1e-6, cos, sin, False, PAGE)

    def inputs():
        return (_projection(tokens, D_KV, g), _projection(tokens, D_IDX, g), *_cos_sin(tokens, 64, g))

    static = inputs()
    step(*static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*static)
    new = inputs()
    for dst, src in zip(static, new):
        dst.copy_(src)
    graph.replay()
    got_mla, got_index = mla.clone(), index.clone()
    step(*new)
    assert torch.equal(got_mla, mla) and torch.equal(got_index, index)


def rope_tables(tokens: int, rope: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos / sin [tokens, rope/2] of positions up to 128k, times a YaRN-like attention factor."""
    angles = torch.randint(0, 1 << 17, (tokens, 1), device=DEV, generator=g).float() * torch.rand(
        rope // 2, device=DEV, generator=g)
    return angles.cos() * 1.3, angles.sin() * 1.3


@pytest.mark.parametrize("interleave", [False, True])  # DeepSeek-V3.2's half-split indexer rope, GLM's
@pytest.mark.parametrize("tokens", [1, 32, 8192])
def test_quant_index_q_real_size(tokens, interleave):
    """The one-launch query rope + quantisation (bf16 queries, as the model makes them, rope on their first 64
    columns) == the torch reference, eager and replayed in a CUDA graph (tests/fp8_checks.py says how equal: the
    rope bit for bit, the kernel launched without fp contraction)."""
    g = _gen(20 + tokens)
    had = ref.hadamard_matrix(D_IDX, "cuda")

    def inputs():
        q = torch.randn(tokens, H_IDX, D_IDX, device=DEV, generator=g) * 3
        q[0, 1] = 0  # the scale floor
        q[-1, -1] *= 1e4
        w = torch.randn(tokens, H_IDX, device=DEV, generator=g)
        return (q.bfloat16(), torch.where(w == 0, 1.0, w), *rope_tables(tokens, 64, g))

    q, w, cos, sin = inputs()
    got = torch.ops.minidsa.quant_index_q(q, w, had, cos, sin, interleave)
    assert_quant_index_q_matches(q, w, got, had, rope=(cos, sin, interleave))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = torch.ops.minidsa.quant_index_q(q, w, had, cos, sin, interleave)
    fresh = inputs()
    for t, new in zip((q, w, cos, sin), fresh):
        t.copy_(new)
    graph.replay()
    assert_quant_index_q_matches(*fresh[:2], got, had, rope=(*fresh[2:], interleave))


@pytest.mark.parametrize("case", ["decode_mixed", "decode_b64_32k", "verify_tree", "prefill_chunk"])
def test_index_logits_real_size(case):
    if case == "decode_mixed":  # contexts from 1 to 128k in one batch
        lens = [1, 17, 4096, 32768, 131072, 64, 1000, 2048]
        cache, r2t, width = paged_setup(lens, 2)
        rows = torch.arange(len(lens), device=DEV)
        kv_lens = torch.tensor(lens, device=DEV)
        tree = None
    elif case == "decode_b64_32k":
        cache, r2t, width = paged_setup([32768] * 64, 3)
        rows = torch.arange(64, device=DEV)
        kv_lens = torch.randint(30000, 32769, (64,), device=DEV, generator=_gen(3))
        tree = None
    elif case == "verify_tree":  # 16 requests x 4 draft tokens, tree mask over the draft positions
        cache, r2t, width = paged_setup([8192] * 16, 4, extra=4)
        rows = torch.arange(16, device=DEV).repeat_interleave(4)
        kv_lens = torch.randint(100, 8193, (16,), device=DEV, generator=_gen(4)).repeat_interleave(4)
        tree = torch.tril(torch.ones(4, 4, dtype=torch.bool, device=DEV)).repeat(16, 1)
        tree[::3, 1] = True
    else:  # one request's 256-token prefill chunk over a 4096 context
        cache, r2t, width = paged_setup([4096], 5)
        rows = torch.zeros(256, dtype=torch.long, device=DEV)
        kv_lens = torch.arange(4096 - 255, 4097, device=DEV)
        tree = None
    q, w = queries(rows.shape[0], 6)
    want = ref.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width, tree)
    # Without the request count (one token per program), and through the op with it (pairs of tokens
    # sharing key tiles for verify; the ragged kernel over gathered keys for the one-request prefill).
    check_logits(indexer.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width, tree), want, TOPK)
    num_requests = int(rows.unique().numel())
    got = torch.ops.minidsa.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width, tree, num_requests)
    check_logits(got, want, TOPK)


def test_index_logits_bf16_cache_page_1():
    g = _gen(7)
    lens = [3000, 70, 5000]
    width = max(lens)
    cache = torch.randn(4 * width, D_IDX, device=DEV, generator=g).bfloat16()
    r2t = torch.randperm(4 * width, device=DEV, generator=g)[: 3 * width].view(3, width).int()
    rows = torch.tensor([0, 1, 2], device=DEV)
    q = torch.randn(3, H_IDX, D_IDX, device=DEV, generator=g).bfloat16()
    w = torch.rand(3, H_IDX, device=DEV, generator=g)
    kv_lens = torch.tensor(lens, device=DEV)
    got = indexer.index_logits(q, w, cache, 1, r2t, rows, kv_lens, width)
    want = ref.index_logits(q, w, cache, 1, r2t, rows, kv_lens, width)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert _rel(got[fin], want[fin]) < 1e-3


def test_ragged_index_logits_real_size():
    g = _gen(8)
    q, w = queries(256, 8)
    keys = torch.randn(8192, D_IDX, device=DEV, generator=g)
    k8, k_scale = ref.quant_fp8_ue8m0(ref.hadamard_rotate(keys))
    ks = torch.randint(0, 4096, (256,), device=DEV, generator=g)
    ke = ks + torch.randint(0, 4097, (256,), device=DEV, generator=g)
    got = indexer.ragged_index_logits(q, w, k8, ks, ke, k_scale)
    want = ref.ragged_index_logits(q, w, k8.float() * k_scale[:, None], ks, ke)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert (got[fin] - want[fin]).abs().max() <= 2e-3 * want[fin].abs().max()


@pytest.mark.parametrize("shape", [(64, 32768), (1, 131072), (1, 4160), (128, 8192), (8, 1500)])
def test_topk_triton_matches_torch(shape):
    t, width = shape
    g = _gen(9)
    logits = torch.randn(t, width, device=DEV, generator=g)
    vis = torch.randint(1, width + 1, (t,), device=DEV, generator=g)
    vis[0] = width
    logits[torch.arange(width, device=DEV)[None] >= vis[:, None]] = float("-inf")
    r2t = torch.randperm(t * width + 7, device=DEV, generator=g)[: t * width].view(t, width).int()
    rows = torch.arange(t, device=DEV)
    # default (rows split over programs at small batch), one program per row (8- and 11-bit), split x 7
    for config, chunks in ((None, None), (None, 1), ((4096, 11, 16), 1), (None, 7)):
        slots, pos = topk.topk_slots(logits, TOPK, r2t, rows, config=config, num_chunks=chunks)
        want_slots, want_pos = ref.topk_slots(logits, TOPK, r2t, rows)
        assert torch.equal(pos.sort(1).values, want_pos.sort(1).values.int())
        assert torch.equal(slots.sort(1).values, want_slots.sort(1).values)
    tslots, tpos = topk.torch_topk_slots(logits, TOPK, r2t, rows)
    assert torch.equal(tpos.sort(1).values, want_pos.sort(1).values.int())
    assert torch.equal(tslots.sort(1).values, want_slots.sort(1).values)


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("width", [4097, 4160, 5120, 2100, 8300, 10240])
def test_register_topk_two_tiles_real_size(batch, width):
    """The register select's (HEAD, TAIL) tiles (`topk.register_tiles_for`; widths just past a power of two, as a
    4096 context plus decode tokens gives) == the reference and == one power-of-two block, in a CUDA graph too."""
    head, tail = topk.register_tiles_for(width, TOPK)
    assert tail > 0 and head + tail < 1 << (width - 1).bit_length()
    g = _gen(width + batch)
    logits = torch.randn(batch, width, device=DEV, generator=g)
    vis = torch.randint(TOPK // 2, width + 1, (batch,), device=DEV, generator=g)
    vis[0] = width
    logits[torch.arange(width, device=DEV)[None] >= vis[:, None]] = float("-inf")
    logits[-1, 4000:4300] = 0.25  # ties straddling the seam at HEAD 4096 (a row of more than k visible keys)
    r2t = torch.randperm(batch * width + 7, device=DEV, generator=g)[: batch * width].view(batch, width).int()
    rows = torch.arange(batch - 1, -1, -1, device=DEV)
    slots, pos = topk.topk_slots(logits, TOPK, r2t, rows, method="register")
    want_slots, want_pos = ref.topk_slots(logits, TOPK, r2t, rows)
    assert torch.equal(pos.sort(1).values, want_pos.sort(1).values.int())
    assert torch.equal(slots.sort(1).values, want_slots.sort(1).values)
    one = topk.topk_slots(logits, TOPK, r2t, rows, method="register",
                          register_tiles=(1 << (width - 1).bit_length(), 0))
    assert torch.equal(pos, one[1]) and torch.equal(slots, one[0])  # ties alike: lowest positions, position order
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_slots, g_pos = topk.topk_slots(logits, TOPK, r2t, rows, method="register")
    logits.copy_(torch.randn(batch, width, device=DEV, generator=g))
    graph.replay()
    want_slots, want_pos = ref.topk_slots(logits, TOPK, r2t, rows)
    assert torch.equal(g_pos.sort(1).values, want_pos.sort(1).values.int())
    assert torch.equal(g_slots.sort(1).values, want_slots.sort(1).values)


@pytest.mark.parametrize("batch", [1, 2, 8, 32, 128])  # each launch_config row
def test_sparse_mla_real_size(batch):
    g = _gen(10 + batch)
    num_slots = 65536
    cache = (torch.randn(num_slots, D_KV, device=DEV, generator=g)).bfloat16()
    q = (torch.randn(batch, H_MLA, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
    idx = torch.randint(0, num_slots, (batch, TOPK), device=DEV, generator=g, dtype=torch.int32)
    idx[0, 1500:] = -1  # fewer keys than top-k
    if batch > 1:
        idx[1] = -1  # none at all: zeros
    got = sparse_mla.sparse_mla(q, cache, idx, D_KV**-0.5 * 2, D_V)
    want = ref.sparse_mla(q.float(), cache.float(), idx, D_KV**-0.5 * 2, D_V)
    assert not got.isnan().any()
    assert _rel(got, want) < 1e-2
    if batch > 1:
        assert (got[1] == 0).all()


def test_kv_move_real_size():
    g = _gen(11)
    layers, pages = 61, 64
    mla = torch.randn(layers, pages * PAGE, D_KV, device=DEV, generator=g).bfloat16()
    index = torch.randint(0, 256, (layers, pages, PAGE * (D_IDX + 4)), device=DEV, generator=g, dtype=torch.uint8)
    perm = torch.randperm(pages * PAGE, device=DEV, generator=g)[:513]
    src, dst = perm[:512], perm[1:]  # chained: move i writes the source of move i + 1
    want_mla, want_index = mla.clone(), index.clone()
    ref.kv_move(list(want_mla.unbind(0)), list(want_index.unbind(0)), src, dst, PAGE, D_IDX)
    kv_move.kv_move(mla, index, src, dst, PAGE, D_IDX)
    assert torch.equal(mla, want_mla) and torch.equal(index, want_index)


def test_decode_ops_compile_and_cuda_graph():
    """Custom ops under torch.compile (inductor) and inside a captured CUDA graph give the eager result."""
    from minidsa.attention.backend import bind_ops
    from minidsa.attention.select import KernelChoice

    ops = bind_ops(KernelChoice("triton", "triton", "triton", "triton", "triton"))
    cache, r2t, width = paged_setup([9000] * 8, 12)
    rows = torch.arange(8, device=DEV)
    kv_lens = torch.full((8,), 9000, device=DEV)
    q, w = queries(8, 12)
    mla = torch.randn(cache.shape[0] * PAGE, D_KV, device=DEV).bfloat16()
    qm = torch.randn(8, H_MLA, D_KV, device=DEV).bfloat16()

    def step(q, w, kv_lens, qm):
        logits = ops.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width, None)
        slots, _ = ops.topk(logits, TOPK, r2t, rows)
        return ops.sparse_mla(qm, mla, slots, 0.05, D_V)

    eager = step(q, w, kv_lens, qm)
    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(q, w, kv_lens, qm), eager)
    static = [x.clone() for x in (q, w, kv_lens, qm)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    q2, w2 = queries(8, 13)
    static[0].copy_(q2)
    static[1].copy_(w2)
    graph.replay()
    torch.testing.assert_close(out, step(q2, w2, kv_lens, qm))


def test_deepgemm_and_triton_select_the_same_topk():
    module, status = deepgemm.probe(DEV)
    if not status.available:
        pytest.skip(f"DeepGEMM not usable here: {status.reason}")
    cache, r2t, width = paged_setup([32768] * 16, 14)
    rows = torch.arange(16, device=DEV)
    kv_lens = torch.randint(20000, 32769, (16,), device=DEV, generator=_gen(14))
    q, w = queries(16, 14)
    # raises LibraryCallFailed (naming DeepGEMM's error) if the build fails the call
    dg = deepgemm.paged_index_logits(module, q, w, cache, PAGE, r2t, rows, kv_lens, width)
    tr = indexer.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width)
    assert _overlap(topk.topk_slots(dg, TOPK, r2t, rows)[0], topk.topk_slots(tr, TOPK, r2t, rows)[0]) >= 0.99


@pytest.mark.parametrize("tokens", [1, 31, 32, 33, 200, 1000, 4099])
def test_own_paged_schedule_is_what_deepgemm_computes(tokens):
    """minidsa computes the paged kernel's schedule itself (DeepGEMM's metadata kernel compiles per batch size
    class); the handle's start-up check compared a sample, this checks batch sizes across classes against the
    library."""
    module, status = deepgemm.probe(DEV)
    if not status.available:
        pytest.skip(f"DeepGEMM not usable here: {status.reason}")
    handle = deepgemm.DeepGEMM(module, status, DEV, check_schedule=True)
    assert handle.own_schedule(PAGE), f"the start-up check found DeepGEMM's schedule different: {handle.failures}"
    num_sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    lens = torch.randint(0, 70000, (tokens,), device=DEV, generator=_gen(tokens))
    lens[::7] = torch.randint(0, 300, lens[::7].shape, device=DEV, generator=_gen(tokens + 1))
    ctx = deepgemm.context_lens_2d(lens)
    want = module.get_paged_mqa_logits_metadata(ctx, PAGE, num_sms)
    assert torch.equal(deepgemm.paged_schedule(ctx, num_sms), want)


@pytest.mark.parametrize("tokens", [1, 32, 8192])
@pytest.mark.parametrize("groups,topk_group", [(8, 4), (1, 1)])  # DeepSeek-V3.2, GLM-5
def test_router_real_size(tokens, groups, topk_group):
    """The one-launch router == the torch reference at 256 experts, top 8; under a CUDA graph too."""
    from minidsa.kernels import router
    g = torch.Generator(device="cuda").manual_seed(tokens + groups)
    logits = torch.randn(tokens, 256, device="cuda", generator=g) * 2
    bias = torch.randn(256, device="cuda", generator=g) * 0.05
    want_ids, want_w = ref.route(logits, bias, 8, groups, topk_group, True, 2.5)
    ids, w = torch.ops.minidsa.route(logits, bias, 8, groups, topk_group, True, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gids, gw = router.route(logits, bias, 8, groups, topk_group, True, 2.5)
    logits.copy_(torch.randn(tokens, 256, device="cuda", generator=g))
    graph.replay()
    want_ids, want_w = ref.route(logits, bias, 8, groups, topk_group, True, 2.5)
    assert torch.equal(gids, want_ids)
    torch.testing.assert_close(gw, want_w, rtol=1e-5, atol=1e-6)


def _check_absorbed(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 roundings of fp32 sums taken in other orders (cuBLAS's, the kernel's): at most one bf16 spacing
    apart (a bit more where the sum cancels to near 0), and mostly equal."""
    assert got.shape == want.shape and got.dtype == want.dtype and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3 * want.abs().max().item())
    assert (got == want).float().mean() >= 0.9


@pytest.mark.parametrize("tokens", [1, 32])
def test_mla_absorb_real_size(tokens):
    """MLA's absorbed W_UK / W_UV products (one launch each) == their references at DeepSeek-V3.2's 128 heads
    (nope = v = 128, L = 512, rope 64), on the model's views; eager and in a CUDA graph. The query rope columns
    bit for bit (the kernel launched without fp contraction)."""
    from minidsa.kernels import mla_absorb
    g = _gen(tokens + 11)
    heads, nope, v, latent, rope = 128, 128, 128, 512, 64
    q = torch.randn(tokens, heads, nope + rope, device=DEV, generator=g).bfloat16()
    kv_b = (torch.randn(heads * (nope + v), latent, device=DEV, generator=g) * latent**-0.5).bfloat16()
    w = kv_b.view(heads, nope + v, latent)
    q_nope, q_rope, w_uk, w_uv = q[..., :nope], q[..., nope:], w[:, :nope], w[:, nope:]
    o_latent = torch.randn(tokens, heads, latent, device=DEV, generator=g).bfloat16()
    cos, sin = rope_tables(tokens, rope, g)

    def check(q_full: torch.Tensor, o: torch.Tensor) -> None:
        want_q = mla_absorb.absorb_q_reference(q_nope, q_rope, w_uk, cos, sin)
        assert torch.equal(q_full[..., latent:], want_q[..., latent:])
        _check_absorbed(q_full, want_q)
        _check_absorbed(o, mla_absorb.absorb_o_reference(o_latent, w_uv))

    check(torch.ops.minidsa.absorb_q(q_nope, q_rope, w_uk, cos, sin), torch.ops.minidsa.absorb_o(o_latent, w_uv))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_q = torch.ops.minidsa.absorb_q(q_nope, q_rope, w_uk, cos, sin)
        g_o = torch.ops.minidsa.absorb_o(o_latent, w_uv)
    q.copy_(torch.randn(q.shape, device=DEV, generator=g))
    o_latent.copy_(torch.randn(o_latent.shape, device=DEV, generator=g))
    for t, new in zip((cos, sin), rope_tables(tokens, rope, g)):
        t.copy_(new)
    graph.replay()
    check(g_q, g_o)


@pytest.mark.parametrize("tokens", [1, 2, 4, 16])  # the kernel up to MAX_TOKENS (4), cuBLAS at 16
@pytest.mark.parametrize("n", [64, 256])
def test_fp32_gemv_real_size(tokens, n):
    """The fp32 GEMV (kernels/gemv.py) at DeepSeek-V3.2's shapes (hidden 7168; N = 64 indexer head weights with
    their scale, 256 router experts), bf16 x as a row-strided view: within 1e-5 of sum_k |x_k w_nk| of cuBLAS's
    fp32 result (two fp32 sums in different orders); the same bits on every call, eager, in a CUDA graph and
    under torch.compile; every split-K arrival count back at 0."""
    from minidsa.kernels import fp8_gemm, gemv
    g = _gen(tokens * n)
    k, scale = 7168, (64**-0.5 * 128**-0.5 if n == 64 else 1.0)
    wide = torch.randn(tokens, k + 64, device=DEV, generator=g).bfloat16()
    x = wide[:, :k]
    w = torch.randn(n, k, device=DEV, generator=g) * k**-0.5

    def check(got: torch.Tensor) -> None:
        want = gemv.fp32_gemv_reference(x, w, scale)
        terms = (x.float().abs() @ w.abs().T) * scale
        assert got.shape == want.shape and got.dtype == torch.float32 and not got.isnan().any()
        assert ((got - want).abs() <= 1e-5 * terms).all(), ((got - want).abs() / terms).max().item()

    first = torch.ops.minidsa.fp32_gemv(x, w, scale)
    check(first)
    outs = [torch.ops.minidsa.fp32_gemv(x, w, scale) for _ in range(100)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for o in outs)
    assert int(fp8_gemm.arrival_counts(DEV).abs().sum()) == 0
    compiled = torch.compile(lambda a: torch.ops.minidsa.fp32_gemv(a, w, scale), fullgraph=True)
    assert torch.equal(compiled(x), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_y = torch.ops.minidsa.fp32_gemv(x, w, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_y, first)
    wide.copy_(torch.randn(wide.shape, device=DEV, generator=g))
    graph.replay()
    check(g_y)
    assert torch.equal(g_y, torch.ops.minidsa.fp32_gemv(x, w, scale))
    assert int(fp8_gemm.arrival_counts(DEV).abs().sum()) == 0


@pytest.mark.parametrize("tokens,requests,tree_width", [(1, 1, 0), (64, 64, 0), (256, 64, 4), (4099, 3, 0)])
def test_deepgemm_step_inputs_real_size(tokens, requests, tree_width):
    """DeepGEMM's per-step inputs in one launch (kernels/deepgemm_step.py) equal the torch reference (rows, lengths,
    block table, schedule) at an H100's SM count and contexts up to 128k, in a CUDA graph too."""
    from minidsa.kernels import deepgemm_step

    g = _gen(tokens + requests)
    width = 131072
    r2t = torch.randint(0, 1 << 22, (requests + 2, width), device=DEV, generator=g, dtype=torch.int32)
    req_pool_indices = torch.randperm(requests + 2, device=DEV, generator=g)[:requests]
    token_req = torch.randint(0, requests, (tokens,), device=DEV, generator=g).sort().values
    kv_lens = torch.randint(1, width, (tokens,), device=DEV, generator=g)
    num_sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    args = (r2t, req_pool_indices, token_req, kv_lens, tree_width, width, PAGE, num_sms)
    want = deepgemm_step.step_inputs_reference(*args)
    for got in (deepgemm_step.step_inputs(*args), torch.ops.minidsa.deepgemm_step_inputs(*args)):
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.minidsa.deepgemm_step_inputs(*args)
    kv_lens.copy_(torch.randint(1, width, (tokens,), device=DEV, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, deepgemm_step.step_inputs_reference(*args)))


@pytest.mark.parametrize("hidden", [7168, 6144])
@pytest.mark.parametrize("rows", [None, [0], [5, 1, 5]])
def test_rmsnorm_rows_real_size(hidden, rows):
    """The norms outside the layers in one launch: the layers' fused norm's values (`rmsnorm_quant`), within the
    rounding of the reference's."""
    from minidsa.kernels import norm_quant

    g = _gen(hidden)
    x = torch.randn(8, hidden, device=DEV, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device=DEV, generator=g)).bfloat16()
    idx = None if rows is None else torch.tensor(rows, device=DEV)
    got = torch.ops.minidsa.rmsnorm_rows(x, w, 1e-6, idx)
    fused = norm_quant.rmsnorm_quant(x, w, 1e-6)[1]
    assert torch.equal(got, fused if idx is None else fused[idx])
    want = norm_quant.rmsnorm_rows_reference(x, w, 1e-6, idx)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
