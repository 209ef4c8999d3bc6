"""Writing the MLA cache in FP8 (FlashMLA's 656-byte layout): quantise inside the store kernel.

One program stores BLOCK_T tokens: per group of 128 latent values an fp32
power-of-two scale (ue8m0, from the exponent bits, so the reference's
`quant_fp8_ue8m0` gives the same bytes), the e4m3 latent, and the rope part
in bf16. Layout and reference: `reference.mla_fp8_views` / `store_mla`.
"""

from __future__ import annotations

import torch

from minidsa.kernels import reference as ref
from minidsa.kernels.indexer import _pow2_scale, _round_to_e4m3
from minidsa.kernels.triton_compat import tl, triton


@triton.jit
def _round_to_bf16(x):
    """Round finite fp32 to the nearest bf16 (ties to even), still as fp32: the later cast is then exact on
    every backend (the Triton interpreter's bf16 cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_mla_fp8_kernel(
    kv_ptr, loc_ptr, latent_ptr, scale_ptr, rope_ptr,
    num_tokens, stride_kv, row_bytes,
    L: tl.constexpr, R: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    loc = tl.load(loc_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    src = kv_ptr + rows.to(tl.int64)[:, None] * stride_kv
    j = tl.arange(0, GROUP)
    for g in tl.static_range(L // GROUP):
        x = tl.load(src + g * GROUP + j[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        scale, inv = _pow2_scale(tl.max(tl.abs(x), axis=1))
        y = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
        y8 = _round_to_e4m3(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(latent_ptr + loc[:, None] * row_bytes + g * GROUP + j[None, :], y8, mask=row_ok[:, None])
        tl.store(scale_ptr + loc * (row_bytes // 4) + g, scale, mask=row_ok)
    r = tl.arange(0, R)
    x = tl.load(src + L + r[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(rope_ptr + loc[:, None] * (row_bytes // 2) + r[None, :], _round_to_bf16(x).to(tl.bfloat16),
             mask=row_ok[:, None])


def store_mla(cache: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor, latent_dim: int) -> None:
    """Write rows `kv [T, L + R]` at slots `loc [T]` of one layer's MLA cache: quantised into the FP8 layout
    (uint8 cache [S, bytes]), or as is (a model-dtype cache)."""
    if kv.dim() != 2 or loc.dim() != 1 or loc.shape[0] != kv.shape[0]:
        raise ValueError(f"store_mla: want kv [T, L + R] and loc [T], got {tuple(kv.shape)} and {tuple(loc.shape)}")
    if cache.dtype != torch.uint8:
        cache[loc] = kv.to(cache.dtype)
        return
    num_tokens, width = kv.shape
    rope = width - latent_dim
    group = ref.mla_fp8_group(latent_dim)
    row_bytes = ref.mla_fp8_row_bytes(latent_dim, rope)
    if cache.dim() != 2 or cache.shape[1] != row_bytes or cache.stride(1) != 1 or cache.stride(0) != row_bytes:
        raise ValueError(f"store_mla: FP8 MLA cache must be contiguous [slots, {row_bytes}] uint8 for latent "
                         f"{latent_dim} + rope {rope}, got {tuple(cache.shape)}")
    if group & (group - 1) or rope & (rope - 1) or latent_dim % group:
        raise ValueError(f"store_mla: latent {latent_dim} (groups of {group}) and rope {rope} must be powers of two")
    if num_tokens == 0:
        return
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    block_t = 16
    scale_end = latent_dim + 4 * (latent_dim // group)
    _store_mla_fp8_kernel[(triton.cdiv(num_tokens, block_t),)](
        kv, loc, cache, cache.view(torch.float32)[:, latent_dim // 4:], cache.view(torch.bfloat16)[:, scale_end // 2:],
        num_tokens, kv.stride(0), row_bytes,
        L=latent_dim, R=rope, GROUP=group, BLOCK_T=block_t, num_warps=4,
    )
