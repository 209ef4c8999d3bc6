"""RMSNorm (optionally after a residual add) and the FP8 per-token-group quantisation of its output, in one launch,
or the same launch without the quantisation (`add_rmsnorm`, for the decoder norms no FP8 linear reads); and the
plain RMSNorm of some rows (`rmsnorm_rows`), for the norms outside the decoder layers.

`reference.rmsnorm_quant` is the contract: `h = x + residual` (rounded to x's dtype, as the model's `h = h + a`),
`normed = weight * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)` (the model's RMSNorm), and the e4m3 values + fp32
scales `fp8.quant_act_per_token_group(normed)` gives (one scale per token per 128 channels, amax / 448).

Why: an FP8 linear after a norm quantises the norm's output again: the fused MoE in a launch of its own at every
size, the w8a8 GEMM in a launch of its own above 64 rows, DeepGEMM's GEMM always (`fp8_gemm.quant_act`). Here the
norm's program quantises the row it already holds, in DeepGEMM's layout (`fp8_gemm.act_buffers`: rows padded to
16, MN-major scales) where DeepGEMM serves the linears reading it, so that it reads them as they are (at decode
sizes its row class is the padded count; the dense MLP's gate|up at batch 1 of bench-dsv32 re-quantised its input
in a launch of its own before). The bf16 normed row is written too: the MoE router and the indexer's weights read
it in high precision.

One program per row holds the row in registers (a power-of-two block: 7168 -> 8192 lanes, 56 groups of 128 + 8
masked ones); the quantisation is `fp8_gemm._quant_tile`, the same code the GEMM runs on its input, so the bytes
and scales are the GEMM's own for the same normed values.
"""

from __future__ import annotations

import torch

from minidsa.kernels import reference
from minidsa.kernels.fp8 import FP8_BLOCK
from minidsa.kernels.fp8_gemm import EMULATE_CAST, _quant_tile, act_buffers
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

MAX_HIDDEN = 16384  # one row in one program's registers


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr, res_ptr, w_ptr, sum_ptr, normed_ptr, q_ptr, s_ptr,
    K, stride_x, stride_r, stride_sum, stride_n, stride_q, stride_sm, stride_sg, num_groups, eps,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE_CAST: tl.constexpr,
    QUANT: tl.constexpr = True, PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < K
    x = tl.load(x_ptr + m * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # Rounded to x's dtype before the norm reads it, as the model's `h = h + a` in bf16 is.
        x = (x.to(tl.float32) + tl.load(res_ptr + m * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
             ).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + m * stride_sum + offs, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    # The model rounds the normalised row to x's dtype before the weight multiplies it, then rounds the product.
    xn = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = (w * xn).to(normed_ptr.dtype.element_ty)
    tl.store(normed_ptr + m * stride_n + offs, y, mask=ok)
    if QUANT:
        q, scale = _quant_tile(tl.reshape(y.to(tl.float32), (BLOCK // GROUP, GROUP)), EMULATE_CAST)
        tl.store(q_ptr + m * stride_q + offs, tl.reshape(q, (BLOCK,)), mask=ok)
        g = tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + m * stride_sm + g * stride_sg, scale, mask=g < num_groups)


def supported(hidden: int, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take rows of this width and dtype, or None when it can."""
    if hidden > MAX_HIDDEN:
        return f"the fused RMSNorm + FP8 quantisation holds rows up to {MAX_HIDDEN} wide, got {hidden}"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the fused RMSNorm + FP8 quantisation takes bf16 / fp16 / fp32 rows, got {dtype}"
    return None


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                  deep_gemm_layout: bool = False
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (+ residual [M, K]) -> (x + residual in x's dtype, or None without a residual; normed [M, K] in
    the dtype of weight * x; e4m3 [R, K]; fp32 scales [R, ceil(K / 128)]): `reference.rmsnorm_quant`, R and the
    scales' layout as `fp8_gemm.act_buffers` makes them (`deep_gemm_layout`: DeepGEMM's padded rows, left unwritten
    past M, and MN-major scales, which it reads as they are instead of quantising x again in a launch of its own).
    Rows may be strided (a slice of a fused projection's output); the last dim must be dense."""
    _check(x, weight, residual, "rmsnorm_quant")
    q, scales = act_buffers(x.shape[0], x.shape[1], x.device, deep_gemm_layout)
    out_sum, normed = _launch(x, weight, eps, residual, (q, scales))
    return out_sum, normed, q, scales


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + residual in x's dtype, RMSNorm(h)): `rmsnorm_quant`'s first two outputs, bit for bit, in a launch
    that writes no quantisation, for the norms no FP8 linear reads. Why a kernel and not the reference's torch ops
    the layer's compiled graph would fuse: there inductor (torch 2.11, dynamic token counts) recomputes h inside
    the norm's reduction, fuses h's own realisation (the o_proj addmm's input) into the same kernel and fails
    to compile it (`CantSplit: 64 not divisible by 64*s`, the tiny model in fp32, on an H100)."""
    _check(x, weight, residual, "add_rmsnorm")
    return _launch(x, weight, eps, residual, None)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, name: str) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (residual is not None and (
            residual.shape != x.shape or residual.dtype != x.dtype)):
        given = '' if residual is None else f', residual {residual.dtype} {tuple(residual.shape)}'
        raise ValueError(f"{name}: x {tuple(x.shape)}, weight {tuple(weight.shape)}{given} do not fit")
    why_not = supported(x.shape[1], x.dtype)
    if why_not is not None:
        raise ValueError(why_not)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            quant: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One `_rmsnorm_quant_kernel` launch -> (x + residual or None, normed); `quant`: (e4m3, scales) it fills."""
    m, k = x.shape
    out_sum = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    normed = torch.empty(m, k, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if m == 0:
        return out_sum, normed
    x = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    block = max(FP8_BLOCK, triton.next_power_of_2(k))
    res = residual if residual is not None else x  # any valid pointer: unread without HAS_RESIDUAL
    dst_sum = out_sum if out_sum is not None else normed
    q, scales = quant if quant is not None else (normed, normed)  # unwritten without QUANT
    _rmsnorm_quant_kernel[(m,)](
        x, res, weight.contiguous(), dst_sum, normed, q, scales,
        k, x.stride(0), res.stride(0), dst_sum.stride(0), normed.stride(0), q.stride(0), scales.stride(0),
        scales.stride(1), -(-k // FP8_BLOCK), float(eps),
        BLOCK=block, GROUP=FP8_BLOCK, HAS_RESIDUAL=residual is not None, EMULATE_CAST=EMULATE_CAST,
        QUANT=quant is not None, num_warps=8 if block >= 4096 else 4, **pdl_launch(x.device),
    )
    return out_sum, normed


@triton.jit
def _rmsnorm_rows_kernel(x_ptr, rows_ptr, w_ptr, out_ptr, K, stride_x, stride_out, eps,
                         BLOCK: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    m = tl.program_id(0).to(tl.int64)
    if GATHER:
        src = tl.load(rows_ptr + m).to(tl.int64)
    else:
        src = m
    offs = tl.arange(0, BLOCK)
    ok = offs < K
    x = tl.load(x_ptr + src * stride_x + offs, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    # `_rmsnorm_quant_kernel`'s norm, op for op: the decoder layers' norms and these round alike.
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    xn = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_out + offs, (w * xn).to(out_ptr.dtype.element_ty), mask=ok)


def rmsnorm_rows_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """The model's RMSNorm (`reference.rms_norm`) of x [M, K], or of its rows `rows` [N]."""
    return reference.rms_norm(x if rows is None else x[rows], weight, eps)


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`rmsnorm_rows_reference` in one launch, the gather of `rows` included. Why: the final norm outside the layers
    ran eagerly as the reference's chain (index, cast, pow, mean, add, rsqrt, multiply, cast, multiply: nine kernels
    per step in the CUDA graph) where the layers' norms are one fused kernel. The sum of squares runs in another
    order than torch's mean: the same values within an ulp of the rounding, not bit for bit."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm_rows: x {tuple(x.shape)}, weight {tuple(weight.shape)} do not fit")
    m, k = x.shape
    why_not = supported(k, x.dtype)
    if why_not is not None:
        raise ValueError(why_not)
    n = m if rows is None else rows.shape[0]
    out = torch.empty(n, k, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    block = triton.next_power_of_2(k)
    _rmsnorm_rows_kernel[(n,)](
        x, x if rows is None else rows, weight.contiguous(), out, k, x.stride(0), out.stride(0), float(eps),
        BLOCK=block, GATHER=rows is not None, num_warps=rows_num_warps(block), **pdl_launch(x.device),
    )
    return out


def rows_num_warps(block: int) -> int:
    """Warps of `_rmsnorm_rows_kernel` for a row block: 16 values a thread (8192 lanes on 8 warps spilled 4 bytes
    on sm_90a; tests/test_norm_quant.py checks ptxas's count)."""
    return min(16, max(4, block // 512))
