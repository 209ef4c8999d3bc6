"""MLA's absorbed per-head matrices at decode sizes, one Triton launch each.

Absorption folds kv_b_proj into the attention: each head's query enters the latent space through W_UK
(`absorb_q`: q_latent = q_nope @ W_UK, beside q_rope rotated by its rotary embedding), and the latent attention
output leaves it through W_UV (`absorb_o`: o = o_latent @ W_UV^T). `absorb_q_reference` and `absorb_o_reference`
(per-head bmm plus the rope and a cat / a copy) are the contract: fp32 accumulation, outputs in the inputs'
dtype; the rope columns are `reference.rope_interleaved`'s bit for bit.

Why: at one decode token on an H100 (DeepSeek-V3.2, 64 heads per rank) each bmm is ~8.4 us for 8.4 MB of
bf16 weight, about a third of the copy bandwidth, and the cat and the copy are two more kernels, in every layer
of every decode step. Here both products are one weight-streaming kernel (`_head_matmul_kernel`): a program
owns one head and a block of output columns, reads its weight tile once and every token's row of that head,
and writes straight into the layout the next op reads (q_full's first L columns, its rope columns rotated by
the head's first program; o in [T, H * v]), so no cat or copy remains, nor a kernel of the query rope's own.
Weight tiles are small enough that 64-128 heads make several programs per SM (`_tiles`), which keeps every SM
streaming. Timings, reference against kernel on an H100: benchmarks/kernels/NOTES.md.

`absorb_o_quant` also quantises o for o_proj (FP8) in the same program: with v_head_dim a multiple of 128, a
program of 128 output columns holds one whole per-token quantisation group of o_proj's input, so it writes the e4m3
values and scales `fp8.quant_act_per_token_group` would make of its own o (the GEMMs' `_quant_tile`), in DeepGEMM's
padded MN-major layout where DeepGEMM serves o_proj: the activation-quantisation launch in front of o_proj (every
decode step, every layer, with DeepGEMM) is gone. Its tiles are 128 columns wide (not absorb_o's 32), each weight
column still read by one program.

Above `MAX_TOKENS` tokens (prefill, verify) the product is compute-bound and cuBLAS serves it (the op calls
the references); the kernel itself computes any token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidsa.kernels import reference as ref
from minidsa.kernels.fp8 import FP8_BLOCK, quant_act_per_token_group
from minidsa.kernels.fp8_gemm import EMULATE_CAST, _quant_tile, act_buffers
from minidsa.kernels.rope import load_rope_leading
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

MAX_TOKENS = 64  # the kernel reads all of a head's rows against one weight tile: decode and small batches
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def absorb_q_reference(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, rope] (not yet rotated), w_uk [H, nope, L], cos / sin [T, rope/2]
    -> q_full [T, H, L + rope]: q_nope @ W_UK, then `rope_interleaved(q_rope)`."""
    # Per-head bmm on transposed operands, not einsum: einsum treats a one-token batch apart (it drops size-1
    # dims), which would cost every layer kind a second compiled graph.
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    return torch.cat([q_latent, ref.rope_interleaved(q_rope, cos.unsqueeze(1), sin.unsqueeze(1))], dim=-1)


def absorb_o_reference(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [T, H, L], w_uv [H, v, L] -> o [T, H * v]."""
    num_tokens, num_heads, _ = o_latent.shape
    v_dim = w_uv.shape[1]
    o_heads = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
    # A copy into a fresh [T, H, v] buffer: reshaping the transposed product guards on one token.
    o = o_heads.new_empty(num_tokens, num_heads, v_dim).copy_(o_heads.transpose(0, 1))
    return o.view(num_tokens, num_heads * v_dim)


def absorb_o_quant_reference(o_latent: torch.Tensor, w_uv: torch.Tensor, deep_gemm_layout: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`absorb_o_reference` and o_proj's FP8 input made from it: (o [T, H * v], e4m3, fp32 scales), the latter two
    `fp8.quant_act_per_token_group(o)`'s values in `fp8_gemm.act_buffers`' layout (rows past T unwritten)."""
    o = absorb_o_reference(o_latent, w_uv)
    q, s = act_buffers(o.shape[0], o.shape[1], o.device, deep_gemm_layout)
    want_q, want_s = quant_act_per_token_group(o)
    q[: o.shape[0]], s[: o.shape[0]] = want_q, want_s
    return o, q, s


@triton.jit
def _head_matmul_kernel(
    a_ptr, b_ptr, out_ptr, rope_ptr, cos_ptr, sin_ptr, q_ptr, s_ptr, T, K, N, ROPE,
    stride_at, stride_ah, stride_ak, stride_bh, stride_bk, stride_bn, stride_ot, stride_oh, stride_rt, stride_rh,
    stride_ct, stride_qt, stride_st, stride_sg,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_ROPE: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr, EMULATE_CAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # out[t, h, n] = sum_k a[t, h, k] * b[h, k, n]; with HAS_ROPE, out[t, h, N:] = rope_interleaved(rope[t, h])
    # too. QUANT (N and BLOCK_N multiples of 128: the program's columns are whole quantisation groups of the flat
    # [T, H * N] row): out quantised per token per 128 columns too, e4m3 into q (row stride stride_qt, head stride
    # N) and fp32 scales into s (group (h * N + column) / 128).
    wait_for_producers(PDL)
    h = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_head = a_ptr + h * stride_ah
    b_head = b_ptr + h * stride_bh + offs_n[None, :] * stride_bn
    out_head = out_ptr + h * stride_oh
    # Up to MAX_TOKENS rows are one block: the weight tile is read once. Beyond, it is read again per block
    # (from L2), which only a direct caller asks for.
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        t_ok = rows < T
        acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            k_ok = ks < K
            a = tl.load(a_head + rows[:, None] * stride_at + ks[None, :] * stride_ak,
                        mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_head + ks[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        o = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_head + rows[:, None] * stride_ot + offs_n[None, :], o, mask=t_ok[:, None] & n_ok[None, :])
        if QUANT:
            # the stored (rounded) values, as o_proj would quantise them
            GROUPS: tl.constexpr = BLOCK_N // 128
            q, scale = _quant_tile(tl.reshape(o.to(tl.float32), (BLOCK_T * GROUPS, 128)), EMULATE_CAST)
            tl.store(q_ptr + h * N + rows[:, None] * stride_qt + offs_n[None, :], tl.reshape(q, (BLOCK_T, BLOCK_N)),
                     mask=t_ok[:, None])
            groups = (h * N + nb * BLOCK_N) // 128 + tl.arange(0, GROUPS)
            tl.store(s_ptr + rows[:, None] * stride_st + groups[None, :] * stride_sg,
                     tl.reshape(scale, (BLOCK_T, GROUPS)), mask=t_ok[:, None])
        if HAS_ROPE:
            if nb == 0:
                offs_r = tl.arange(0, BLOCK_R)
                r = load_rope_leading(rope_ptr + h * stride_rh + rows * stride_rt, cos_ptr + rows * stride_ct,
                                      sin_ptr + rows * stride_ct, t_ok, offs_r, ROPE, ROPE, True)
                tl.store(out_head + rows[:, None] * stride_ot + N + offs_r[None, :], r.to(out_ptr.dtype.element_ty),
                         mask=t_ok[:, None] & (offs_r < ROPE)[None, :])


@dataclass(frozen=True)
class Tiles:
    block_t: int
    block_k: int
    block_n: int
    num_warps: int
    num_stages: int


def _tiles(num_tokens: int, num_heads: int, k: int, n: int, k_contiguous: bool, quant: bool = False) -> Tiles:
    """Tiles for one product. The token rows are one block up to MAX_TOKENS. Measured on an H100 at 64 and 128
    heads, 1 and 32 tokens (each choice within 3% of the best of 81 there): W_UK ([nope, L] per head, L
    contiguous) in 64 columns x 32 rows per step, 2 warps; W_UV ([L, v] per head, L contiguous) in 32 columns x
    128 rows per step, 4 warps; both 3 stages deep. At 16 and 32 heads (tensor parallel) within 15%.
    `quant` (absorb_o quantising its output): 128 columns a program, one whole quantisation group (its amax), 64
    rows per step; 4 warps up to 16 tokens, 8 above (ptxas: 152, 196 and 232 registers at 16, 32 and 64 token rows,
    no spills; 4 warps spill at 64). Not measured yet."""
    block_t = max(16, min(MAX_TOKENS, triton.next_power_of_2(num_tokens)))
    if quant:
        return Tiles(block_t, max(16, min(64, triton.next_power_of_2(k))), FP8_BLOCK, 4 if block_t <= 16 else 8, 3)
    block_n, block_k, num_warps = (32, 128, 4) if k_contiguous else (64, 32, 2)
    return Tiles(block_t, max(16, min(block_k, triton.next_power_of_2(k))),
                 max(16, min(block_n, triton.next_power_of_2(n))), num_warps, num_stages=3)


def _check_weight(name: str, a: torch.Tensor, w: torch.Tensor, k_dim: int) -> None:
    """a [T, H, K] against a per-head weight w [H, *, *] whose K sits at dim `k_dim`."""
    if a.dim() != 3 or w.dim() != 3:
        raise ValueError(f"{name}: want a [T, H, K] input and an [H, ., .] weight, got {tuple(a.shape)} and "
                         f"{tuple(w.shape)}")
    if w.shape[0] != a.shape[1] or w.shape[k_dim] != a.shape[2]:
        raise ValueError(f"{name}: input {tuple(a.shape)} does not fit the per-head weight {tuple(w.shape)}")
    if a.dtype != w.dtype or a.dtype not in DTYPES:
        raise ValueError(f"{name}: input and weight must share one of {DTYPES}, got {a.dtype} and {w.dtype}")
    if a.device != w.device:
        raise ValueError(f"{name}: input on {a.device}, weight on {w.device}")


def _launch(a: torch.Tensor, b_strides: tuple[int, int, int], w: torch.Tensor, out: torch.Tensor,
            out_strides: tuple[int, int], n: int, k_contiguous: bool,
            rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, tiles: Tiles | None,
            quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """`rope`: (q_rope, cos, sin), rotated into out[..., n:]. `quant`: (e4m3, scales) out is quantised into."""
    num_tokens, num_heads, k = a.shape
    if num_tokens == 0:
        return
    t = tiles or _tiles(num_tokens, num_heads, k, n, k_contiguous, quant is not None)
    if quant is not None and (t.block_n % FP8_BLOCK or n % t.block_n):
        raise ValueError(f"_head_matmul_kernel: quantising needs whole 128-column groups in a tile, got {t.block_n} "
                         f"of {n} columns")
    q, scales = quant if quant is not None else (out, out)
    quant_strides = (q.stride(0), scales.stride(0), scales.stride(1)) if quant is not None else (0, 0, 0)
    if rope is None:
        rope_dim, rope_args, rope_strides = 0, (out, out, out), (0, 0, 0)
    else:
        q_rope, cos, sin = rope
        if q_rope.stride(2) != 1:
            q_rope = q_rope.contiguous()
        if cos.stride() != sin.stride() or cos.stride(1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        rope_dim, rope_args = q_rope.shape[2], (q_rope, cos, sin)
        rope_strides = (q_rope.stride(0), q_rope.stride(1), cos.stride(0))
    # fp32 inputs: no TF32 rounding, as cuBLAS's fp32 bmm (torch's default) does not round either.
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    _head_matmul_kernel[(num_heads, triton.cdiv(n, t.block_n))](
        a, w, out, *rope_args, q, scales, num_tokens, k, n, rope_dim,
        a.stride(0), a.stride(1), a.stride(2), *b_strides, *out_strides, *rope_strides, *quant_strides,
        BLOCK_T=t.block_t, BLOCK_K=t.block_k, BLOCK_N=t.block_n,
        BLOCK_R=triton.next_power_of_2(max(rope_dim, 1)), HAS_ROPE=rope is not None, QUANT=quant is not None,
        PRECISION=precision, EMULATE_CAST=EMULATE_CAST,
        num_warps=t.num_warps, num_stages=t.num_stages,
        enable_fp_fusion=rope is None, **pdl_launch(a.device),  # the rope as torch rounds it (kernels/rope.py)
    )


def absorb_q(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """`absorb_q_reference` in one launch, for any token count; views of any strides."""
    _check_weight("absorb_q", q_nope, w_uk, 1)
    if q_rope.dim() != 3 or q_rope.shape[:2] != q_nope.shape[:2] or q_rope.dtype != q_nope.dtype:
        raise ValueError(f"absorb_q: q_rope {tuple(q_rope.shape)} {q_rope.dtype} does not fit q_nope "
                         f"{tuple(q_nope.shape)} {q_nope.dtype}")
    num_tokens, num_heads, rope_dim = q_rope.shape
    if rope_dim % 2 or cos.shape != (num_tokens, rope_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"absorb_q: want cos / sin [{num_tokens}, {rope_dim // 2}] for q_rope "
                         f"{tuple(q_rope.shape)}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    latent = w_uk.shape[2]
    out = torch.empty(num_tokens, num_heads, latent + rope_dim, dtype=q_nope.dtype, device=q_nope.device)
    _launch(q_nope, (w_uk.stride(0), w_uk.stride(1), w_uk.stride(2)), w_uk, out, (out.stride(0), out.stride(1)),
            latent, w_uk.stride(1) == 1, (q_rope, cos, sin), tiles)
    return out


def absorb_o(o_latent: torch.Tensor, w_uv: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """`absorb_o_reference` in one launch, for any token count; views of any strides."""
    _check_weight("absorb_o", o_latent, w_uv, 2)
    num_tokens, num_heads, _ = o_latent.shape
    v_dim = w_uv.shape[1]
    out = torch.empty(num_tokens, num_heads * v_dim, dtype=o_latent.dtype, device=o_latent.device)
    # W_UV^T per head: K (the latent) along w_uv's dim 2, N (v) along its dim 1.
    _launch(o_latent, (w_uv.stride(0), w_uv.stride(2), w_uv.stride(1)), w_uv, out, (out.stride(0), v_dim),
            v_dim, w_uv.stride(2) == 1, None, tiles)
    return out


def quant_unsupported(v_dim: int) -> str | None:
    """Why `absorb_o_quant` cannot take heads of this width, or None when it can."""
    if v_dim % FP8_BLOCK:
        return f"quantising absorb_o's output needs v_head_dim a multiple of {FP8_BLOCK}, got {v_dim}"
    return None


def absorb_o_quant(o_latent: torch.Tensor, w_uv: torch.Tensor, deep_gemm_layout: bool = False,
                   tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`absorb_o_quant_reference` in one launch: absorb_o's product, and o_proj's FP8 input quantised from it in the
    same program (each head's v outputs are v / 128 whole quantisation groups; a program computes one), so o_proj
    reads it instead of quantising o in a launch of its own (DeepGEMM at every size, the Triton GEMM above 64 rows).
    Each weight column is still read by one program only."""
    _check_weight("absorb_o_quant", o_latent, w_uv, 2)
    num_tokens, num_heads, _ = o_latent.shape
    v_dim = w_uv.shape[1]
    why_not = quant_unsupported(v_dim)
    if why_not is not None:
        raise ValueError(why_not)
    out = torch.empty(num_tokens, num_heads * v_dim, dtype=o_latent.dtype, device=o_latent.device)
    q, scales = act_buffers(num_tokens, num_heads * v_dim, o_latent.device, deep_gemm_layout)
    _launch(o_latent, (w_uv.stride(0), w_uv.stride(2), w_uv.stride(1)), w_uv, out, (out.stride(0), v_dim),
            v_dim, w_uv.stride(2) == 1, None, tiles, (q, scales))
    return out, q, scales
