"""The model's fp32 GEMVs at decode sizes in one Triton launch: y [T, N] fp32 = (x [T, K] @ W [N, K]^T) * scale.

Two weights are read this way, both stored in fp32 (`read_in_fp32`): the indexer's head weights (weights_proj,
[64, 7168] in DeepSeek-V3.2, times its constant scale) and the MoE router's gate ([256, 7168]).
`fp32_gemv_reference` (x cast to fp32, cuBLAS's F.linear, the scale after) is the contract.

Why: on an H100 at decode batch 1 (bench-dsv32, in a CUDA graph) the reference costs per layer an x.float() copy
kernel, cuBLAS's dot_kernel + reduce_1Block_kernel and a multiply for the indexer (~6 us for 1.8 MB of weight), and
the copy plus a gemvx (~7 us for 7.3 MB) for the router: a fraction of the copy bandwidth. Here x is read in its
own dtype and converted in registers, the scale is applied in the epilogue, and the sum over K is split across
programs so that even 64 rows of weight are streamed by more programs than there are SMs: one launch per GEMV.

A program computes its [T, BLOCK_N] tile over its K range with FMAs in registers (the tile of W times each token's
x), no padding: tl.dot needs 16 rows, 16x the work at one token (`pick_tiles`, from the shape alone, so the tiles
the interpreter tests are those a GPU runs).
The split-K partials go to an fp32 [split, T, N] buffer; the program that arrives last at an N tile (a per-tile
count, `fp8_gemm.arrival_counts`, shared with the FP8 GEMM and set back to 0 by that program) adds them in K
order, scales and writes y. Every step is in a fixed order: the same bits every call (not cuBLAS's bits: fp32
sums in another order, within a few fp32 ulps of sum_k |x_k W_nk|; tests/test_gemv.py checks 1e-5 of it).

Above `MAX_TOKENS` cuBLAS's GEMM serves (the op calls the reference): the FMAs grow with the tokens while the weight
read does not. The kernel itself computes any token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minidsa.kernels import fp8_gemm
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

# Up to 4 tokens this kernel, from 8 cuBLAS: us per call in CUDA graphs, torch / Triton, on an H100
# (benchmarks/scripts/bench_gemv.py, benchmarks/kernels/gemv_h100_bf30d8a.log): indexer 64 x 7168 at 1 / 2 / 4
# tokens 9.1 / 19.9 / 20.3 against 4.9 / 4.8 / 5.3, router 256 x 7168 9.5 / 18.9 / 19.1 against 7.4 / 7.5 / 8.4;
# from 8 tokens a tl.dot variant was at best level with cuBLAS (router 8 / 16 / 32: 23.8 / 23.9 / 21.1 against
# 25.2 / 25.3 / 44.7).
MAX_TOKENS = 4
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TARGET_PROGRAMS = 256  # about two per SM of a 132-SM GPU: the whole weight in flight at once
MAX_SPLIT = 16  # K ranges the last program adds, each one load it issues up front (unrolled)


def fp32_gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x [T, K] (any float dtype), weight [N, K] -> fp32 [T, N]: the model's expression, cuBLAS's GEMM."""
    y = F.linear(x.float(), weight.float())
    return y * scale if scale != 1.0 else y


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, arrivals_ptr, T, N, K, stride_xt, stride_xk, stride_wn, stride_wk,
                 k_per_split, scale,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr, NUM_STAGES: tl.constexpr,
                 PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rt = tl.arange(0, BLOCK_T)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    t_ok, n_ok = rt < T, rn < N
    x_rows = x_ptr + rt[:, None].to(tl.int64) * stride_xt
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    k_start = pid_s * k_per_split
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    # k_per_split is a multiple of BLOCK_K: a chunk never crosses into the next range.
    for k0 in tl.range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + rk
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    offs = rt[:, None] * N + rn[None, :]
    mask = t_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + offs, acc * scale, mask=mask)
    else:
        part = part_ptr + offs
        tl.store(part + pid_s * T * N, acc, mask=mask)
        if REDUCE_IN_KERNEL:
            tl.debug_barrier()  # every thread's partial is written before the arrival is counted (release)
            arrivals = arrivals_ptr + pid_n
            if tl.atomic_add(arrivals, 1, sem="acq_rel") == SPLIT - 1:
                # Unrolled: the loads are independent, so they are all in flight at once, and added in K order.
                total = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
                for s in tl.static_range(SPLIT):
                    total += tl.load(part + s * T * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs, total * scale, mask=mask)
                tl.atomic_xchg(arrivals, 0)


@dataclass(frozen=True)
class GemvTiles:
    block_t: int
    block_n: int
    block_k: int
    split_k: int  # K ranges summed by the last program of a tile (1 = none)
    num_warps: int
    num_stages: int


def pick_tiles(t: int, n: int, k: int) -> GemvTiles:
    """Tiles from the shape alone (see the module docstring): BLOCK_T x BLOCK_N x BLOCK_K = 8192 products per chunk
    (32 registers a thread at 8 warps), chunks of up to 1024 along K (4 KB of fp32 weight per row). Then K is split
    until the grid has about TARGET_PROGRAMS programs (at most MAX_SPLIT ranges): at V3.2's K = 7168, one token,
    8 x 7 programs of 32 KB for N = 64 and 32 x 7 for N = 256."""
    block_t = triton.next_power_of_2(max(t, 1))
    block_k = max(16, min(1024, triton.next_power_of_2(k), 8192 // block_t))
    block_n = max(1, min(triton.next_power_of_2(n), 8192 // (block_t * block_k)))
    num_warps = 8 if block_k >= 1024 else 4
    chunks = max(1, -(-k // block_k))
    split = max(1, min(MAX_SPLIT, chunks, -(-TARGET_PROGRAMS // -(-n // block_n))))
    # One chunk per range: loads straight into registers; a pipeline would stage them through shared memory
    # (cp.async) for nothing, and its buffers would cap the programs per SM.
    num_stages = 1 if -(-chunks // split) == 1 else 3
    return GemvTiles(block_t, block_n, block_k, split, num_warps, num_stages)


def fp32_gemv(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0,
              tiles: GemvTiles | None = None) -> torch.Tensor:
    """`fp32_gemv_reference` in one launch, for any token count: x [T, K] in any strides and float dtype (read in
    it, converted in registers), weight [N, K] (fp32 as the model stores it; any float dtype) -> fp32 [T, N]."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp32_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"fp32_gemv: x and weight must be one of {DTYPES}, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"fp32_gemv: x on {x.device}, weight on {weight.device}")
    t, k = x.shape
    n = weight.shape[0]
    out = torch.empty(t, n, dtype=torch.float32, device=x.device)
    if t == 0 or n == 0:
        return out
    tiles = tiles or pick_tiles(t, n, k)
    chunks = max(1, -(-k // tiles.block_k))
    k_per_split = -(-chunks // tiles.split_k) * tiles.block_k
    split = max(1, -(-k // k_per_split))
    n_tiles = triton.cdiv(n, tiles.block_n)
    arrivals = fp8_gemm.arrival_counts(x.device) if split > 1 and n_tiles <= fp8_gemm.ARRIVAL_SLOTS else None
    partials = torch.empty(split, t, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _gemv_kernel[(n_tiles, split)](
        x, weight, out, partials, arrivals if arrivals is not None else partials, t, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), k_per_split, float(scale),
        BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT=split,
        REDUCE_IN_KERNEL=arrivals is not None, NUM_STAGES=tiles.num_stages, num_warps=tiles.num_warps,
        **pdl_launch(x.device),
    )
    if split > 1 and arrivals is None:  # no counts yet in a CUDA graph capture: torch adds the ranges
        torch.sum(partials, dim=0, out=out)
        if scale != 1.0:
            out.mul_(scale)
    return out
