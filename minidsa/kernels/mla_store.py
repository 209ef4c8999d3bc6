"""Writing the MLA cache: the key finished (norm, rope) and stored in one launch, in either cache layout.

One program stores BLOCK_T tokens from the raw projection `kv [T, L + R]`: the latent RMSNorm'd (a first pass
over it for the statistic), the rope part rotated (`reference.rope_interleaved`'s [evens | odds] layout), then
either the rows as they are (a model-dtype cache) or FlashMLA's FP8 layout: per group of 128 latent values an
fp32 power-of-two scale (ue8m0, from the exponent bits, so the reference's `quant_fp8_ue8m0` gives the same
bytes), the e4m3 latent, and the rope part in bf16. Layout and reference: `reference.mla_fp8_views` /
`norm_rope_store_mla`.
"""

from __future__ import annotations

import torch

from minidsa.kernels import reference as ref
from minidsa.kernels.indexer import _pow2_scale, _round_to, _round_to_bf16, _round_to_e4m3, rounding
from minidsa.kernels.rope import rope_sources, rotate_pairs
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton


# The row count is not specialised on: each divisibility class would be a variant compiled at start-up.
@triton.jit(do_not_specialize=["num_tokens"])
def _norm_rope_store_mla_kernel(
    kv_ptr, w_ptr, cos_ptr, sin_ptr, loc_ptr, cache_ptr, scale_ptr, rope_ptr,
    num_tokens, stride_kv, stride_cs, stride_cache, eps,
    L: tl.constexpr, R: tl.constexpr, R_BLOCK: tl.constexpr, CHUNK: tl.constexpr, FP8: tl.constexpr,
    ROUND_KV: tl.constexpr, ROUND_LATENT: tl.constexpr, ROUND_CACHE: tl.constexpr, BLOCK_T: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """FP8: cache_ptr / scale_ptr / rope_ptr are the layout's latent bytes, scales and rope views of the uint8 cache
    (stride_cache: its row bytes); else cache_ptr is the [slots, L + R] cache (stride_cache: its row stride)."""
    wait_for_producers(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    loc = tl.load(loc_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    src = kv_ptr + rows.to(tl.int64)[:, None] * stride_kv
    j = tl.arange(0, CHUNK)
    sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for c in tl.static_range((L + CHUNK - 1) // CHUNK):
        col = c * CHUNK + j
        x = tl.load(src + col[None, :], mask=row_ok[:, None] & (col < L)[None, :], other=0.0).to(tl.float32)
        sum_sq += tl.sum(x * x, axis=1)
    # rsqrt as torch's takes it on CUDA; 1 / L is exact where L is a power of two (512 on the real models).
    # div_rn / sqrt_rn compile to calls whose ABI caps a kernel's registers (the indexer key's store spilled 9 KB a
    # thread with them).
    rstd = tl.math.rsqrt(sum_sq * (1.0 / L) + eps)
    for c in tl.static_range((L + CHUNK - 1) // CHUNK):
        col = c * CHUNK + j
        col_ok = col < L
        x = tl.load(src + col[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
        # reference.rms_norm: normalised in kv's dtype, times the weight in the promoted one
        y = _round_to(w[None, :] * _round_to(x * rstd[:, None], ROUND_KV), ROUND_LATENT)
        if FP8:  # CHUNK is the scale group here
            scale, inv = _pow2_scale(tl.max(tl.abs(y), axis=1))
            y = tl.minimum(tl.maximum(y * inv[:, None], -448.0), 448.0)
            y8 = _round_to_e4m3(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(cache_ptr + loc[:, None] * stride_cache + col[None, :], y8, mask=row_ok[:, None])
            tl.store(scale_ptr + loc * (stride_cache // 4) + c, scale, mask=row_ok)
        else:
            tl.store(cache_ptr + loc[:, None] * stride_cache + col[None, :],
                     _round_to(y, ROUND_CACHE).to(cache_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])
    r = tl.arange(0, R_BLOCK)
    r_ok = r < R
    # built in the rotated layout's order (`rope.rope_sources`): output column r reads a = x[src_a], b = x[src_b]
    src_a, src_b, first, pair = rope_sources(r, R, True)
    mask = row_ok[:, None] & r_ok[None, :]
    a = tl.load(src + L + src_a[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + L + src_b[None, :], mask=mask, other=0.0).to(tl.float32)
    cs_off = rows.to(tl.int64)[:, None] * stride_cs + pair[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs_off, mask=mask, other=0.0).to(tl.float32)
    k_rope = _round_to(rotate_pairs(a, b, first[None, :], cos, sin), ROUND_KV)
    if FP8:
        tl.store(rope_ptr + loc[:, None] * (stride_cache // 2) + r[None, :], _round_to_bf16(k_rope).to(tl.bfloat16),
                 mask=mask)
    else:
        tl.store(cache_ptr + loc[:, None] * stride_cache + L + r[None, :],
                 _round_to(k_rope, ROUND_CACHE).to(cache_ptr.dtype.element_ty), mask=mask)


def norm_rope_store_mla(cache: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`reference.norm_rope_store_mla` in one launch: MLA keys from the raw projection `kv [T, L + R]` (rows may be
    strided; L = norm_weight's size) at slots `loc [T]` of one layer's cache, quantised into the FP8 layout
    (uint8 cache [S, bytes]), or rows of the cache's dtype [S, L + R]."""
    if kv.dim() != 2 or loc.dim() != 1 or loc.shape[0] != kv.shape[0] or norm_weight.dim() != 1:
        raise ValueError(f"norm_rope_store_mla: want kv [T, L + R], loc [T] and norm weight [L], got "
                         f"{tuple(kv.shape)}, {tuple(loc.shape)} and {tuple(norm_weight.shape)}")
    num_tokens, width = kv.shape
    latent_dim = norm_weight.shape[0]
    rope = width - latent_dim
    if rope <= 0 or rope % 2 or cos.shape != (num_tokens, rope // 2) or sin.shape != cos.shape:
        raise ValueError(f"norm_rope_store_mla: kv [{num_tokens}, {width}] after a latent of {latent_dim} leaves "
                         f"an odd or empty rope part, or cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} do not "
                         f"match it")
    fp8 = cache.dtype == torch.uint8
    if fp8:
        chunk = ref.mla_fp8_group(latent_dim)
        row_bytes = ref.mla_fp8_row_bytes(latent_dim, rope)
        if cache.dim() != 2 or cache.shape[1] != row_bytes or cache.stride(1) != 1 or cache.stride(0) != row_bytes:
            raise ValueError(f"norm_rope_store_mla: FP8 MLA cache must be contiguous [slots, {row_bytes}] uint8 for "
                             f"latent {latent_dim} + rope {rope}, got {tuple(cache.shape)}")
        if chunk & (chunk - 1) or latent_dim % chunk:
            raise ValueError(f"norm_rope_store_mla: latent {latent_dim} must be whole groups of {chunk}, a power "
                             f"of two")
    else:
        chunk = min(128, triton.next_power_of_2(latent_dim))
        if cache.dim() != 2 or cache.shape[1] != width or cache.stride(1) != 1:
            raise ValueError(f"norm_rope_store_mla: MLA cache must be [slots, {width}], got {tuple(cache.shape)}")
    if num_tokens == 0:
        return
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    if cos.stride() != sin.stride() or cos.stride(1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    latent_out = torch.promote_types(norm_weight.dtype, kv.dtype)
    if fp8:
        scale_end = latent_dim + 4 * (latent_dim // chunk)
        views = (cache, cache.view(torch.float32)[:, latent_dim // 4:], cache.view(torch.bfloat16)[:, scale_end // 2:])
    else:
        views = (cache, cache, cache)
    block_t = 16
    _norm_rope_store_mla_kernel[(triton.cdiv(num_tokens, block_t),)](
        kv, norm_weight, cos, sin, loc, *views,
        num_tokens, kv.stride(0), cos.stride(0), cache.stride(0), eps,
        L=latent_dim, R=rope, R_BLOCK=triton.next_power_of_2(rope), CHUNK=chunk, FP8=fp8,
        ROUND_KV=rounding(kv.dtype, "norm_rope_store_mla"), ROUND_LATENT=rounding(latent_out, "norm_rope_store_mla"),
        ROUND_CACHE=0 if fp8 else rounding(cache.dtype, "norm_rope_store_mla"), BLOCK_T=block_t, num_warps=4,
        **pdl_launch(kv.device),
    )
