"""Triton kernels for the lightning indexer: key store, query quantisation, paged logits, ragged (prefill) logits.

Same contracts as `minidsa.kernels.reference` (the oracle):
- `norm_rope_store_index_k`: the key from its raw projection (LayerNorm, rope),
  Hadamard-rotated, e4m3 with a power-of-two fp32 scale per token, written into
  DeepGEMM's paged layout at `loc` (a page's `page_size * D` key bytes, then
  its `page_size` fp32 scales), or as is into a model-dtype cache.
- `index_logits`: `[T, max_kv_len]` fp32, `sum_h w[t,h] * relu(q[t,h] . k[p]) * scale[p]`
  over the positions of token t's req_to_token row, -inf where invisible
  (`p >= kv_lens[t]` and not set in the tree mask).
- `ragged_index_logits`: row i scores keys `[ks[i], ke[i])` of one contiguous
  key tensor (DeepGEMM's `fp8_mqa_logits` contract).
- `quant_index_q`: the queries' side of the fp8 cache (their rope, then the key
  store's rotation and scales, per (token, head)), the scale folded into the head
  weights.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from minidsa.kernels import reference as ref
from minidsa.kernels.rope import load_rope_leading, rope_sources, rotate_pairs
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

FP8_MAX = ref.FP8_MAX


# ---------------------------------------------------------------------------
# fp8 helpers
# ---------------------------------------------------------------------------
@triton.jit
def _pow2_scale(amax):
    """(scale, 1/scale) with scale = 2^ceil(log2(amax / 448)), from the exponent bits (exact)."""
    r = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)
    bits = r.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _round_to_e4m3(y):
    """Round fp32 in [-448, 448] to the nearest e4m3 value (ties to even), still as fp32.

    Done by hand so the later cast is exact on every backend (the Triton
    interpreter's float8 cast mis-rounds when the carry bumps the exponent).
    """
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 a)
    step_log2 = tl.maximum(e, -6) - 3  # e4m3: 3 mantissa bits, subnormal below 2^-6
    magic = ((step_log2 + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic  # fp32 add rounds to a multiple of 2^step_log2 (RNE)
    return tl.where(y < 0, -r, r)


# ---------------------------------------------------------------------------
# Hadamard + e4m3: the fp8 cache's keys and the queries scored against them
@triton.jit
def _rotate_e4m3(x, had_ptr, D: tl.constexpr):
    """[rows, D] -> (e4m3 bytes as uint8, fp32 power-of-two scale per row): the Hadamard rotation in fp32, then the
    fp8 cache's quantisation. Keys (`store_index_k`) and queries (`quant_index_q`) take the same steps."""
    d = tl.arange(0, D)
    had = tl.load(had_ptr + d[:, None] * D + d[None, :])
    if x.dtype == tl.bfloat16:
        # The matrix is +-h (h = D^-0.5): bf16 x times the signs is exact, summed in fp32 on tensor cores, then one
        # multiply by h, where the reference rounds each x * h before its sum (a few fp32 ulps apart). The fp32
        # dot is FMAs on CUDA cores whose operand tiles, after a norm or a rope in the same kernel, spilled.
        signs = tl.where(had > 0, 1.0, -1.0).to(tl.bfloat16)
        y = tl.dot(x, signs) * tl.abs(tl.load(had_ptr))
    else:
        y = tl.dot(x.to(tl.float32), had, input_precision="ieee")
    scale, inv = _pow2_scale(tl.max(tl.abs(y), axis=1))
    y = tl.minimum(tl.maximum(y * inv[:, None], -448.0), 448.0)
    return _round_to_e4m3(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True), scale


# ---------------------------------------------------------------------------
# The keys' prologue (norm, rope), done by the store kernels (here and in mla_store.py): each reads the raw
# projection and writes the finished key, so no step launches kernels of its own for one token's keys.
# ---------------------------------------------------------------------------
# Which rounding `_round_to` applies: the float dtypes the references round through.
ROUNDING = MappingProxyType({torch.float32: 0, torch.bfloat16: 1, torch.float16: 2})


def rounding(dtype: torch.dtype, what: str) -> int:
    if dtype not in ROUNDING:
        raise ValueError(f"{what}: want fp32 / bf16 / fp16, got {dtype}")
    return ROUNDING[dtype]


@triton.jit
def _round_to_bf16(x):
    """Round finite fp32 to the nearest bf16 (ties to even), still as fp32: the later cast is then exact on
    every backend (the Triton interpreter's bf16 cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to(x, ROUND: tl.constexpr):
    """fp32 rounded as a torch cast to the dtype of `ROUNDING` code ROUND would, still as fp32: the references
    round there (each op's result in its input's dtype), and a cast of the result to that dtype is then exact."""
    if ROUND == 1:
        x = _round_to_bf16(x)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


# ---------------------------------------------------------------------------
# norm_rope_store_index_k
# ---------------------------------------------------------------------------
# Row / pair counts are not specialised on: each divisibility class would be a variant compiled at start-up.
@triton.jit(do_not_specialize=["num_tokens"])
def _norm_rope_store_index_k_kernel(
    k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, loc_ptr, had_ptr, cache_ptr, scale_ptr,
    num_tokens, stride_k, stride_cs, stride_cache, eps,
    D: tl.constexpr, R: tl.constexpr, INTERLEAVED: tl.constexpr, ROUND_K: tl.constexpr, FP8: tl.constexpr,
    ROUND_CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False,
):
    """BLOCK_T keys: LayerNorm, rope on the first R dims, then Hadamard + e4m3 into the paged fp8 cache (FP8), or
    the key as is into a [slots, D] cache. stride_cache: the cache's row (page or slot) stride, in its elements."""
    wait_for_producers(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    d = tl.arange(0, D)
    src = k_ptr + rows.to(tl.int64)[:, None] * stride_k
    x = tl.load(src + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    # F.layer_norm's statistics: mean, then the biased variance about it, in fp32 (1 / D is exact: D is a power of
    # two). rsqrt as torch's CUDA kernel takes it; div_rn / sqrt_rn compile to calls whose ABI capped the kernel at
    # 32 registers (a 7 KB stack a thread).
    mean = tl.sum(x, axis=1) * (1.0 / D)
    xc = x - mean[:, None]
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) * (1.0 / D) + eps)
    # The key is built in its output order (the rotated layout), so the Hadamard reads it as it is: output column
    # c is a * cos -/+ b * sin of the normed columns a = src_a[c], b = src_b[c] (`rope.rope_sources`). A permuted
    # Hadamard instead kept the matrix out of the dot's shared-memory path (ptxas spilled 9 KB a thread; its timing:
    # benchmarks/kernels/NOTES.md).
    src_a, src_b, first, pair = rope_sources(d, R, INTERLEAVED)
    in_rope = d < R
    ya = _layer_norm_at(src, src_a, w_ptr, b_ptr, mean, rstd, row_ok, tl.full((D,), True, tl.int1), ROUND_K)
    yb = _layer_norm_at(src, src_b, w_ptr, b_ptr, mean, rstd, row_ok, in_rope, ROUND_K)
    cs_mask = row_ok[:, None] & in_rope[None, :]
    cs_off = rows.to(tl.int64)[:, None] * stride_cs + pair[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0).to(tl.float32)
    key = tl.where(in_rope[None, :], _round_to(rotate_pairs(ya, yb, first[None, :], cos, sin), ROUND_K), ya)
    loc = tl.load(loc_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    if FP8:
        z8, scale = _rotate_e4m3(key.to(tl.bfloat16) if ROUND_K == 1 else key, had_ptr, D)
        page = loc // PAGE_SIZE
        off = loc % PAGE_SIZE
        tl.store(cache_ptr + page[:, None] * stride_cache + off[:, None] * D + d[None, :], z8, mask=row_ok[:, None])
        tl.store(scale_ptr + page * (stride_cache // 4) + PAGE_SIZE * D // 4 + off, scale, mask=row_ok)
    else:
        key = _round_to(key, ROUND_CACHE)
        tl.store(cache_ptr + loc[:, None] * stride_cache + d[None, :], key.to(cache_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _layer_norm_at(src, cols, w_ptr, b_ptr, mean, rstd, row_ok, col_ok, ROUND: tl.constexpr):
    """The LayerNorm'd values of columns `cols` of rows `src` (statistics given), rounded to the input's dtype."""
    x = tl.load(src + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return _round_to((x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :], ROUND)


def norm_rope_store_index_k(index_k: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, norm_weight: torch.Tensor,
                            norm_bias: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                            interleaved: bool, page_size: int) -> None:
    """`reference.norm_rope_store_index_k` in one launch: keys from the raw projection `k [T, D]` (rows may be
    strided), LayerNorm'd and rotated, then Hadamard + e4m3 into the paged fp8 cache, or as they are into a
    model-dtype cache [slots, D]."""
    if k.dim() != 2 or loc.dim() != 1 or loc.shape[0] != k.shape[0]:
        raise ValueError(f"norm_rope_store_index_k: want k [T, D] and loc [T], got {tuple(k.shape)} and {tuple(loc.shape)}")
    num_tokens, d = k.shape
    rope = 2 * cos.shape[-1]
    if d & (d - 1) or d < 16 or rope > d:
        raise ValueError(f"norm_rope_store_index_k: head dim must be a power of two >= 16 and hold the rope's {rope}, got {d}")
    if cos.shape != (num_tokens, rope // 2) or sin.shape != cos.shape or norm_weight.shape != (d,) or \
            norm_bias.shape != (d,):
        raise ValueError(f"norm_rope_store_index_k: want cos / sin [{num_tokens}, {rope // 2}] and norm weight / bias [{d}], "
                         f"got {tuple(cos.shape)}, {tuple(sin.shape)}, {tuple(norm_weight.shape)}, "
                         f"{tuple(norm_bias.shape)}")
    fp8 = index_k.dtype == torch.uint8
    if fp8 and (index_k.dim() != 2 or index_k.shape[1] != page_size * (d + 4) or index_k.stride(1) != 1):
        raise ValueError(f"norm_rope_store_index_k: fp8 cache must be [pages, {page_size * (d + 4)}] uint8, got {tuple(index_k.shape)}")
    if not fp8 and (index_k.dim() != 2 or index_k.shape[1] != d or index_k.stride(1) != 1):
        raise ValueError(f"norm_rope_store_index_k: cache must be [slots, {d}], got {tuple(index_k.shape)}")
    if num_tokens == 0:
        return
    if k.stride(1) != 1:
        k = k.contiguous()
    if cos.stride() != sin.stride() or cos.stride(1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    block_t = 16  # tl.dot's fewest rows
    _norm_rope_store_index_k_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, norm_weight, norm_bias, cos, sin, loc, ref.hadamard_matrix(d, str(k.device)) if fp8 else k,
        index_k, index_k.view(torch.float32) if fp8 else index_k,
        num_tokens, k.stride(0), cos.stride(0), index_k.stride(0), eps,
        D=d, R=rope, INTERLEAVED=interleaved, ROUND_K=rounding(k.dtype, "norm_rope_store_index_k"), FP8=fp8,
        ROUND_CACHE=0 if fp8 else rounding(index_k.dtype, "norm_rope_store_index_k"), PAGE_SIZE=page_size,
        BLOCK_T=block_t, num_warps=8, **pdl_launch(k.device),
    )


# ---------------------------------------------------------------------------
# quant_index_q
# ---------------------------------------------------------------------------
# The row count is not specialised on: each divisibility class would be a variant compiled at start-up.
@triton.jit(do_not_specialize=["num_rows"])
def _quant_index_q_kernel(
    q_ptr, w_ptr, had_ptr, cos_ptr, sin_ptr, q8_ptr, w_out_ptr,
    num_rows, stride_qt, stride_qh, stride_wt, stride_wh, stride_ct,
    H: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: BLOCK_M (token, head) rows of q, row r = token r // H, head r % H (tiles may span tokens)."""
    wait_for_producers(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    t = (rows // H).to(tl.int64)
    h = rows % H
    d = tl.arange(0, D)
    q_rows = q_ptr + t * stride_qt + h * stride_qh
    if ROPE > 0:
        # rounded to q's dtype, as the torch rope hands its result on
        x = load_rope_leading(q_rows, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, row_ok, d, D, ROPE,
                              INTERLEAVE).to(q_ptr.dtype.element_ty)
    else:
        x = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    y8, scale = _rotate_e4m3(x, had_ptr, D)
    tl.store(q8_ptr + rows.to(tl.int64)[:, None] * D + d[None, :], y8, mask=row_ok[:, None])
    w = tl.load(w_ptr + t * stride_wt + h * stride_wh, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + rows, w * scale, mask=row_ok)


def quant_unsupported(head_dim: int) -> str | None:
    """Why the query quantisation kernel cannot take this head dim (None: it can). A pure function of static sizes."""
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head dim {head_dim}: the Triton kernel needs a power of two >= 16"
    return None


def _quant_tiles(num_rows: int) -> tuple[int, int]:
    """(BLOCK_M, num_warps) for T * H rows: the rotation's fp32 FMAs bound each program, so decode spreads over the
    most programs (16 rows, the fewest tl.dot takes) while they fit one wave; past that, larger tiles load the
    Hadamard matrix fewer times. The timings behind it (H200, H = 64, D = 128): benchmarks/kernels/NOTES.md."""
    if num_rows <= 2048:
        return 16, 8
    if num_rows <= 4096:
        return 32, 8
    return 64, 8


def quant_index_q(q: torch.Tensor, weights: torch.Tensor, hadamard: torch.Tensor | None = None,
                  cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                  rope_interleave: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries for the fp8 cache, `reference.quant_index_q`'s contract: q [T, H, D] rotated by its rope
    (cos / sin [T, rope/2], where given), Hadamard-rotated, e4m3 per (token, head) with a power-of-two scale, the
    scale folded into weights [T, H] -> (e4m3 [T, H, D], fp32 [T, H])."""
    if q.dim() != 3 or weights.dim() != 2 or weights.shape != q.shape[:2]:
        raise ValueError(f"quant_index_q: want q [T, H, D] and weights [T, H], got {tuple(q.shape)} and "
                         f"{tuple(weights.shape)}")
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if q.dtype not in floats or weights.dtype not in floats:
        raise ValueError(f"quant_index_q: want fp32 / bf16 / fp16 q and weights, got {q.dtype} and {weights.dtype}")
    num_tokens, num_heads, head_dim = q.shape
    why_not = quant_unsupported(head_dim)
    if why_not is not None:
        raise ValueError(f"quant_index_q: {why_not}")
    if hadamard is None:
        hadamard = ref.hadamard_matrix(head_dim, str(q.device))
    elif hadamard.shape != (head_dim, head_dim) or hadamard.dtype != torch.float32:
        raise ValueError(f"quant_index_q: want a [{head_dim}, {head_dim}] fp32 Hadamard matrix, got "
                         f"{tuple(hadamard.shape)} {hadamard.dtype}")
    rope_dim = 0
    if cos is not None:
        rope_dim = 2 * cos.shape[-1]
        if cos.dim() != 2 or cos.shape[0] != num_tokens or sin is None or sin.shape != cos.shape \
                or rope_dim > head_dim:
            raise ValueError(f"quant_index_q: want cos / sin [{num_tokens}, rope/2] with rope <= {head_dim}, got "
                             f"{tuple(cos.shape)} and {None if sin is None else tuple(sin.shape)}")
        if cos.stride() != sin.stride() or cos.stride(1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
    q8 = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float8_e4m3fn, device=q.device)
    scaled_weights = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return q8, scaled_weights
    if q.stride(2) != 1:
        q = q.contiguous()
    block_m, num_warps = _quant_tiles(num_rows)
    _quant_index_q_kernel[(triton.cdiv(num_rows, block_m),)](
        q, weights, hadamard.contiguous(), q if cos is None else cos, q if sin is None else sin, q8.view(torch.uint8),
        scaled_weights, num_rows, q.stride(0), q.stride(1), weights.stride(0), weights.stride(1),
        0 if cos is None else cos.stride(0),
        H=num_heads, D=head_dim, ROPE=rope_dim, INTERLEAVE=rope_interleave, BLOCK_M=block_m, num_warps=num_warps,
        enable_fp_fusion=False, **pdl_launch(q.device),  # the rope as torch rounds it (kernels/rope.py)
    )
    return q8, scaled_weights


# ---------------------------------------------------------------------------
# paged index logits (decode / verify / draft-extend / extend)
# ---------------------------------------------------------------------------
@triton.jit
def _load_keys(keys_ptr, scale_ptr, r2t_row_ptr, start, kmask, key_stride, page_words,
               PAGE_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr):
    """Keys [BLOCK_N, D] and scales [BLOCK_N] of row positions start + [0, BLOCK_N) (through req_to_token)."""
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    if IS_FP8 and PAGE_SIZE % BLOCK_N == 0:
        # The block lies inside one page and a page's slots are consecutive: one table read, contiguous bytes.
        slot = tl.load(r2t_row_ptr + start).to(tl.int64) + n
    else:
        slot = tl.load(r2t_row_ptr + start + n, mask=kmask, other=0).to(tl.int64)
    if IS_FP8:
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        k = tl.load(keys_ptr + page[:, None] * key_stride + off[:, None] * D + d[None, :], mask=kmask[:, None], other=0)
        k = k.to(tl.float8e4nv, bitcast=True)
        sc = tl.load(scale_ptr + page * page_words + PAGE_SIZE * D // 4 + off, mask=kmask, other=0.0)
    else:
        k = tl.load(keys_ptr + slot[:, None] * key_stride + d[None, :], mask=kmask[:, None], other=0.0)
        sc = tl.full((BLOCK_N,), 1.0, tl.float32)
    return k, sc


@triton.jit
def _visible(pos, kv_len, tree_ptr, tree_w, HAS_TREE: tl.constexpr):
    vis = pos < kv_len
    if HAS_TREE:
        rel = pos - kv_len
        in_tree = (rel >= 0) & (rel < tree_w)
        vis = vis | (tl.load(tree_ptr + rel, mask=in_tree, other=0) != 0)
    return vis


@triton.jit
def _paged_logits_kernel(
    q_ptr, w_ptr, keys_ptr, scale_ptr, r2t_ptr, rows_ptr, kv_lens_ptr, tree_ptr, out_ptr,
    num_tokens, max_kv_len, chunk_len,
    stride_qt, stride_qh, stride_wt, stride_r2t, stride_tree, tree_w, stride_ot,
    key_stride, page_words,
    H: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr,
    HAS_TREE: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: GROUP consecutive query tokens x one chunk of key positions.

    Keys are the M side of the product ([BLOCK_N, D] x [D, heads]), so the sum
    over heads stays inside each warp. When the GROUP tokens share a
    req_to_token row (prefill, verify), each key tile is loaded once for all of
    them; otherwise (decode) the tokens are done one after another.
    """
    wait_for_producers(PDL)
    t0 = tl.program_id(0) * GROUP
    c_start = tl.program_id(1) * chunk_len
    c_end = tl.minimum(c_start + chunk_len, max_kv_len)
    n = tl.arange(0, BLOCK_N)
    hd = tl.arange(0, H)
    d = tl.arange(0, D)
    t_last = tl.minimum(t0 + GROUP, num_tokens) - 1
    row0 = tl.load(rows_ptr + t0)
    # Always true when GROUP == 1: the grouped branch is then the plain per-token kernel.
    grouped = (t_last == t0 + GROUP - 1) & (tl.load(rows_ptr + t_last) == row0)
    if grouped:
        gi = tl.arange(0, GROUP)
        rr = tl.arange(0, GROUP * H)  # column r = token t0 + r // H, head r % H
        q = tl.load(q_ptr + (t0 + rr // H)[:, None] * stride_qt + (rr % H)[:, None] * stride_qh + d[None, :])
        w = tl.load(w_ptr + (t0 + rr // H) * stride_wt + rr % H)
        kv_len = tl.load(kv_lens_ptr + t0 + gi)
        vis_end = kv_len
        if HAS_TREE:
            vis_end = vis_end + tree_w
        stop = tl.minimum(tl.max(vis_end, axis=0), c_end)
        r2t_row = r2t_ptr + row0.to(tl.int64) * stride_r2t
        out_rows = out_ptr + (t0 + gi)[None, :].to(tl.int64) * stride_ot
        for start in range(c_start, stop, BLOCK_N):
            pos = start + n
            k, sc = _load_keys(keys_ptr, scale_ptr, r2t_row, start, pos < stop, key_stride, page_words,
                               PAGE_SIZE, D, BLOCK_N, IS_FP8)
            s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, GROUP*H]
            s = tl.maximum(s, 0.0) * w[None, :]
            logit = tl.sum(tl.reshape(s, (BLOCK_N, GROUP, H)), axis=2) * sc[:, None]  # [BLOCK_N, GROUP]
            vis = pos[:, None] < kv_len[None, :]
            if HAS_TREE:
                rel = pos[:, None] - kv_len[None, :]
                in_tree = (rel >= 0) & (rel < tree_w)
                tb = tl.load(tree_ptr + (t0 + gi)[None, :] * stride_tree + rel, mask=in_tree, other=0)
                vis = vis | (tb != 0)
            logit = tl.where(vis, logit, float("-inf"))
            tl.store(out_rows + pos[:, None], logit, mask=pos[:, None] < c_end)
        tail = c_start + tl.cdiv(tl.maximum(stop - c_start, 0), BLOCK_N) * BLOCK_N
        for start in range(tail, c_end, BLOCK_N):
            pos = start + n
            neg = tl.full((BLOCK_N, GROUP), float("-inf"), tl.float32)
            tl.store(out_rows + pos[:, None], neg, mask=pos[:, None] < c_end)
    else:
        for g in tl.static_range(GROUP):
            t = t0 + g
            if t < num_tokens:
                q = tl.load(q_ptr + t * stride_qt + hd[:, None] * stride_qh + d[None, :])
                w = tl.load(w_ptr + t * stride_wt + hd)
                kv_len = tl.load(kv_lens_ptr + t)
                vis_end = kv_len
                if HAS_TREE:
                    vis_end = vis_end + tree_w
                stop = tl.minimum(vis_end, c_end)
                row = tl.load(rows_ptr + t).to(tl.int64)
                r2t_row = r2t_ptr + row * stride_r2t
                out_row = out_ptr + t.to(tl.int64) * stride_ot
                for start in range(c_start, stop, BLOCK_N):
                    pos = start + n
                    k, sc = _load_keys(keys_ptr, scale_ptr, r2t_row, start, pos < stop, key_stride, page_words,
                                       PAGE_SIZE, D, BLOCK_N, IS_FP8)
                    s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, H]
                    logit = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * sc
                    vis = _visible(pos, kv_len, tree_ptr + t * stride_tree, tree_w, HAS_TREE)
                    tl.store(out_row + pos, tl.where(vis, logit, float("-inf")), mask=pos < c_end)
                tail = c_start + tl.cdiv(tl.maximum(stop - c_start, 0), BLOCK_N) * BLOCK_N
                for start in range(tail, c_end, BLOCK_N):
                    pos = start + n
                    tl.store(out_row + pos, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=pos < c_end)


@triton.jit
def _mask_logits_kernel(
    src_ptr, out_ptr, kv_lens_ptr, tree_ptr, width, stride_src, stride_out, stride_tree, tree_w,
    HAS_TREE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    """out[t, p] = src[t, p] where visible, else -inf (for kernels that leave invisible logits undefined)."""
    wait_for_producers(PDL)
    t = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = pos < width
    kv_len = tl.load(kv_lens_ptr + t)
    vis = _visible(pos, kv_len, tree_ptr + t * stride_tree, tree_w, HAS_TREE)
    x = tl.load(src_ptr + t.to(tl.int64) * stride_src + pos, mask=inb & vis, other=float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * stride_out + pos, x, mask=inb)


@triton.jit
def _mask_invisible_inplace_kernel(
    logits_ptr, kv_lens_ptr, tree_ptr, width, stride_l, stride_tree, tree_w,
    HAS_TREE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    """logits[t, p] = -inf where p is invisible to token t; blocks wholly inside the visible prefix touch nothing."""
    wait_for_producers(PDL)
    t = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    kv_len = tl.load(kv_lens_ptr + t)
    if start + BLOCK > kv_len:
        pos = start + tl.arange(0, BLOCK)
        vis = _visible(pos, kv_len, tree_ptr + t * stride_tree, tree_w, HAS_TREE)
        tl.store(logits_ptr + t.to(tl.int64) * stride_l + pos, float("-inf"), mask=(pos < width) & ~vis)


def mask_invisible_(logits: torch.Tensor, kv_lens: torch.Tensor, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """In place: every invisible position of `logits [T, W]` (any row stride) set to -inf; returns `logits`.

    Writes only the invisible tail of each row (reads nothing): the cost of DeepGEMM's undefined tail.
    """
    num_tokens, width = logits.shape
    if num_tokens == 0 or width == 0:
        return logits
    tree = _tree_arg(tree_mask, kv_lens)
    block = 1024
    _mask_invisible_inplace_kernel[(num_tokens, triton.cdiv(width, block))](
        logits, kv_lens, tree, width, logits.stride(0), tree.stride(0),
        0 if tree_mask is None else tree_mask.shape[1], HAS_TREE=tree_mask is not None, BLOCK=block, num_warps=4,
        **pdl_launch(logits.device),
    )
    return logits


def mask_invisible(logits: torch.Tensor, kv_lens: torch.Tensor, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """Contiguous copy of `logits [T, W]` (any row stride) with every invisible position set to -inf."""
    num_tokens, width = logits.shape
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=logits.device)
    if num_tokens == 0 or width == 0:
        return out
    tree = _tree_arg(tree_mask, kv_lens)
    block = 1024
    _mask_logits_kernel[(num_tokens, triton.cdiv(width, block))](
        logits, out, kv_lens, tree, width, logits.stride(0), out.stride(0),
        tree.stride(0), 0 if tree_mask is None else tree_mask.shape[1],
        HAS_TREE=tree_mask is not None, BLOCK=block, num_warps=4, **pdl_launch(logits.device),
    )
    return out


def _tree_arg(tree_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The tree mask as the kernels read it (uint8 bytes); without one, `like`: any valid pointer, unread without
    HAS_TREE (a fresh zero tensor here was one fill kernel per indexer layer of every step)."""
    if tree_mask is None:
        return like
    return tree_mask.contiguous().view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for bf16/fp8 operands


# (GROUP, BLOCK_N, num_warps, num_stages) of the paged kernel, from measurements on H100
# (benchmarks/kernels/KERNELS.md): one token per program (decode: 0.137 ms at batch 64 x 32k, prefill chunks), two
# tokens per program when a request has a few tokens sharing its row (verify 16 x 4 tokens: 0.088 vs 0.099 ms).
PAGED_CONFIG = (1, 128, 4, 3)
GROUPED_CONFIG = (2, 64, 4, 3)
GROUPED_MAX_TOKENS_PER_REQUEST = 8


def triton_unsupported(num_heads: int, head_dim: int) -> str | None:
    """Why the paged kernel cannot take queries of this shape (None: it can). A pure function of static sizes."""
    if num_heads & (num_heads - 1) or head_dim & (head_dim - 1) or head_dim < 16:
        return f"{num_heads} heads x {head_dim}: the Triton kernel needs powers of two, head dim >= 16"
    return None


def index_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    page_size: int,
    req_to_token: torch.Tensor,
    token_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    tree_mask: torch.Tensor | None = None,
    num_requests: int = 0,
    chunk_len: int | None = None,
    config: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged indexer logits [T, max_kv_len] fp32 (-inf where invisible); see the module docstring.

    `num_requests`: how many req_to_token rows the tokens come from (0 = unknown); with several
    tokens per row, consecutive tokens share each key tile. `chunk_len` (key positions per
    program) and `config` override the tuned launch parameters.
    """
    num_tokens, num_heads, head_dim = q.shape
    is_fp8 = index_k.dtype == torch.uint8
    if is_fp8 and q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"index_logits: the fp8 indexer cache needs e4m3 queries (quant_index_q), got {q.dtype}")
    if is_fp8 and index_k.shape[-1] != page_size * (head_dim + 4):
        raise ValueError(f"index_logits: fp8 cache rows hold {index_k.shape[-1]} bytes, want {page_size * (head_dim + 4)}")
    if not is_fp8 and index_k.shape[-1] != head_dim:
        raise ValueError(f"index_logits: cache head dim {index_k.shape[-1]} != query head dim {head_dim}")
    if weights.shape != (num_tokens, num_heads):
        raise ValueError(f"index_logits: weights {tuple(weights.shape)} != [T, H] = {(num_tokens, num_heads)}")
    why_not = triton_unsupported(num_heads, head_dim)
    if why_not is not None:
        raise ValueError(f"index_logits: {why_not}")
    if out is None:
        out = torch.empty(num_tokens, max_kv_len, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or max_kv_len == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    weights = weights.float()
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    shared_rows = num_requests > 0 and 2 * num_requests <= num_tokens <= GROUPED_MAX_TOKENS_PER_REQUEST * num_requests
    group, block_n, num_warps, num_stages = config or (GROUPED_CONFIG if shared_rows else PAGED_CONFIG)
    group = max(1, min(group, 128 // num_heads))
    if chunk_len is None:
        # At least ~2048 programs, each 2 to 8 key blocks (H100, batch 64 x 32k: 1024-key chunks 0.137 ms,
        # 4096-key chunks 0.157 ms; batch 1 x 128k: 512 programs 0.038 ms, 128 programs 0.066 ms).
        groups = triton.cdiv(num_tokens, group)
        chunk_len = triton.next_power_of_2(triton.cdiv(max_kv_len * groups, 2048))
        chunk_len = min(max(chunk_len, block_n * 2), block_n * 8)
    chunk_len = triton.cdiv(chunk_len, block_n) * block_n
    tree = _tree_arg(tree_mask, kv_lens)
    scales = index_k.view(torch.float32) if is_fp8 else index_k
    grid = (triton.cdiv(num_tokens, group), triton.cdiv(max_kv_len, chunk_len))
    _paged_logits_kernel[grid](
        q, weights, index_k, scales, req_to_token, token_rows, kv_lens, tree, out,
        num_tokens, max_kv_len, chunk_len,
        q.stride(0), q.stride(1), weights.stride(0), req_to_token.stride(0), tree.stride(0),
        0 if tree_mask is None else tree_mask.shape[1], out.stride(0),
        index_k.stride(0), index_k.stride(0) // 4 if is_fp8 else 0,
        H=num_heads, D=head_dim, PAGE_SIZE=page_size, IS_FP8=is_fp8, HAS_TREE=tree_mask is not None,
        GROUP=group, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps,
        num_stages=num_stages, **pdl_launch(q.device),
    )
    return out


# ---------------------------------------------------------------------------
# ragged (prefill) logits over contiguous keys
# ---------------------------------------------------------------------------
@triton.jit
def _ragged_logits_kernel(
    q_ptr, w_ptr, k_ptr, ks_scale_ptr, ks_ptr, ke_ptr, out_ptr,
    num_q, num_kv, stride_qt, stride_qh, stride_wt, stride_k, stride_ot, chunk_len,
    H: tl.constexpr, D: tl.constexpr, IS_FP8: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program: GROUP query rows x one chunk of keys; each key tile serves all GROUP rows."""
    wait_for_producers(PDL)
    t0 = tl.program_id(0) * GROUP
    c_start = tl.program_id(1) * chunk_len
    c_end = tl.minimum(c_start + chunk_len, num_kv)
    gi = tl.arange(0, GROUP)
    rr = tl.arange(0, GROUP * H)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    t_ok = (t0 + gi) < num_q
    r_ok = (t0 + rr // H) < num_q
    q = tl.load(q_ptr + (t0 + rr // H)[:, None] * stride_qt + (rr % H)[:, None] * stride_qh + d[None, :],
                mask=r_ok[:, None], other=0)
    if IS_FP8:  # e4m3 tensors arrive as their bytes
        q = q.to(tl.float8e4nv, bitcast=True)
    w = tl.load(w_ptr + (t0 + rr // H) * stride_wt + rr % H, mask=r_ok, other=0.0)
    ks = tl.load(ks_ptr + t0 + gi, mask=t_ok, other=0)
    ke = tl.load(ke_ptr + t0 + gi, mask=t_ok, other=0)
    lo = tl.maximum(tl.min(tl.where(t_ok & (ke > ks), ks, num_kv), axis=0), c_start)
    hi = tl.minimum(tl.max(tl.where(t_ok, ke, 0), axis=0), c_end)
    out_rows = out_ptr + (t0 + gi)[None, :].to(tl.int64) * stride_ot
    neg = tl.full((BLOCK_N, GROUP), float("-inf"), tl.float32)
    # Key blocks before the first visible one, then the visible span, then the rest.
    first = c_start + (tl.maximum(lo - c_start, 0) // BLOCK_N) * BLOCK_N
    for start in range(c_start, first, BLOCK_N):
        pos = start + n
        tl.store(out_rows + pos[:, None], neg, mask=t_ok[None, :] & (pos[:, None] < c_end))
    for start in range(first, hi, BLOCK_N):
        pos = start + n
        kmask = pos < hi
        k = tl.load(k_ptr + pos[:, None].to(tl.int64) * stride_k + d[None, :], mask=kmask[:, None], other=0)
        if IS_FP8:
            k = k.to(tl.float8e4nv, bitcast=True)
        s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, GROUP*H]
        s = tl.maximum(s, 0.0) * w[None, :]
        logit = tl.sum(tl.reshape(s, (BLOCK_N, GROUP, H)), axis=2)
        if IS_FP8:
            logit = logit * tl.load(ks_scale_ptr + pos, mask=kmask, other=0.0)[:, None]
        inside = (pos[:, None] >= ks[None, :]) & (pos[:, None] < ke[None, :])
        logit = tl.where(inside, logit, float("-inf"))
        tl.store(out_rows + pos[:, None], logit, mask=t_ok[None, :] & (pos[:, None] < c_end))
    tail = first + tl.cdiv(tl.maximum(hi - first, 0), BLOCK_N) * BLOCK_N
    for start in range(tail, c_end, BLOCK_N):
        pos = start + n
        tl.store(out_rows + pos[:, None], neg, mask=t_ok[None, :] & (pos[:, None] < c_end))


def ragged_index_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    key_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill form: row i scores keys [ks[i], ke[i]) of `keys [S_kv, D]` -> [S, S_kv] fp32, -inf outside.

    `keys` is full precision, or e4m3 with `key_scales [S_kv]` fp32 (then `q` is e4m3 too).
    """
    num_q, num_heads, head_dim = q.shape
    num_kv = keys.shape[0]
    if keys.shape[1] != head_dim:
        raise ValueError(f"ragged_index_logits: key dim {keys.shape[1]} != query head dim {head_dim}")
    fp8 = keys.dtype == torch.float8_e4m3fn
    if fp8 != (key_scales is not None) or fp8 != (q.dtype == torch.float8_e4m3fn):
        raise ValueError("ragged_index_logits: e4m3 keys need e4m3 queries and key_scales, and only they")
    if num_heads & (num_heads - 1) or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"ragged_index_logits: heads ({num_heads}) and head dim ({head_dim}) must be powers of two")
    out = torch.empty(num_q, num_kv, dtype=torch.float32, device=q.device)
    if num_q == 0 or num_kv == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    weights = weights.float().contiguous()
    group = max(1, min(4, 128 // num_heads))
    block_n = 64
    chunk_len = min(block_n * 32, max(block_n * 4, triton.next_power_of_2(
        triton.cdiv(num_kv * triton.cdiv(num_q, group), 2048))))
    grid = (triton.cdiv(num_q, group), triton.cdiv(num_kv, chunk_len))
    _ragged_logits_kernel[grid](
        q.view(torch.uint8) if fp8 else q, weights, keys.view(torch.uint8) if fp8 else keys,
        key_scales if fp8 else weights, ks.int(), ke.int(), out,
        num_q, num_kv, q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), out.stride(0), chunk_len,
        H=num_heads, D=head_dim, IS_FP8=fp8, GROUP=group, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=4, **pdl_launch(q.device),
    )
    return out


def extend_index_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    page_size: int,
    req_to_token: torch.Tensor,
    token_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
) -> torch.Tensor:
    """index_logits for tokens of ONE request (no tree): its keys gathered contiguous, then the ragged kernel.

    Row t covers keys [0, kv_lens[t]), so the output is already [T, max_kv_len] by position. The Triton
    counterpart of DeepGEMM's prefill path; not served by default (the paged kernel measured faster
    than gather + ragged on H100, benchmarks/kernels/KERNELS.md).
    """
    # index_select, not req_to_token[token_rows[0]]: a tensor-scalar index syncs the host (breaks graph capture)
    slots = req_to_token.index_select(0, token_rows[:1])[0, :max_kv_len]
    ks = torch.zeros_like(kv_lens, dtype=torch.int32)
    if index_k.dtype == torch.uint8:
        k8, k_scale = gather_index_k(index_k, slots, page_size, q.shape[2])
        return ragged_index_logits(q, weights, k8, ks, kv_lens, k_scale)
    return ragged_index_logits(q, weights, index_k[slots.long()], ks, kv_lens)


def gather_index_k(index_k: torch.Tensor, slots: torch.Tensor, page_size: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous (e4m3 keys [N, D], fp32 scales [N]) at `slots` of a paged fp8 cache (prefill's ragged input)."""
    keys, scales = ref.fp8_views(index_k, page_size, head_dim)
    page, off = slots.long() // page_size, slots.long() % page_size
    return keys[page, off].contiguous(), scales[page, off].contiguous()
