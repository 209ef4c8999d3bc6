"""Triton w8a8 block-scaled GEMM: y = x @ W^T with W e4m3 [N, K] + fp32 scales per 128x128 block.

Same math as `fp8.w8a8_block_matmul_reference` (the oracle): x is quantised per token per
128-channel group (one fp32 scale each, amax / 448), each 128-wide K step is one fp8 `tl.dot`,
and the fp32 accumulator takes `dot * a_scale[m, kb] * w_scale[nb, kb]`.

Two regimes, one kernel, tiles picked by M inside `w8a8_block_gemm` (so a CUDA graph or compiled
graph keeps whatever M it was captured with, no autotuning at run time):
- decode (M <= 64): reading the weight is the whole cost. Small BLOCK_M, BLOCK_N 64, the
  activation quantised inside the GEMM where nothing quantised it before (no separate launch; every
  N-tile re-quantises its few rows), read already quantised where the norm before it did, and split-K when the N-tiles alone would
  leave SMs idle (fused q_a/kv_a/wk has 2240 rows = 35 tiles on 132 SMs): partial sums in fp32,
  added in K order by the last K range to finish a tile.
- prefill (M > 64): compute bound. Activations quantised once by `_act_quant_kernel`, then
  64x128 / 128x128 tiles, 128-deep K steps (one scale pair per step), software-pipelined;
  split-K too while the tiles alone are fewer than the SMs (M of a few hundred, narrow N).

Under Triton's CPU interpreter (tests) the fp32 -> e4m3 cast rounds wrongly near binade edges,
so `_to_e4m3` rounds explicitly there (to nearest even on 3 mantissa bits) before the cast, which
is then exact; compiled kernels use the hardware conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidsa.kernels import num_sms
from minidsa.kernels.fp8 import FP8_BLOCK, FP8_DTYPE, FP8_MAX
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import JITFunction, tl, triton


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    split_k: int  # number of K ranges summed afterwards (1 = none)
    fuse_act_quant: bool
    num_warps: int
    num_stages: int


@triton.jit
def _to_e4m3(x, EMULATE_CAST: tl.constexpr):
    """fp32 in [-448, 448] -> e4m3 (round to nearest even)."""
    if EMULATE_CAST:
        bits = x.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127
        ulp_exp = tl.maximum(exp, -6) - 3  # e4m3: 3 mantissa bits, smallest normal 2^-6
        ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
        r = x / ulp  # |r| < 16: the 1.5 * 2^23 trick rounds it to the nearest even integer
        r = (r + 12582912.0) - 12582912.0
        r = tl.where(x < 0, -tl.abs(r), r)  # a negative value rounding to zero is -0, as the hardware cast gives
        x = r * ulp
    return x.to(tl.float8e4nv)


@triton.jit
def _quant_tile(a, EMULATE_CAST: tl.constexpr):
    """[rows, 128] fp32 -> (e4m3 tile, per-row scale): scale = amax / 448, 1 for an all-zero row. Bit for bit
    torch's `fp8.quant_act_per_token_group` on the GPU.

    There amax / 448 (a Python scalar) multiplies by the reciprocal, as `/ 448.0` compiles here. x / scale (a
    tensor) is IEEE division; Triton's fp32 `/` is approximate, and moved 3 of 58M values at an e4m3 rounding tie
    to the neighbouring code (H100). `tl.math.div_rn` per element fixes that but doubled the time of the decode
    kernels that quantise (2.3x the Triton GEMM's at one row, H100). So one exact division per row, then
    Markstein's correction: with inv = 1/scale rounded to nearest and q0 within an ulp of x / scale, the remainder
    x - q0 * scale is exact in an fma and q0 + r * inv rounds to the correctly rounded quotient."""
    scale = tl.max(tl.abs(a), axis=1) / 448.0
    scale = tl.where(scale > 0, scale, 1.0)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    q0 = a * inv
    quotient = tl.fma(tl.fma(-q0, scale[:, None], a), inv, q0)
    q = _to_e4m3(tl.clamp(quotient, -448.0, 448.0), EMULATE_CAST)
    return q, scale


# Row / pair counts are not specialised on: each divisibility class would be a variant compiled at start-up.
@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                      ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE_CAST: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _quant_tile(x, EMULATE_CAST)
    tl.store(q_ptr + rm[:, None] * stride_qm + rk[None, :], q, mask=mask)
    tl.store(s_ptr + rm * stride_sm + kb * stride_sk, scale, mask=rm < M)


# Row / pair counts are not specialised on: each divisibility class would be a variant compiled at start-up.
@triton.jit(do_not_specialize=["M"])
def _w8a8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, K, stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_om, num_kb, kb_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FUSE_ACT_QUANT: tl.constexpr, EMULATE_CAST: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr,
    REDUCE_IN_KERNEL: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    # BLOCK_N divides 128: this tile's rows share one row of weight scales.
    ws_row = w_scale_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_wsn
    kb_start = pid_s * kb_per_split
    kb_end = tl.minimum(kb_start + kb_per_split, num_kb)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(kb_start, kb_end, num_stages=NUM_STAGES):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if FUSE_ACT_QUANT:
            a, a_scale = _quant_tile(a.to(tl.float32), EMULATE_CAST)
        else:
            a_scale = tl.load(a_scale_ptr + rm * stride_asm + kb * stride_ask, mask=m_ok, other=1.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w_scale = tl.load(ws_row + kb)
        acc += tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K:
        # Each K range leaves its fp32 partial in [split, M, N]. REDUCE_IN_KERNEL: the range that arrives last at
        # this tile adds them all, in K order (the same sum every run), and writes out, which spares two launches
        # per call (a torch sum and a cast). Arrivals count in a zeroed int32 per tile, reset by that last range.
        part = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + pid_s * M * N, acc, mask=mask)
        if REDUCE_IN_KERNEL:
            tl.debug_barrier()  # every thread's partial is written before the arrival is counted (release)
            arrivals = arrivals_ptr + pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(arrivals, 1, sem="acq_rel") == tl.num_programs(2) - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, tl.num_programs(2)):
                    total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(arrivals, 0)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


EMULATE_CAST = not isinstance(_w8a8_gemm_kernel, JITFunction)  # imported under TRITON_INTERPRET=1
# Split-K's per-tile arrival counts: zeroed once per device, every count back to 0 when its call ends. One set per
# device, shared with the fp32 GEMV (kernels/gemv.py): the engine runs its GEMMs on one stream at a time
# (exec/graphs.py joins its warm-up stream before and after), so one call's counts are all 0 again before the next
# call starts. Split-K runs at most ~4 x 132 tiles.
ARRIVAL_SLOTS = 4096
_arrivals: dict[str, torch.Tensor] = {}


def arrival_counts(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed counts; None while a CUDA graph is being captured and none were made before (allocated
    there, they would live in the graph's memory pool, not for the process)."""
    key = str(device)
    if key not in _arrivals:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _arrivals[key] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return _arrivals[key]


def pick_tiles(m: int, n: int, k: int, num_sms: int) -> GemmTiles:
    """Tile config by M (see the module docstring), from benchmarks/scripts/bench_fp8_gemm.py --sweep on an H100.

    Decode sizes (commit 4b8cc62, best of ~70 configs per V3.2 / GLM-5 projection at M = 1 and 8): a short K (<= 16
    blocks: q_b, indexer wq_b, shared down) is fastest unsplit in 64-wide tiles with 8 warps; an N of at least one
    128-wide tile per SM (dense gate|up, V3.2's q_b) unsplit in 64-wide tiles. The rest (fused q_a|wk|kv_a, o_proj,
    down, shared gate|up) is split along K to about two programs per SM: re-swept with x quantised before the GEMM,
    as the model runs it (benchmarks/kernels/fp8_gemm_wide_sweep_h100_953e585.json, H100, M = 1, ~90 configs each),
    64-wide tiles with 5 stages beat the 128-wide, 3-stage ones: fused q_a|wk|kv_a 12.4 -> 10.5 us, shared gate|up
    16.0 -> 14.5 us.
    """
    num_kb = -(-k // FP8_BLOCK)
    if m <= 64:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        if num_kb <= 16:
            return GemmTiles(block_m, 64, 1, True, 8, 4)
        if -(-n // 128) >= num_sms:
            return GemmTiles(block_m, 64, 1, True, 4, 3)
        n_tiles = -(-n // 64)
        split = max(1, min(round(2 * num_sms / n_tiles), num_kb // 4))
        return GemmTiles(block_m, 64, split, True, 4, 5)
    block_m = 64 if m <= 128 else 128
    tiles = -(-m // block_m) * -(-n // 128)
    # Mid-size M (verify, big decode batches) on a narrow N still leaves SMs idle without split-K.
    split = max(1, min(-(-num_sms // tiles), num_kb // 4)) if tiles < num_sms else 1
    return GemmTiles(block_m, 128, split, False, 4 if block_m == 64 else 8, 3)


def mn_major_scales(rows: int, groups: int, device: torch.device) -> torch.Tensor:
    """An fp32 [rows, groups] tensor laid out column by column, each column padded to 4 values: the layout
    DeepGEMM's SM90 kernels read activation scales in (TMA-aligned, MN-major). Handed over in it, the scales are
    used as they are; row-major ones are transposed by an extra kernel inside every DeepGEMM call."""
    aligned = -(-rows // 4) * 4
    return torch.empty(groups, aligned, dtype=torch.float32, device=device).t()[:rows]


def deep_gemm_act_rows(m):
    """The rows an input quantised for DeepGEMM is made with by the kernels that produce it (the norms' quantisation
    aside): m rounded up to 16, which is `deepgemm.gemm_rows(m)` (the rows DeepGEMM runs) up to 256 rows, decode
    sizes. One formula for every m, so a custom op's fake gives the same shape from a symbolic m with no guard;
    above 256 rows the two differ and DeepGEMM quantises x again itself (prefill: one launch more)."""
    return -(-m // 16) * 16


def act_buffers(m, k, device: torch.device, deep_gemm_layout: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (e4m3, fp32 scales) for an [m, k] input quantised for an FP8 GEMM: with `deep_gemm_layout`,
    `deep_gemm_act_rows(m)` rows (those past m left unwritten) and MN-major scales (`mn_major_scales`), which
    DeepGEMM reads as they are and the Triton GEMM in any strides; else m rows, row-major scales. Works on symbolic
    sizes too (the custom ops' fakes)."""
    rows = deep_gemm_act_rows(m) if deep_gemm_layout else m
    groups = -(-k // FP8_BLOCK)
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=device)
    # MN-major: rows (a multiple of 16) needs no padding to 4, so no slice (which would guard a symbolic size)
    s = (torch.empty(groups, rows, dtype=torch.float32, device=device).t() if deep_gemm_layout
         else torch.empty(rows, groups, dtype=torch.float32, device=device))
    return q, s


def quant_act(x: torch.Tensor, rows: int | None = None, mn_major: bool = False,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)]): `fp8.quant_act_per_token_group` on the GPU.
    `rows` >= M: the outputs have that many rows, those past M left unwritten (a GEMM's padding rows).
    `mn_major`: the scales in DeepGEMM's layout (`mn_major_scales`), else row-major. `out`: (e4m3, scales) to write
    instead (at least M rows, dense e4m3 rows, scales in any strides; `act_buffers`)."""
    m, k = x.shape
    num_kb = -(-k // FP8_BLOCK)
    if out is not None:
        q, s = out
    else:
        q = torch.empty(rows or m, k, dtype=FP8_DTYPE, device=x.device)
        s = (mn_major_scales(rows or m, num_kb, x.device) if mn_major
             else torch.empty(rows or m, num_kb, dtype=torch.float32, device=x.device))
    block_rows = 16
    _act_quant_kernel[(triton.cdiv(m, block_rows), num_kb)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                                                             s.stride(1), ROWS=block_rows, BLOCK_K=FP8_BLOCK,
                                                             EMULATE_CAST=EMULATE_CAST, **pdl_launch(x.device))
    return q, s


def w8a8_block_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                    tiles: GemmTiles | None = None,
                    act: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) @ e4m3 weight [N, K]^T with scales [ceil(N/128), ceil(K/128)] -> [M, N] x.dtype.

    `act`: x already quantised (`quant_act`'s values: e4m3 [M, K], fp32 scales [M, ceil(K/128)] in any strides,
    say by the norm before it, `norm_quant.rmsnorm_quant`). Read whenever handed in, even by tiles that would
    quantise inside (decode sizes): every program of those quantises the same rows again, from twice the bytes."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"w8a8_block_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"w8a8_block_gemm: weight must be {FP8_DTYPE}, got {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    num_kb = -(-k // FP8_BLOCK)
    if tuple(scale_inv.shape) != (-(-n // FP8_BLOCK), num_kb):
        raise ValueError(f"w8a8_block_gemm: scales {tuple(scale_inv.shape)} do not fit a {n}x{k} weight in 128-blocks")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x, weight, scale_inv = x.contiguous(), weight.contiguous(), scale_inv.float().contiguous()
    tiles = tiles or pick_tiles(m, n, k, num_sms(x.device))
    fuse_act_quant = tiles.fuse_act_quant and act is None
    if act is not None:
        a, a_scale = act[0][:m], act[1][:m]
        if a.shape != x.shape or a.stride(1) != 1 or a_scale.shape != (m, num_kb):
            raise ValueError(f"w8a8_block_gemm: quantised activations {tuple(act[0].shape)} + scales "
                             f"{tuple(act[1].shape)} do not fit x {tuple(x.shape)}")
    elif fuse_act_quant:
        a, a_scale = x, scale_inv  # a_scale is unused (quantised inside); any valid pointer
    else:
        a, a_scale = quant_act(x)
    kb_per_split = -(-num_kb // tiles.split_k)
    split = -(-num_kb // kb_per_split)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    arrivals = arrival_counts(x.device) if split > 1 and grid[0] * grid[1] <= ARRIVAL_SLOTS else None
    partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _w8a8_gemm_kernel[grid](
        a, a_scale, weight, scale_inv, out, partials, arrivals if arrivals is not None else partials,
        m, n, k, a.stride(0), a_scale.stride(0), a_scale.stride(1), weight.stride(0), scale_inv.stride(0),
        out.stride(0), num_kb, kb_per_split,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=FP8_BLOCK,
        FUSE_ACT_QUANT=fuse_act_quant, EMULATE_CAST=EMULATE_CAST, NUM_STAGES=tiles.num_stages,
        SPLIT_K=split > 1, REDUCE_IN_KERNEL=arrivals is not None, num_warps=tiles.num_warps, **pdl_launch(a.device),
    )
    if split > 1 and arrivals is None:
        torch.sum(partials, dim=0, out=out) if out.dtype == torch.float32 else out.copy_(partials.sum(0))
    return out


__all__ = ["GemmTiles", "act_buffers", "pick_tiles", "quant_act", "w8a8_block_gemm", "FP8_MAX"]
