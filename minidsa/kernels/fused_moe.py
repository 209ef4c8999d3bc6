"""Routed experts for any number of tokens: tokens sorted per expert, two grouped GEMMs (Triton).

`fused_moe(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv, down_scale_inv, addend)`
computes, for each token t, sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])) with
e = topk_ids[t, j], plus addend[t] when given. Shapes: x [T, H]; topk_ids / topk_weights [T, k]; gate_up_proj
[E, 2I, H] (gate rows first, then up); down_proj [E, H, I]; addend [T, H] in x's dtype; output [T, H] in x's dtype.

The addend is the MoE layer's shared experts' output: added in the pass that sums each token's k rows, to their
fp32 sum, and rounded once with it, it costs no add launch of its own (one per MoE layer per step otherwise). The
rounding differs from adding two rounded tensors (routed rounded to x's dtype, then + shared, rounded again) in
bf16 / fp16; in fp32 it is the same result.

Weights are either x's dtype (bf16 / fp16; fp32 for CPU tests) or FP8 e4m3 with one fp32 scale per
128x128 block (`*_scale_inv` [E, ceil(rows/128), ceil(cols/128)], minidsa.kernels.fp8). With FP8
weights the activations are quantised per token per 128-channel group (w8a8, DeepSeek's recipe, the
semantics of `fp8.quant_act_per_token_group`) before each GEMM, once, by `fp8_gemm.quant_act` (one
launch over the rows); the kernels load e4m3 A tiles and their per-row scales. (Quantising inside the
GEMM, per N-block program, measured 20x slower at prefill sizes on an H100: every program re-did it.)

How (the `moe_align_block_size` idea of vLLM / SGLang, written here; nothing syncs with the host):
1. `align_pairs_to_blocks` (torch ops: the reference; served by one Triton program up to ALIGN_KERNEL_MAX_PAIRS
   pairs, as in decode, and above by `moe_layout.expert_rows`, five launches over chunks of pairs, no sort): the
   T*k (token, choice) pairs are sorted by expert, each expert's count
   padded to a multiple of BLOCK_M; `sorted_pair_ids` holds pair ids (t * k + j) with the sentinel
   T*k in padding rows, `block_expert` one expert per M-block (-1 past the end), `num_padded` the
   padded row count. Its length is a static bound, T*k + min(E, T*k) * (BLOCK_M - 1), so shapes
   never depend on the routing (CUDA graphs, torch.compile).
2. `_expert_gemm_kernel` (gate/up): M-block x N-block programs; rows of x gathered through
   pair // k; gate and up accumulated side by side and silu(gate) * up stored per pair [T*k, I].
   (`TileConfig.split_gate_up`, for the tile sweep: gate and up as one plain GEMM over the 2I rows, stored
   [T*k, 2I], then silu(gate) * up in the pass that quantises the down GEMM's input.)
   Where its programs are fewer than the SMs (a tensor-parallel rank's narrow experts at batch 1-2:
   `gate_up_splits`), split along K: fp32 gate and up partials [splits, T*k, 2I], summed by that same pass.
3. The same kernel (down) over that intermediate, times the routing weight, stored per pair [T*k, H].
4. `combine_rows` sums each token's k pair rows in one pass (fp32 accumulation, deterministic: no atomics), the
   addend after them, then rounds.

M-blocks past `num_padded` return before reading anything, so only the chosen experts' weights are
read. Memory: O(T * k * (I + H)); the Triton wrapper goes through the tokens in chunks of
MAX_CHUNK_TOKENS to bound it.

`fused_moe_reference` is the same math in torch (a loop over the experts that got tokens, the same
rounding points: intermediate and per-pair outputs in x's dtype, the k-sum + addend in fp32, FP8 through
`fp8.w8a8_block_matmul_reference`): the CPU path and the test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minidsa.kernels import fp8, num_sms
from minidsa.kernels.fp8_gemm import EMULATE_CAST, _quant_tile, quant_act
from minidsa.kernels.fp8_gemm import mn_major_scales as mn_major_scales_of
from minidsa.kernels.moe_layout import expert_rows, max_padded_rows
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

SKIP = -1  # a topk id meaning "this pair's expert is on another rank" (expert parallelism): computed nowhere here
MAX_CHUNK_TOKENS = 8192  # tokens per pass: bounds the [T*k, H] per-pair buffer (~0.9 GiB in bf16 at H 7168)


@dataclass(frozen=True)
class TileConfig:
    """Tiles of both GEMM launches (BLOCK_M rows of sorted pairs per program)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int  # M-blocks that walk the N-blocks together (weight tiles stay in L2)
    num_warps: int
    num_stages: int
    # gate/up as one plain GEMM over the 2I rows (output [T*k, 2I]), then silu(gate) * up in the pass that
    # quantises the down GEMM's input: one accumulator per program instead of two (an FP8 block-scaled dot
    # needs a third, per K step), at the cost of writing and reading [T*k, 2I] once. For the sweep
    # (benchmarks/scripts/bench_moe.py --sweep); not a default until measured faster.
    split_gate_up: bool = False
    # K ranges the gate/up GEMM is split into (0: decided per launch, `gate_up_splits`). Split, gate and up go to an
    # fp32 [splits, pairs, 2I] buffer, and the pass that quantises the down GEMM's input sums them first (`silu_mul`).
    gate_up_split_k: int = 0


def gate_up_splits(programs: int, k_blocks: int, sms: int, fp8_weights: bool) -> int:
    """K ranges for a gate/up GEMM of `programs` (M-block x N-block) programs over `k_blocks` 128-deep K steps.

    At decode sizes the gate/up GEMM's programs are M-blocks (one per chosen expert, about T x k of them) times
    I / BLOCK_N N-blocks. One GPU at batch 1 has 8 x 32 = 256 for 132 SMs; under --tp 4 each expert's I is 512, so
    8 x 8 = 64 programs each stream a whole 7168-deep K: half the SMs idle and the step waits on the longest. Split
    along K to about two programs per SM (each K range at least 4 steps), as the dense FP8 GEMM does
    (`fp8_gemm.pick_tiles`). FP8 weights only: the served decode path."""
    if not fp8_weights or programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), k_blocks // 4))


def tile_config(num_tokens: int, top_k: int, n_experts: int, weight_dtype: torch.dtype,
                act_dtype: torch.dtype) -> TileConfig:
    """Fixed tiles by pairs per expert (no autotuning: the choice must be cheap and bounded).

    Few pairs per expert (decode): BLOCK_M 16, the smallest tl.dot takes, narrow N for more programs.
    Many (prefill): larger M tiles, so each weight tile is reused by more rows. Shared memory per stage
    stays under ~64 KiB (gate and up tiles are both in flight in the first GEMM).
    """
    pairs_per_expert = num_tokens * top_k / max(n_experts, 1)
    if weight_dtype == fp8.FP8_DTYPE:
        if pairs_per_expert <= 16:
            return TileConfig(16, 64, 128, 1, 4, 4)
        if pairs_per_expert <= 32:
            return TileConfig(32, 128, 128, 8, 4, 4)
        if pairs_per_expert <= 128:
            return TileConfig(64, 128, 128, 8, 4, 3)
        # H100 sweep at 8192 tokens, V3.2 shapes (bench_moe --sweep, benchmarks/moe/fused_moe_sweep_h100_49630c3.json):
        # M64 N256 w8 11.3 ms (512 TFLOP/s) against 34.0 ms for M128 N128 w8 (the FP8 dot's extra accumulator spills at
        # M128).
        return TileConfig(64, 256, 128, 8, 8, 3)
    if act_dtype == torch.float32:  # the parity / debug dtype: 4-byte tiles, less K per stage
        if pairs_per_expert <= 16:
            return TileConfig(16, 64, 32, 1, 4, 2)
        return TileConfig(64, 64, 32, 8, 4, 2)
    if pairs_per_expert <= 16:
        return TileConfig(16, 64, 128, 1, 4, 3)
    if pairs_per_expert <= 32:
        return TileConfig(32, 128, 64, 8, 4, 4)
    if pairs_per_expert <= 128:
        return TileConfig(64, 128, 64, 8, 4, 4)
    return TileConfig(128, 128, 64, 8, 8, 3)


@dataclass(frozen=True)
class ExpertBlocks:
    """The (token, choice) pairs sorted by expert and padded to whole M-blocks (all on the device)."""

    sorted_pair_ids: torch.Tensor  # [max_rows] int32: pair id t * k + j; padding = num_pairs
    block_expert: torch.Tensor  # [max_rows // block_m] int32: expert of each M-block, -1 past the end
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    num_pairs: int
    block_m: int


def align_pairs_to_blocks(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> ExpertBlocks:
    """Sort pairs by expert, pad each expert's rows to a multiple of block_m; no host sync, no host copy, static
    shapes: CUDA graphs capture it (extend graphs of more than ALIGN_KERNEL_MAX_PAIRS pairs).

    An id of -1 (SKIP: an expert of another rank) places no row: the pair is computed nowhere."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    key = torch.where(flat >= 0, flat, n_experts)  # skipped pairs: one bucket past the last expert
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts[n_experts:].zero_()  # ... that gets no rows (a kernel: a host scalar copy breaks graph capture)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    count_start = counts.cumsum(0) - counts
    order = torch.sort(key, stable=True).indices  # pair ids grouped by expert, in pair order within one
    sorted_expert = key[order]
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_expert]  # position among its expert's
    max_rows = max_padded_rows(num_pairs, n_experts, block_m)
    dest = torch.where(sorted_expert < n_experts, padded_end[sorted_expert] - padded[sorted_expert] + rank, max_rows)
    sorted_pair_ids = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=device)  # + a dump row
    sorted_pair_ids[dest] = order.to(torch.int32)
    sorted_pair_ids = sorted_pair_ids[:max_rows]
    padded_end = padded_end[:n_experts]
    block_start = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < n_experts, block_expert, -1).to(torch.int32)
    return ExpertBlocks(sorted_pair_ids, block_expert, padded_end[-1:].to(torch.int32), num_pairs, block_m)


ALIGN_KERNEL_MAX_PAIRS = 1024  # up to here one Triton program aligns the pairs (decode); torch ops above


# Row / pair counts are not specialised on: each divisibility class would be a variant compiled at start-up.
@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(
    ids_ptr, sorted_pair_ptr, block_expert_ptr, num_padded_ptr, num_pairs, n_experts, max_rows,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr = False,
):
    """align_pairs_to_blocks in one program (one launch instead of ~30 small torch ops: decode runs in graphs).

    Same output, element for element: pairs of one expert in pair order, padding and tail = num_pairs.
    """
    wait_for_producers(PDL)
    e = tl.arange(0, E_POW2)
    e_ok = e < n_experts
    q = tl.arange(0, CHUNK)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + p0 + q, mask=p0 + q < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)

    fill = start  # next free row of each expert
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + q
        ok = p < num_pairs
        ids = tl.load(ids_ptr + p, mask=ok, other=-1).to(tl.int32)
        onehot = ids[:, None] == e[None, :]  # [CHUNK, E]
        base = tl.sum(tl.where(onehot, fill[None, :], 0), axis=1)
        # earlier pairs of this chunk with the same expert (masked pairs are -1 and come last)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & (q[None, :] < q[:, None])).to(tl.int32), axis=1)
        tl.store(sorted_pair_ptr + base + rank, p, mask=ok & (ids >= 0))  # -1: a skipped pair, no row
        fill += tl.sum(onehot.to(tl.int32), axis=0)

    # the sentinel in each expert's padding rows and in the rows past the end (no row is written twice)
    pad_rows = (start + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_pair_ptr + pad_rows, num_pairs, mask=(pad_rows < end[:, None]) & e_ok[:, None])
    for r0 in range(0, max_rows, TAIL):
        r = r0 + tl.arange(0, TAIL)
        tl.store(sorted_pair_ptr + r, num_pairs, mask=(r >= total) & (r < max_rows))

    num_blocks = max_rows // BLOCK_M
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + q
        first_row = b * BLOCK_M
        expert = tl.sum(((end[None, :] <= first_row[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(first_row < total, expert, -1), mask=b < num_blocks)


def align_pairs_to_blocks_triton(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> ExpertBlocks:
    """align_pairs_to_blocks through `_align_kernel` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    ids = topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    max_rows = max_padded_rows(num_pairs, n_experts, block_m)
    sorted_pair_ids = torch.empty(max_rows, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](ids, sorted_pair_ids, block_expert, num_padded, num_pairs, n_experts, max_rows,
                        BLOCK_M=block_m, E_POW2=triton.next_power_of_2(n_experts), CHUNK=32, TAIL=1024,
                        num_warps=8, **pdl_launch(ids.device))
    return ExpertBlocks(sorted_pair_ids, block_expert, num_padded, num_pairs, block_m)


def align_pairs_to_blocks_chunked(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> ExpertBlocks:
    """align_pairs_to_blocks in five launches over chunks of pairs (`moe_layout.expert_rows`), for more pairs than
    one program aligns quickly: the torch version is ~30 ops and a stable sort."""
    rows = expert_rows(topk_ids, n_experts, block_m)
    return ExpertBlocks(rows.row_pair, rows.block_expert, rows.num_rows, rows.num_pairs, block_m)


def align_for(num_pairs: int):
    """The alignment that serves this many pairs: one program up to ALIGN_KERNEL_MAX_PAIRS (decode), chunks above."""
    return align_pairs_to_blocks_triton if num_pairs <= ALIGN_KERNEL_MAX_PAIRS else align_pairs_to_blocks_chunked


# Row / pair counts are not specialised on: each divisibility class would be a variant compiled at start-up.
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _expert_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, route_w_ptr,
    sorted_pair_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_pairs, pairs_per_a_row, num_m_blocks, k_per_split, stride_split,
    stride_am, stride_asm, stride_be, stride_bn, stride_cm, stride_se, stride_sn, stride_sk,
    GATED: tl.constexpr, APPLY_ROUTE_W: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """C[pair, n] = sum_k A[pair // pairs_per_a_row, k] * B[expert, n, k] for the pairs of one M-block.

    GATED: B holds gate rows [0, N) then up rows [N, 2N); C = silu(A @ gate^T) * (A @ up^T).
    APPLY_ROUTE_W: C is multiplied by the pair's routing weight. FP8: B is e4m3 with per-128x128
    block scales; A is e4m3 too, quantised beforehand per row per 128 channels (scales [rows, K/128];
    BLOCK_K == 128 == the quantisation group).
    SPLIT_K (GATED only): program axis 1 takes the K range [axis1 * k_per_split, + k_per_split) and stores its fp32
    gate sums at C[axis1, pair, n] and up sums at C[axis1, pair, N + n] (split stride `stride_split`), unactivated.
    """
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    # GROUP_M M-blocks (mostly one expert's) take each N-block in turn: its weight tile stays in L2.
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the padded rows: nothing to read
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + offs_m)
    row_ok = pair < num_pairs
    a_row = (pair // pairs_per_a_row).to(tl.int64)
    a_rows = a_ptr + a_row * stride_am
    a_scale_rows = a_scale_ptr + a_row * stride_asm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n_row = tl.where(n_ok, offs_n, 0)  # columns past N read row 0 (discarded): unmasked weight loads
    b_rows = b_ptr + expert * stride_be + n_row.to(tl.int64) * stride_bn
    up_rows = b_rows + N * stride_bn
    s_rows = b_scale_ptr + expert * stride_se + (n_row // 128) * stride_sn
    s_up_rows = b_scale_ptr + expert * stride_se + ((n_row + N) // 128) * stride_sn
    kk = tl.arange(0, BLOCK_K)
    k_lo, k_hi = 0, K
    if SPLIT_K:
        k_lo = tl.program_id(1) * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            a = tl.load(a_rows[:, None] + k[None, :], mask=row_ok[:, None], other=0.0)
            b = tl.load(b_rows[None, :] + k[:, None])
        else:
            k_ok = k < K
            a = tl.load(a_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_rows[None, :] + k[:, None], mask=k_ok[:, None], other=0.0)
        a_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if FP8:  # this K step's activation scale of each row
            a_scale = tl.load(a_scale_rows + k0 // 128, mask=row_ok, other=0.0)
        if FP8:
            acc += tl.dot(a, b) * a_scale[:, None] * tl.load(s_rows + (k0 // 128) * stride_sk)[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(up_rows[None, :] + k[:, None])
            else:
                b_up = tl.load(up_rows[None, :] + k[:, None], mask=k_ok[:, None], other=0.0)
            if FP8:
                acc_up += tl.dot(a, b_up) * a_scale[:, None] * tl.load(s_up_rows + (k0 // 128) * stride_sk)[None, :]
            else:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)

    if SPLIT_K:
        part = c_ptr + tl.program_id(1).to(tl.int64) * stride_split + pair.to(tl.int64)[:, None] * stride_cm
        store_ok = row_ok[:, None] & n_ok[None, :]
        tl.store(part + offs_n[None, :], acc, mask=store_ok)
        tl.store(part + N + offs_n[None, :], acc_up, mask=store_ok)
        return
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if APPLY_ROUTE_W:
        acc = acc * tl.load(route_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, gate_up_scale_inv: torch.Tensor | None,
                 down_scale_inv: torch.Tensor | None, addend: torch.Tensor | None = None) -> None:
    """Clear errors for shapes and dtypes the kernels (and the reference) do not take."""
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: want x [T, H], topk_ids and topk_weights [T, k]; got x {tuple(x.shape)}, "
                         f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}")
    if addend is not None and (addend.shape != x.shape or addend.dtype != x.dtype):
        raise ValueError(f"fused_moe: want addend of x's shape and dtype {tuple(x.shape)} {x.dtype}; got "
                         f"{tuple(addend.shape)} {addend.dtype}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"fused_moe: want gate_up_proj [E, 2I, H] and down_proj [E, H, I]; got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    e, two_i, h = gate_up_proj.shape
    if h != x.shape[1] or two_i % 2 or tuple(down_proj.shape) != (e, h, two_i // 2):
        raise ValueError(f"fused_moe: want gate_up_proj [E, 2I, H] and down_proj [E, H, I] with H = "
                         f"{x.shape[1]}; got {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_moe: x must be bf16, fp16 or fp32, got {x.dtype}")
    fp8_weights = gate_up_proj.dtype == fp8.FP8_DTYPE
    if fp8_weights != (down_proj.dtype == fp8.FP8_DTYPE):
        raise ValueError(f"fused_moe: gate_up_proj and down_proj must both be FP8 or neither; got "
                         f"{gate_up_proj.dtype} and {down_proj.dtype}")
    if not fp8_weights:
        if gate_up_scale_inv is not None or down_scale_inv is not None:
            raise ValueError(f"fused_moe: *_scale_inv given for {gate_up_proj.dtype} weights (FP8 e4m3 only)")
        if not (x.dtype == gate_up_proj.dtype == down_proj.dtype):
            raise ValueError(f"fused_moe: x, gate_up_proj and down_proj must share a dtype; got {x.dtype}, "
                             f"{gate_up_proj.dtype}, {down_proj.dtype}")
        return
    for name, w, s in (("gate_up_proj", gate_up_proj, gate_up_scale_inv), ("down_proj", down_proj, down_scale_inv)):
        want = (e, *fp8.block_scale_shape(w.shape[1], w.shape[2]))
        if s is None or tuple(s.shape) != want or s.dtype != torch.float32:
            got = "missing" if s is None else f"{tuple(s.shape)} {s.dtype}"
            raise ValueError(f"fused_moe: FP8 {name} {tuple(w.shape)} needs {name}_scale_inv {want} float32; "
                             f"got {got}")


def _expert_matmul(a: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    """a [R, K] @ weight[N, K]^T in fp32 (w8a8 block-scaled when scale_inv is given)."""
    if scale_inv is None:
        return a.float() @ weight.float().t()
    return fp8.w8a8_block_matmul_reference(a, weight, scale_inv, out_dtype=torch.float32)


def fused_moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                        gate_up_scale_inv: torch.Tensor | None = None,
                        down_scale_inv: torch.Tensor | None = None, addend: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The fused MoE in torch: a loop over the experts that got pairs, the kernels' rounding points; `addend`
    added to the k rows' fp32 sum before its one rounding."""
    check_inputs(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv, down_scale_inv, addend)
    num_tokens, top_k = topk_ids.shape
    n_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat >= 0, flat, n_experts)  # SKIP pairs sort last and are never computed
    route_w = topk_weights.reshape(-1).float()
    per_pair = x.new_zeros(num_tokens * top_k, hidden)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts].tolist()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        gate_up = _expert_matmul(x[pairs // top_k], gate_up_proj[e],
                                 None if gate_up_scale_inv is None else gate_up_scale_inv[e])
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        y = _expert_matmul(h, down_proj[e], None if down_scale_inv is None else down_scale_inv[e])
        per_pair[pairs] = (y * route_w[pairs, None]).to(x.dtype)
    routed = per_pair.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32)
    return (routed if addend is None else routed + addend.float()).to(x.dtype)


def _tl_dtype(dtype: torch.dtype):
    """Triton's name for a float dtype the activations come in."""
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, scale_ptr, row_expert_ptr, rows, inter, stride_g, stride_o, stride_s_row,
                     stride_s_group, stride_split, ROWS: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr,
                     SKIP_PADDING: tl.constexpr, EMULATE_CAST: tl.constexpr, SPLITS: tl.constexpr,
                     MID_DTYPE: tl.constexpr, PDL: tl.constexpr = False):
    """out[r, c] = silu(gu[r, c]) * gu[r, inter + c] for one [ROWS, GROUP] tile, rounded to MID_DTYPE (as the fused
    epilogue stores it); QUANT: then e4m3 per row per GROUP channels, one fp32 scale each.
    SPLITS > 1: gu is the split gate/up GEMM's fp32 partials, SPLITS of them `stride_split` apart, summed in split
    order first. SKIP_PADDING: rows whose row_expert is negative (padding of a grouped GEMM's layout) are neither
    read nor written."""
    wait_for_producers(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    c = g * GROUP + tl.arange(0, GROUP)
    r_ok = r < rows
    if SKIP_PADDING:
        r_ok = r_ok & (tl.load(row_expert_ptr + r, mask=r_ok, other=-1) >= 0)
    mask = r_ok[:, None] & (c[None, :] < inter)
    row = gu_ptr + r.to(tl.int64)[:, None] * stride_g
    gate = tl.load(row + c[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + c[None, :], mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(1, SPLITS):
        gate += tl.load(row + i * stride_split + c[None, :], mask=mask, other=0.0)
        up += tl.load(row + i * stride_split + inter + c[None, :], mask=mask, other=0.0)
    mid = (gate * tl.sigmoid(gate) * up).to(MID_DTYPE).to(tl.float32)
    out = out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :]
    if QUANT:
        q, scale = _quant_tile(mid, EMULATE_CAST)
        tl.store(out, q, mask=mask)
        tl.store(scale_ptr + r * stride_s_row + g * stride_s_group, scale, mask=r_ok)
    else:
        tl.store(out, mid.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, quantise: bool, row_expert: torch.Tensor | None = None,
             mn_major_scales: bool = False, mid_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[R, 2I] (gate columns, then up) -> silu(gate) * up [R, I] in gate_up's dtype, or with `quantise` e4m3
    [R, I] + fp32 scales [R, ceil(I/128)] (`fp8.quant_act_per_token_group` of that product).

    gate_up [S, R, 2I] fp32: a split gate/up GEMM's partial sums, added in split order first; the product is rounded
    to `mid_dtype` (the activations' dtype, as the unsplit GEMM's epilogue stores it) and is of that dtype unquantised.

    `row_expert` [R]: rows where it is negative are padding (a grouped GEMM's layout, `moe_layout.ExpertRows`): left
    unwritten, and their inputs unread (a fifth of the rows at 8192 tokens, V3.2 routing, 128-row alignment).
    `mn_major_scales`: scales laid out as DeepGEMM's grouped GEMM reads them (`fp8_gemm.mn_major_scales`)."""
    splits = gate_up.shape[0] if gate_up.dim() == 3 else 1
    rows, two_i = gate_up.shape[-2:]
    inter = two_i // 2
    groups = triton.cdiv(inter, fp8.FP8_BLOCK)
    mid_dtype = mid_dtype or gate_up.dtype
    out = torch.empty(rows, inter, dtype=fp8.FP8_DTYPE if quantise else mid_dtype, device=gate_up.device)
    scales = None
    if quantise:
        scales = (mn_major_scales_of(rows, groups, gate_up.device) if mn_major_scales
                  else torch.empty(rows, groups, dtype=torch.float32, device=gate_up.device))
    if rows:
        rows_per_program = 16
        s = scales if quantise else out
        _silu_mul_kernel[(triton.cdiv(rows, rows_per_program), groups)](
            gate_up, out, s, row_expert if row_expert is not None else out, rows, inter, gate_up.stride(-2),
            out.stride(0), s.stride(0), s.stride(1) if quantise else 0, gate_up.stride(0) if splits > 1 else 0,
            ROWS=rows_per_program, GROUP=fp8.FP8_BLOCK, QUANT=quantise, SKIP_PADDING=row_expert is not None,
            EMULATE_CAST=EMULATE_CAST, SPLITS=splits,
            MID_DTYPE=_tl_dtype(mid_dtype), **pdl_launch(gate_up.device))
    return out, scales


@triton.jit
def _combine_rows_kernel(rows_ptr, row_of_pair_ptr, weight_ptr, addend_ptr, out_ptr, hidden, stride_r, stride_a,
                         stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
                         WEIGHTED: tl.constexpr, ADDEND: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, h-block] = sum_j weight[t, j] * rows[row_of_pair[t, j], h-block] (+ addend[t, h-block]), accumulated
    in fp32, rounded once; a row index of -1 adds nothing. Without GATHER pair (t, j) is row t * TOP_K + j; without
    WEIGHTED every weight is 1. The addend comes after the k rows, so in fp32 the result is the k rows' sum plus
    the addend, as two separate ops would give."""
    wait_for_producers(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = h < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if GATHER:
            r = tl.load(row_of_pair_ptr + t * TOP_K + j).to(tl.int64)
            has_row = (h * 0 + r) >= 0  # as a block: Triton's interpreter rejects a scalar mask broadcast into one
            v = tl.load(rows_ptr + r * stride_r + h, mask=mask & has_row, other=0.0).to(tl.float32)
        else:
            v = tl.load(rows_ptr + (t.to(tl.int64) * TOP_K + j) * stride_r + h, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(weight_ptr + t * TOP_K + j)
        acc += v
    if ADDEND:
        acc += tl.load(addend_ptr + t.to(tl.int64) * stride_a + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_rows(rows: torch.Tensor, row_of_pair: torch.Tensor | None, weights: torch.Tensor | None,
                 top_k: int | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's k rows of `rows` [R, H], weighted by its routing weights [T, k] and summed in fp32 -> [T, H]
    in rows' dtype: one read of the rows, one write of the result (torch's `.sum(1, dtype=float32).to(dtype)`
    also writes and reads a [T, H] fp32 intermediate). Reference: `reference.combine_rows`.

    row_of_pair [T, k]: the row holding each (token, choice) pair, -1 for none (a pair computed on another rank);
    None: pair (t, j) is row t * top_k + j. weights None: all 1 (the weights were applied before). addend [T, H]:
    added to each token's sum in fp32 before the one rounding (the shared experts' output: no add launch of its
    own)."""
    if row_of_pair is not None:
        num_tokens, top_k = row_of_pair.shape
    else:
        num_tokens = rows.shape[0] // top_k
    hidden = rows.shape[1]
    # A short addend would be read past its end; another dtype would be summed as given (DeepGEMM's path checks
    # nothing else before this).
    if addend is not None and (tuple(addend.shape) != (num_tokens, hidden) or addend.dtype != rows.dtype):
        raise ValueError(f"combine_rows: want addend [{num_tokens}, {hidden}] {rows.dtype}, got "
                         f"{tuple(addend.shape)} {addend.dtype}")
    out = torch.empty(num_tokens, hidden, dtype=rows.dtype, device=rows.device)
    if num_tokens == 0:
        return out
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if addend is not None and addend.stride(-1) != 1:
        addend = addend.contiguous()
    index = row_of_pair.to(torch.int32).contiguous() if row_of_pair is not None else out
    w = weights.float().contiguous() if weights is not None else out
    add = addend if addend is not None else out
    block = 1024
    _combine_rows_kernel[(num_tokens, triton.cdiv(hidden, block))](
        rows, index, w, add, out, hidden, rows.stride(0), add.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
        GATHER=row_of_pair is not None, WEIGHTED=weights is not None, ADDEND=addend is not None,
        **pdl_launch(rows.device))
    return out


def fused_moe_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     gate_up_scale_inv: torch.Tensor | None = None, down_scale_inv: torch.Tensor | None = None,
                     config: TileConfig | None = None, max_chunk_tokens: int = MAX_CHUNK_TOKENS,
                     has_skipped: bool = False, act: tuple[torch.Tensor, torch.Tensor] | None = None,
                     addend: torch.Tensor | None = None) -> torch.Tensor:
    """The fused MoE through the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1); tiles by token count.

    `has_skipped`: topk_ids may hold SKIP (-1, an expert of another rank under expert parallelism); those pairs
    get no GEMM rows and add nothing (their per-pair rows start at zero). `act`: FP8 experts' input x already
    quantised (e4m3 [T, H], fp32 scales [T, ceil(H/128)]: `fp8.quant_act_per_token_group`'s values, e.g. from the
    norm before it, `norm_quant.rmsnorm_quant`); the gate/up GEMM reads it instead of quantising x again.
    `addend` [T, H]: added in the launch that sums the routed rows (`combine_rows`)."""
    check_inputs(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv, down_scale_inv, addend)
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    if num_tokens == 0 or top_k == 0:
        return x.new_zeros(num_tokens, hidden) if addend is None else addend.clone()
    if num_tokens > max_chunk_tokens:
        return torch.cat([
            fused_moe_triton(x[s:s + max_chunk_tokens], topk_ids[s:s + max_chunk_tokens],
                             topk_weights[s:s + max_chunk_tokens], gate_up_proj, down_proj, gate_up_scale_inv,
                             down_scale_inv, config, max_chunk_tokens, has_skipped,
                             None if act is None else (act[0][s:s + max_chunk_tokens], act[1][s:s + max_chunk_tokens]),
                             None if addend is None else addend[s:s + max_chunk_tokens])
            for s in range(0, num_tokens, max_chunk_tokens)
        ])
    n_experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    is_fp8 = gate_up_proj.dtype == fp8.FP8_DTYPE
    cfg = config or tile_config(num_tokens, top_k, n_experts, gate_up_proj.dtype, x.dtype)
    if is_fp8 and cfg.block_k != fp8.FP8_BLOCK:
        raise ValueError(f"fused_moe: FP8 weights need block_k == {fp8.FP8_BLOCK} (one activation scale per K "
                         f"step), got {cfg.block_k}")
    # Only the last dim must be dense; the kernels take row strides.
    x, gate_up_proj, down_proj = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate_up_proj, down_proj))
    blocks = align_for(topk_ids.numel())(topk_ids, n_experts, cfg.block_m)
    num_m_blocks = blocks.block_expert.numel()
    route_w = topk_weights.reshape(-1).float().contiguous()
    num_kb = triton.cdiv(hidden, cfg.block_k)
    splits = 1 if cfg.split_gate_up else (cfg.gate_up_split_k or gate_up_splits(
        num_m_blocks * triton.cdiv(inter, cfg.block_n), num_kb, num_sms(x.device), is_fp8))
    k_per_split = triton.cdiv(num_kb, splits) * cfg.block_k
    splits = triton.cdiv(num_kb * cfg.block_k, k_per_split)  # no empty K range
    mid = None if cfg.split_gate_up or splits > 1 else torch.empty(blocks.num_pairs, inter, dtype=x.dtype,
                                                                   device=x.device)
    # FP8: each GEMM's input quantised once, per row per 128 channels (fp8.quant_act_per_token_group's values),
    # not in every N-block's program: at prefill sizes that re-quantisation cost 20x the GEMM.
    if is_fp8 and act is not None:
        a, a_scale = act
        if a.shape != x.shape or a_scale.shape != (num_tokens, -(-hidden // fp8.FP8_BLOCK)) or a.stride(-1) != 1:
            raise ValueError(f"fused_moe: quantised input {tuple(a.shape)} + scales {tuple(a_scale.shape)} do not "
                             f"fit x {tuple(x.shape)}")
    else:
        a, a_scale = quant_act(x) if is_fp8 else (x, route_w)
    per_pair = (torch.zeros if has_skipped else torch.empty)(blocks.num_pairs, hidden, dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(GROUP_M=cfg.group_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  FP8=is_fp8, PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def scale_args(s: torch.Tensor | None) -> tuple:
        return (s, s.stride(0), s.stride(1), s.stride(2)) if s is not None else (route_w, 0, 0, 0)

    gu_scale, gu_se, gu_sn, gu_sk = scale_args(gate_up_scale_inv)
    # split_gate_up: the 2I gate and up rows as one plain GEMM (N = 2I), silu * up after it. Split along K: fp32
    # partial gate and up sums [splits, pairs, 2I], summed by that same pass.
    if splits > 1:
        gu_out = torch.empty(splits, blocks.num_pairs, two_i, dtype=torch.float32, device=x.device)
    elif cfg.split_gate_up:
        gu_out = torch.empty(blocks.num_pairs, two_i, dtype=x.dtype, device=x.device)
    else:
        gu_out = mid
    gu_n = two_i if cfg.split_gate_up else inter
    _expert_gemm_kernel[(num_m_blocks * triton.cdiv(gu_n, cfg.block_n), splits)](
        a, a_scale, gate_up_proj, gu_scale, gu_out, route_w,
        blocks.sorted_pair_ids, blocks.block_expert, blocks.num_padded,
        gu_n, hidden, blocks.num_pairs, top_k, num_m_blocks, k_per_split, gu_out.stride(0) if splits > 1 else 0,
        a.stride(0), a_scale.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), gu_out.stride(-2),
        gu_se, gu_sn, gu_sk,
        GATED=not cfg.split_gate_up, APPLY_ROUTE_W=False, EVEN_K=hidden % cfg.block_k == 0, SPLIT_K=splits > 1,
        **launch, **pdl_launch(a.device),
    )
    dn_scale, dn_se, dn_sn, dn_sk = scale_args(down_scale_inv)
    if cfg.split_gate_up or splits > 1:
        a, a_scale = silu_mul(gu_out, quantise=is_fp8, mid_dtype=x.dtype)
        del gu_out
        a_scale = a_scale if is_fp8 else route_w
    else:
        a, a_scale = quant_act(mid) if is_fp8 else (mid, route_w)
    _expert_gemm_kernel[(num_m_blocks * triton.cdiv(hidden, cfg.block_n),)](
        a, a_scale, down_proj, dn_scale, per_pair, route_w,
        blocks.sorted_pair_ids, blocks.block_expert, blocks.num_padded,
        hidden, inter, blocks.num_pairs, 1, num_m_blocks, 0, 0,
        a.stride(0), a_scale.stride(0), down_proj.stride(0), down_proj.stride(1), per_pair.stride(0),
        dn_se, dn_sn, dn_sk,
        GATED=False, APPLY_ROUTE_W=True, EVEN_K=inter % cfg.block_k == 0, **launch, **pdl_launch(a.device),
    )
    # each token's k rows (routing weights applied in the down GEMM) summed in fp32, the addend with them, in one pass
    return combine_rows(per_pair, None, None, top_k, addend)
