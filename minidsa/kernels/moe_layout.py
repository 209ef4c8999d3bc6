"""The per-expert row layout of the routed experts at prefill sizes, and the token rows gathered into it.

Grouped GEMMs want each expert's (token, choice) pairs in contiguous rows, every expert's rows padded to a
multiple of an alignment (the Triton fused MoE's BLOCK_M; DeepGEMM's contiguous layout, 128 on SM90).
`expert_rows` lays the pairs out in five launches with no host sync and shapes fixed by the token count
(two fills, then per chunk of pairs: count per expert; one program: each expert's padded start and each chunk's
offset inside it; per chunk: place), instead of the ~30 torch ops and the stable sort of
`fused_moe.align_pairs_to_blocks` (its reference, element for element: pairs of one expert in pair order).

`quant_scatter` quantises each token's hidden row once (e4m3, one fp32 scale per 128 channels: the values of
`fp8.quant_act_per_token_group`) and writes it straight into the rows of its k pairs. The path it replaces
quantised into a [T, H] buffer, then gathered [rows, H] bytes out of it in a second pass: about 2.3x the bytes
(at 8192 tokens, V3.2 shapes: 1.39 GB against 0.60 GB). Padding rows are left unwritten: a GEMM row depends on
its own input row only, and nothing reads a padding row's output (DeepGEMM is told they are padding, -1).

References: kernels/reference.py (`expert_rows`, `quant_scatter`); CPU tests under Triton's interpreter in
tests/test_fused_moe.py; real shapes in tests/gpu/test_moe_prefill_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidsa.kernels import fp8
from minidsa.kernels.fp8_gemm import EMULATE_CAST, _quant_tile, mn_major_scales
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

CHUNK = 128  # pairs per program of the count and place kernels: a [CHUNK, E] one-hot and a [CHUNK, CHUNK] compare
OFFSET_ROWS = 32  # chunks per step of the one-program offsets scan


def max_padded_rows(num_pairs: int, n_experts: int, alignment: int) -> int:
    """Static bound on the padded rows: each expert that got pairs (at most min(E, pairs)) pads < alignment."""
    bound = num_pairs + min(n_experts, num_pairs) * (alignment - 1)
    return -(-bound // alignment) * alignment


@dataclass(frozen=True)
class ExpertRows:
    """The (token, choice) pairs in rows grouped by expert, each expert's rows padded to a multiple of `alignment`.

    Row r < num_rows holds pair row_pair[r] of expert row_expert[r], or is padding (row_expert -1, row_pair
    num_pairs): DeepGEMM's `m_indices`, and `fused_moe.ExpertBlocks`' `sorted_pair_ids`. Rows past num_rows (up to
    the static bound) are padding too."""

    row_expert: torch.Tensor  # [max_rows] int32
    row_pair: torch.Tensor  # [max_rows] int32
    block_expert: torch.Tensor  # [max_rows // alignment] int32: the expert of each aligned block, -1 past the end
    row_of_pair: torch.Tensor  # [num_pairs] int32: the row of pair t * k + j; -1 for a SKIP pair (no row)
    num_rows: torch.Tensor  # [1] int32: rows in use, a multiple of alignment
    num_pairs: int
    alignment: int


# The token counts below are not specialised on (Triton would compile a variant per divisibility by 16 / equality to
# 1 of each): these small kernels lose nothing by it, and start-up compiles each once instead of per size class.
@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, E_POW2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """counts[c, e] = pairs of chunk c routed to expert e (SKIP ids, -1, match none)."""
    wait_for_producers(PDL)
    c = tl.program_id(0)
    q = tl.arange(0, CHUNK)
    p = c * CHUNK + q
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    e = tl.arange(0, E_POW2)
    counts = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * E_POW2 + e, counts)


@triton.jit(do_not_specialize=["num_chunks"])
def _offsets_kernel(counts_ptr, offsets_ptr, start_ptr, num_rows_ptr, num_chunks, n_experts,
                    ALIGN: tl.constexpr, E_POW2: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr = False):
    """One program. offsets[c, e] = pairs of expert e in chunks before c (in place of counts); start[e] = the
    first row of expert e (every expert before it padded to ALIGN); num_rows = all padded rows."""
    wait_for_producers(PDL)
    e = tl.arange(0, E_POW2)
    e_ok = e < n_experts
    carry = tl.zeros([E_POW2], dtype=tl.int32)
    for c0 in range(0, num_chunks, STEP):
        c = c0 + tl.arange(0, STEP)
        at = c[:, None] * E_POW2 + e[None, :]
        ok = (c < num_chunks)[:, None] & e_ok[None, :]
        counts = tl.load(counts_ptr + at, mask=ok, other=0)
        tl.store(offsets_ptr + at, tl.cumsum(counts, axis=0) - counts + carry[None, :], mask=ok)
        carry += tl.sum(counts, axis=0)
    padded = (carry + ALIGN - 1) // ALIGN * ALIGN
    tl.store(start_ptr + e, tl.cumsum(padded, axis=0) - padded)
    tl.store(num_rows_ptr, tl.sum(padded, axis=0))


@triton.jit(do_not_specialize=["num_pairs"])
def _place_kernel(ids_ptr, offsets_ptr, start_ptr, row_of_pair_ptr, row_expert_ptr, row_pair_ptr, block_expert_ptr,
                  num_pairs, ALIGN: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Each pair of chunk c to its row: its expert's start + pairs of that expert in earlier chunks + earlier pairs
    of that expert in this chunk (so one expert's pairs keep pair order, as a stable sort keeps them)."""
    wait_for_producers(PDL)
    c = tl.program_id(0)
    q = tl.arange(0, CHUNK)
    p = c * CHUNK + q
    ok = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=ok, other=-1).to(tl.int32)
    placed = ok & (ids >= 0)
    expert = tl.where(placed, ids, 0)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (q[None, :] < q[:, None])).to(tl.int32), axis=1)
    within = tl.load(offsets_ptr + c * E_POW2 + expert) + rank  # position among the expert's rows
    row = tl.load(start_ptr + expert) + within
    tl.store(row_of_pair_ptr + p, tl.where(placed, row, -1), mask=ok)
    tl.store(row_expert_ptr + row, ids, mask=placed)
    tl.store(row_pair_ptr + row, p, mask=placed)
    tl.store(block_expert_ptr + row // ALIGN, ids, mask=placed & (within % ALIGN == 0))


def expert_rows(topk_ids: torch.Tensor, n_experts: int, alignment: int) -> ExpertRows:
    """Lay the pairs of topk_ids [T, k] out per expert (see ExpertRows); CUDA, or CPU under TRITON_INTERPRET=1.
    No host sync and shapes fixed by T * k: CUDA graphs capture it."""
    ids = topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    device = ids.device
    max_rows = max_padded_rows(num_pairs, n_experts, alignment)
    e_pow2 = triton.next_power_of_2(n_experts)
    # -1 everywhere the place kernel writes no expert (padding rows, blocks past the end): one fill for both
    experts = torch.full((max_rows + max_rows // alignment,), -1, dtype=torch.int32, device=device)
    row_expert, block_expert = experts[:max_rows], experts[max_rows:]
    row_pair = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    row_of_pair = torch.empty(num_pairs, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return ExpertRows(row_expert, row_pair, block_expert, row_of_pair, num_rows.zero_(), 0, alignment)
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    offsets = torch.empty(num_chunks, e_pow2, dtype=torch.int32, device=device)  # counts, then offsets in place
    start = torch.empty(e_pow2, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](ids, offsets, num_pairs, E_POW2=e_pow2, CHUNK=CHUNK, num_warps=4,
                                 **pdl_launch(ids.device))
    _offsets_kernel[(1,)](offsets, offsets, start, num_rows, num_chunks, n_experts, ALIGN=alignment, E_POW2=e_pow2,
                          STEP=OFFSET_ROWS, num_warps=8, **pdl_launch(offsets.device))
    _place_kernel[(num_chunks,)](ids, offsets, start, row_of_pair, row_expert, row_pair, block_expert, num_pairs,
                                 ALIGN=alignment, E_POW2=e_pow2, CHUNK=CHUNK, num_warps=4, **pdl_launch(ids.device))
    return ExpertRows(row_expert, row_pair, block_expert, row_of_pair, num_rows, num_pairs, alignment)


@triton.jit(do_not_specialize=["num_tokens"])
def _quant_scatter_kernel(x_ptr, row_of_pair_ptr, q_ptr, s_ptr, num_tokens, hidden, stride_x, stride_q,
                          stride_s_row, stride_s_group, TOP_K: tl.constexpr, ROWS: tl.constexpr,
                          GROUP: tl.constexpr, EMULATE_CAST: tl.constexpr, PDL: tl.constexpr = False):
    """One [ROWS tokens, GROUP channels] tile quantised once (e4m3 + one scale per token), stored into the row of
    each of the tokens' TOP_K pairs (none for a pair without a row, -1)."""
    wait_for_producers(PDL)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    c = g * GROUP + tl.arange(0, GROUP)
    t_ok = t < num_tokens
    c_ok = c < hidden
    x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + c[None, :], mask=t_ok[:, None] & c_ok[None, :],
                other=0.0).to(tl.float32)
    q, scale = _quant_tile(x, EMULATE_CAST)
    for j in tl.static_range(TOP_K):
        row = tl.load(row_of_pair_ptr + t * TOP_K + j, mask=t_ok, other=-1).to(tl.int64)
        has = row >= 0
        tl.store(q_ptr + row[:, None] * stride_q + c[None, :], q, mask=has[:, None] & c_ok[None, :])
        tl.store(s_ptr + row * stride_s_row + g * stride_s_group, scale, mask=has)


def quant_scatter(x: torch.Tensor, row_of_pair: torch.Tensor, rows: int, mn_major: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (e4m3 [rows, H], fp32 scales [rows, ceil(H/128)]): pair t * k + j's row row_of_pair[t * k + j]
    holds x[t] quantised per 128 channels (`fp8.quant_act_per_token_group`'s values); rows no pair names are left
    unwritten. Scales MN-major (`mn_major_scales`) unless mn_major is False."""
    num_tokens, hidden = x.shape
    top_k = row_of_pair.numel() // max(num_tokens, 1)
    groups = triton.cdiv(hidden, fp8.FP8_BLOCK)
    q = torch.empty(rows, hidden, dtype=fp8.FP8_DTYPE, device=x.device)
    s = mn_major_scales(rows, groups, x.device) if mn_major else torch.empty(rows, groups, dtype=torch.float32,
                                                                              device=x.device)
    if num_tokens and rows:
        x = x if x.stride(-1) == 1 else x.contiguous()
        rows_per_program = 16
        _quant_scatter_kernel[(triton.cdiv(num_tokens, rows_per_program), groups)](
            x, row_of_pair.contiguous(), q, s, num_tokens, hidden, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            TOP_K=top_k, ROWS=rows_per_program, GROUP=fp8.FP8_BLOCK, EMULATE_CAST=EMULATE_CAST, **pdl_launch(x.device))
    return q, s
