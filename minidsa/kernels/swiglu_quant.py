"""SwiGLU's product and the FP8 per-token-group quantisation of it for the down projection, in one launch.

`swiglu_quant_reference` is the contract: `mid = F.silu(gate) * up` as eager torch computes it in the serving dtype
(silu in fp32, rounded to the dtype; the product in fp32, rounded again), and the e4m3 values + fp32 scales
`fp8.quant_act_per_token_group(mid)` gives, in `fp8_gemm.act_buffers`' layout (DeepGEMM's padded rows and MN-major
scales, or plain rows).

Why: the dense MLP and the shared expert computed `F.silu(gate) * up` in a kernel of inductor's, and the FP8 down
projection quantised that product again in a launch of its own wherever DeepGEMM ran it (`fp8_gemm.quant_act`; the
dense down projection at every size, 3 launches per decode step of bench-dsv32:6) or the Triton GEMM above 64 rows.
Here the program that makes a 128-column group of the product quantises it. The product is written in the serving
dtype too (the fp8 linear's x): read only where the GEMM cannot use the quantised rows (DeepGEMM above 256 rows,
whose row classes the padding does not match), 2 bytes a value beside the e4m3 byte.

The quantisation is `fp8_gemm._quant_tile`, the GEMMs' own. silu's division is IEEE (`div_rn`), as torch's is; its
exp is Triton's, within an fp32 ulp or two of torch's, which the rounding to bf16 almost always absorbs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minidsa.kernels.fp8 import FP8_BLOCK, quant_act_per_token_group
from minidsa.kernels.fp8_gemm import EMULATE_CAST, _quant_tile, act_buffers
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

ROWS = 16  # token rows per program (one 128-column group each): one tile shape for decode and prefill


def swiglu_quant_reference(gate: torch.Tensor, up: torch.Tensor, deep_gemm_layout: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up [M, I] -> (F.silu(gate) * up [M, I], its e4m3 [R, I], fp32 scales [R, ceil(I/128)]); R and the
    scales' layout as `fp8_gemm.act_buffers` makes them (rows past M unwritten)."""
    mid = F.silu(gate) * up
    q, s = act_buffers(mid.shape[0], mid.shape[1], mid.device, deep_gemm_layout)
    want_q, want_s = quant_act_per_token_group(mid)
    q[: mid.shape[0]], s[: mid.shape[0]] = want_q, want_s
    return mid, q, s


# Row counts are not specialised on: each divisibility class would be a variant compiled at start-up.
@triton.jit(do_not_specialize=["M"])
def _swiglu_quant_kernel(gate_ptr, up_ptr, mid_ptr, q_ptr, s_ptr, M, inter, stride_g, stride_u, stride_m, stride_q,
                         stride_sm, stride_sg, ROWS: tl.constexpr, GROUP: tl.constexpr, EMULATE_CAST: tl.constexpr,
                         PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    c = g * GROUP + tl.arange(0, GROUP)
    r_ok = r < M
    mask = r_ok[:, None] & (c[None, :] < inter)
    r64 = r.to(tl.int64)[:, None]
    gate = tl.load(gate_ptr + r64 * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + r64 * stride_u + c[None, :], mask=mask, other=0.0).to(tl.float32)
    # F.silu then `* up`, each rounded to the serving dtype as eager torch rounds it
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(mid_ptr.dtype.element_ty).to(tl.float32)
    mid = (silu * up).to(mid_ptr.dtype.element_ty)
    tl.store(mid_ptr + r64 * stride_m + c[None, :], mid, mask=mask)
    q, scale = _quant_tile(mid.to(tl.float32), EMULATE_CAST)
    tl.store(q_ptr + r64 * stride_q + c[None, :], q, mask=mask)
    tl.store(s_ptr + r * stride_sm + g * stride_sg, scale, mask=r_ok)


def swiglu_quant(gate: torch.Tensor, up: torch.Tensor, deep_gemm_layout: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_quant_reference` in one launch, for any row count. gate and up may be row-strided views (the two
    halves of a fused gate|up projection's output); their last dim must be dense."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"swiglu_quant: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} "
                         f"{tuple(up.shape)} do not fit")
    m, inter = gate.shape
    mid = torch.empty(m, inter, dtype=gate.dtype, device=gate.device)
    q, s = act_buffers(m, inter, gate.device, deep_gemm_layout)
    if m == 0:
        return mid, q, s
    gate, up = (t if t.stride(1) == 1 else t.contiguous() for t in (gate, up))
    _swiglu_quant_kernel[(triton.cdiv(m, ROWS), triton.cdiv(inter, FP8_BLOCK))](
        gate, up, mid, q, s, m, inter, gate.stride(0), up.stride(0), mid.stride(0), q.stride(0), s.stride(0),
        s.stride(1), ROWS=ROWS, GROUP=FP8_BLOCK, EMULATE_CAST=EMULATE_CAST, num_warps=4, **pdl_launch(gate.device))
    return mid, q, s
