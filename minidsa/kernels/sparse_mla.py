"""Sparse MLA attention in Triton: MQA over the latent cache rows each token selected.

q [T, H, Dk] (Dk = v_dim + rope, 576 on the real models) against
kv_cache[topk[t, :]] ([S, Dk], -1 = no key), output [T, H, v_dim] in q's
dtype. The value is the first v_dim columns of the same cache row, so one
gathered tile feeds both products. fp32 online softmax (base 2). When T is
small the top-k axis is split across programs and a second kernel merges the
partial results by their log-sum-exp.

The cache is either in q's dtype or (uint8) the FP8 layout
(`reference.mla_fp8_views`: e4m3 latent, an fp32 scale per 128 values, bf16
rope): each gathered tile is dequantised to q's dtype in registers, so the
products and the softmax are the same code for both layouts.
"""

from __future__ import annotations


import torch

from minidsa.kernels import num_sms
from minidsa.kernels import reference as ref
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, scale_ptr, rope_ptr, idx_ptr, out_ptr, lse_ptr,
    num_heads, topk, split_len, qk_scale,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_os, stride_lt, stride_ls,
    DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    OFFSET_64: tl.constexpr, IS_FP8: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr = False,
):
    # IS_FP8: kv_ptr is the cache's bytes (row stride_kv bytes, e4m3 latent first); scale_ptr / rope_ptr are
    # fp32 / bf16 views of the same rows starting at their parts (row strides stride_kv / 4, / 2).
    wait_for_producers(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.program_id(2)
    h_ok = h < num_heads
    dv = tl.arange(0, DV)
    dr = tl.arange(0, DR)
    nn = tl.arange(0, BLOCK_N)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_nope = tl.load(q_row + dv[None, :], mask=h_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + DV + dr[None, :], mask=h_ok[:, None], other=0.0)
    m = tl.full((BLOCK_H,), -1e30, tl.float32)  # finite start: exp2 of all-masked blocks stays 0, never NaN
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, DV), tl.float32)
    k_start = sp * split_len
    k_end = tl.minimum(k_start + split_len, topk)
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    for start in range(k_start, k_end, BLOCK_N):
        n = start + nn
        idx = tl.load(idx_row + n, mask=n < k_end, other=-1)
        valid = idx >= 0
        # -1 reads slot 0 (a real row; its score is -inf below): unmasked loads need fewer registers.
        if OFFSET_64:
            row_off = tl.where(valid, idx, 0).to(tl.int64) * stride_kv
        else:
            row_off = tl.where(valid, idx, 0) * stride_kv
        if IS_FP8:
            k8 = tl.load(kv_ptr + row_off[:, None] + dv[None, :])
            kf = k8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            # [BLOCK_N, DV / GROUP] scales, broadcast over each group through a reshape of the tile (a scale
            # load per element instead ran 10x slower on an H100 and overflowed shared memory at this tile:
            # benchmarks/kernels/mla_fp8_h100_3ba324f.json).
            sc = tl.load(scale_ptr + (row_off // 4)[:, None] + tl.arange(0, DV // GROUP)[None, :])
            kf = tl.reshape(tl.reshape(kf, (BLOCK_N, DV // GROUP, GROUP)) * sc[:, :, None], (BLOCK_N, DV))
            k_nope = kf.to(q_nope.dtype)
            k_rope = tl.load(rope_ptr + (row_off // 2)[:, None] + dr[None, :]).to(q_rope.dtype)
        else:
            rows = kv_ptr + row_off[:, None]
            k_nope = tl.load(rows + dv[None, :])
            k_rope = tl.load(rows + DV + dr[None, :])
        s = tl.dot(q_nope, tl.trans(k_nope))
        s = tl.dot(q_rope, tl.trans(k_rope), s)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_nope.dtype), k_nope, acc)
        m = m_new
    if SPLIT:
        # Partial result normalised by its own sum, with its log2-sum-exp (-inf when it saw no key).
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + sp * stride_os + dv[None, :],
                 o, mask=h_ok[:, None])
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + sp * stride_ls + h, lse, mask=h_ok)
    else:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]  # rows with no valid key give zeros
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_ls, stride_ot, stride_oh,
    DV: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    s_ok = s < num_splits
    lse = tl.load(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + h, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - tl.where(mx > float("-inf"), mx, 0.0)), 0.0)
    total = tl.sum(w, axis=0)
    w = w / tl.where(total > 0, total, 1.0)
    dv = tl.arange(0, DV)
    part = tl.load(part_ptr + t.to(tl.int64) * stride_pt + h * stride_ph + s[:, None] * stride_ps + dv[None, :],
                   mask=s_ok[:, None], other=0.0)
    o = tl.sum(part * w[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + dv, o.to(out_ptr.dtype.element_ty))


# (BLOCK_H, BLOCK_N, num_warps, num_stages), set from measurements on H100 (benchmarks/kernels/KERNELS.md).
SPARSE_MLA_CONFIG = (64, 64, 8, 2)
# The bf16 cache at decode sizes (bench_mla.py --only small, H100, 128 heads, top-k 2048, us per call in CUDA graphs;
# benchmarks/kernels/mla_small_h100_54a21fb.md): one token 17.8 -> 12.9 with 16-head tiles at 4 warps (twice the
# programs, each with fewer registers); 16 / 32 tokens 66.6 -> 59.6 / 108.5 -> 104.1 with 32-head tiles; at 4 tokens the
# default was fastest. The FP8 cache kept its default at every one of these sizes.
SPARSE_MLA_SMALL_CONFIGS = ((2, (16, 64, 4, 2)), (15, SPARSE_MLA_CONFIG), (32, (32, 64, 4, 2)))
# The FP8 cache's launch parameters. Measured on an H100 (benchmarks/scripts/bench_mla.py, commit b19a8d1, B=128,
# 128 heads, top-k 2048): (64, 64, 8, 2) 0.371 ms = 197 TFLOP/s (the bf16 cache: 178); (64, 32, 8, 3) 144.
SPARSE_MLA_FP8_CONFIG = (64, 64, 8, 2)


def triton_unsupported(num_heads: int, dk: int, v_dim: int, dtype: torch.dtype) -> str | None:
    """Why the Triton kernel cannot take queries of this shape (None: it can). A pure function of static sizes.

    fp32 is the parity / debug dtype: the kernel's tiles are sized for 2-byte inputs and a [heads x 512] fp32
    tile of real models overflows shared memory, so fp32 at that size runs the reference."""
    rope = dk - v_dim
    if v_dim & (v_dim - 1) or rope & (rope - 1) or rope < 16:
        return f"latent {v_dim} + rope {rope}: the Triton kernel needs powers of two, rope >= 16"
    if dtype == torch.float32 and num_heads * dk > 16384:
        return f"{num_heads} heads x {dk} in float32: the Triton kernel needs 2-byte inputs at this size"
    return None


def launch_config(num_tokens: int, is_fp8: bool) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) for this many query tokens over this cache layout, as measured."""
    if is_fp8:
        return SPARSE_MLA_FP8_CONFIG
    for max_tokens, config in SPARSE_MLA_SMALL_CONFIGS:
        if num_tokens <= max_tokens:
            return config
    return SPARSE_MLA_CONFIG


def sparse_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    sm_scale: float,
    v_dim: int,
    num_splits: int | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """q [T, H, Dk] x kv_cache [S, Dk] at topk_slots [T, K] (-1 = none) -> [T, H, v_dim] (q's dtype).

    kv_cache: [S, Dk] in q's dtype, or uint8 [S, bytes] in the FP8 layout (latent = v_dim)."""
    num_tokens, num_heads, dk = q.shape
    topk = topk_slots.shape[1]
    rope = dk - v_dim
    is_fp8 = kv_cache.dtype == torch.uint8
    group = ref.mla_fp8_group(v_dim)
    width = ref.mla_fp8_row_bytes(v_dim, rope) if is_fp8 else dk
    if kv_cache.dim() != 2 or kv_cache.shape[1] != width or kv_cache.stride(1) != 1:
        raise ValueError(f"sparse_mla: cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not hold rows of "
                         f"{width} {'bytes (FP8 layout)' if is_fp8 else 'values'} for query width {dk}")
    if v_dim & (v_dim - 1) or rope & (rope - 1) or rope < 16:
        raise ValueError(f"sparse_mla: v_dim ({v_dim}) and rope dim ({rope}) must be powers of two (rope >= 16)")
    if topk_slots.shape[0] != num_tokens:
        raise ValueError(f"sparse_mla: topk_slots has {topk_slots.shape[0]} rows for {num_tokens} tokens")
    if not is_fp8 and kv_cache.dtype != q.dtype:
        raise ValueError(f"sparse_mla: q is {q.dtype} but the cache is {kv_cache.dtype}")
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if topk == 0:
        return out.zero_()
    q = q if q.stride(2) == 1 else q.contiguous()
    block_h, block_n, num_warps, num_stages = config or launch_config(num_tokens, is_fp8)
    block_h = min(block_h, max(16, triton.next_power_of_2(num_heads)))
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        # Split the top-k axis to about two programs per SM, each split >= 4 blocks. H100: batch 64 is fastest
        # with 2 splits (0.185 ms; 1: 0.191, 3: 0.204, 4: 0.222), batch 128 with 1 or 2 (0.385 ms), batch 8
        # with 9 (0.062 ms) rather than 16 (0.100 ms).
        # Batch 1-4 (in-graph profile, bench-dsv32 decode): 8 splits of 4 blocks left a 1-token step at
        # 23 us; splits of 2 blocks give it twice the programs.
        want = round(2 * num_sms(q.device) / (num_tokens * head_blocks))
        min_blocks = 4 if num_tokens >= 8 else 2
        num_splits = max(1, min(want, topk // (min_blocks * block_n)))
    split_len = triton.cdiv(triton.cdiv(topk, num_splits), block_n) * block_n
    num_splits = triton.cdiv(topk, split_len)
    qk_scale = sm_scale * LOG2E
    offset_64 = kv_cache.numel() * kv_cache.element_size() >= 2**31  # 32-bit row offsets save registers
    grid = (num_tokens, head_blocks, num_splits)
    if is_fp8:
        if kv_cache.stride(0) % 4:
            raise ValueError(f"sparse_mla: FP8 cache rows must be whole 32-bit words, got {kv_cache.stride(0)} bytes")
        scale_end = v_dim + 4 * (v_dim // group)
        parts = (kv_cache.view(torch.float32)[:, v_dim // 4:], kv_cache.view(torch.bfloat16)[:, scale_end // 2:])
    else:
        parts = (kv_cache, kv_cache)  # unused
    if num_splits == 1:
        _sparse_mla_kernel[grid](
            q, kv_cache, *parts, topk_slots, out, out,
            num_heads, topk, split_len, qk_scale,
            q.stride(0), q.stride(1), kv_cache.stride(0), topk_slots.stride(0),
            out.stride(0), out.stride(1), 0, 0, 0,
            DV=v_dim, DR=rope, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=False, OFFSET_64=offset_64,
            IS_FP8=is_fp8, GROUP=group,
            num_warps=num_warps, num_stages=num_stages, **pdl_launch(q.device),
        )
        return out
    part = torch.empty(num_tokens, num_heads, num_splits, v_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, num_splits, num_heads, dtype=torch.float32, device=q.device)
    _sparse_mla_kernel[grid](
        q, kv_cache, *parts, topk_slots, part, lse,
        num_heads, topk, split_len, qk_scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), topk_slots.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        DV=v_dim, DR=rope, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=True, OFFSET_64=offset_64,
        IS_FP8=is_fp8, GROUP=group,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(q.device),
    )
    _combine_kernel[(num_tokens, num_heads)](
        part, lse, out, num_splits,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        DV=v_dim, SPLITS=triton.next_power_of_2(num_splits), num_warps=4, **pdl_launch(part.device),
    )
    return out
