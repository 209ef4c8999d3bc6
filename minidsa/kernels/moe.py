"""Routed experts for a few tokens (decode), reading only the experts the tokens chose.

Not used by the model any more: minidsa.kernels.fused_moe serves every token count. Kept only as the
decode baseline of benchmarks/bench_moe.py; delete it (and tests/test_moe_kernel.py) once that GPU
measurement shows the fused MoE at least as fast at decode sizes, or wire it back into the fused op for
the sizes where it wins.

`moe_experts(x, ids, weights, gate_up_proj, down_proj)` computes what
`Experts.forward` computes: for each token t and each of its top-k choices j,
weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = ids[t, j],
summed over j. Shapes: x [T, H], ids / weights [T, k], gate_up_proj [E, 2I, H]
(gate rows first), down_proj [E, H, I]; output [T, H] in x's dtype.

Two launches, each one program per (expert, block of output rows):
- `_gate_up_kernel`: the program of expert e takes the tokens that chose e
  (a mask over a [BLOCK_T] token tile; the others are masked loads that move
  no bytes), multiplies its gate and up row blocks against them over H (fp32
  accumulators, tensor cores), applies silu(gate) * up and stores the result
  at each token's (t, j) pair row of an [T * k, I] intermediate.
- `_down_kernel`: the same over down_proj and the intermediate, times the
  routing weight, stored as fp32 partials [T * k, H]; torch sums the k
  partials of each token.

Programs of experts nobody chose stop after reading `ids`, so only the chosen
experts' weights are read, each once however many tokens share it (no
gathered copy is made). Every pair row is written by exactly one program (the
router's top-k ids of a token are distinct), and the k-sum is a plain torch
reduction: results are the same run to run. Shapes are static and nothing
syncs with the host, so it runs inside CUDA graphs. fp32 inputs go through tl.dot
as TF32 on a GPU (the model calls this for bf16 / fp16 only). Meant for T up to a few
dozen: each program holds a [rows x BLOCK_T] accumulator (BLOCK_T <= 64; more
tokens take more token tiles, each re-reading its experts' rows), and for
large T the dense path's GEMMs do better.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


MAX_BLOCK_T = 64  # tokens per program: accumulators are [rows x BLOCK_T] fp32


@dataclass(frozen=True)
class MoETiles:
    """Tile sizes of one launch pair (rows of the output per program, reduction chunk, pipeline depth)."""

    gate_up_rows: int = 64
    gate_up_k: int = 64
    down_rows: int = 64
    down_k: int = 64
    num_stages: int = 4
    num_warps: int = 4


@triton.jit
def _my_tokens(ids_ptr, w_ptr, e, num_tokens, top_k, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr):
    """For expert e: which tokens of this program's tile chose it, the pair row (t * k + j) and routing weight
    of each."""
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_J)
    ok = (t[:, None] < num_tokens) & (j[None, :] < top_k)
    ids = tl.load(ids_ptr + t[:, None] * top_k + j[None, :], mask=ok, other=-1)
    match = ids == e
    mine = tl.max(match.to(tl.int32), axis=1) > 0
    pair = t * top_k + tl.sum(tl.where(match, j[None, :], 0), axis=1)
    weight = tl.sum(tl.where(match, tl.load(w_ptr + t[:, None] * top_k + j[None, :], mask=ok, other=0.0), 0.0),
                    axis=1)
    return t, mine, pair, weight


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, gu_ptr, mid_ptr,
    num_tokens, top_k, hidden, inter,
    stride_xt, stride_ge, stride_gn, stride_mp,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t, mine, pair, _ = _my_tokens(ids_ptr, w_ptr, e, num_tokens, top_k, BLOCK_T, BLOCK_J)
    # No token chose e: an empty loop, nothing read, nothing stored.
    k_end = tl.where(tl.max(mine.to(tl.int32), axis=0) > 0, hidden, 0)
    n_ok = n < inter
    n_row = tl.where(n_ok, n, 0)  # rows past the end read row 0 (discarded): unmasked weight loads
    kk = tl.arange(0, BLOCK_K)
    gate_rows = gu_ptr + e.to(tl.int64) * stride_ge + n_row[:, None] * stride_gn
    up_rows = gate_rows + inter * stride_gn
    x_rows = x_ptr + t[:, None] * stride_xt
    acc_g = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            wg = tl.load(gate_rows + k[None, :])
            wu = tl.load(up_rows + k[None, :])
            xt = tl.load(x_rows + k[None, :], mask=mine[:, None], other=0.0)
        else:
            k_ok = k[None, :] < hidden
            wg = tl.load(gate_rows + k[None, :], mask=k_ok, other=0.0)
            wu = tl.load(up_rows + k[None, :], mask=k_ok, other=0.0)
            xt = tl.load(x_rows + k[None, :], mask=mine[:, None] & k_ok, other=0.0)
        acc_g = tl.dot(wg, tl.trans(xt), acc_g)  # [BLOCK_N, BLOCK_T]: weight rows x tokens
        acc_u = tl.dot(wu, tl.trans(xt), acc_u)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = mid_ptr + pair[None, :] * stride_mp + n[:, None]
    tl.store(out, h.to(mid_ptr.dtype.element_ty), mask=mine[None, :] & n_ok[:, None])


@triton.jit
def _down_kernel(
    mid_ptr, ids_ptr, w_ptr, down_ptr, part_ptr,
    num_tokens, top_k, hidden, inter,
    stride_mp, stride_de, stride_dh, stride_pp,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _, mine, pair, weight = _my_tokens(ids_ptr, w_ptr, e, num_tokens, top_k, BLOCK_T, BLOCK_J)
    k_end = tl.where(tl.max(mine.to(tl.int32), axis=0) > 0, inter, 0)
    n_ok = n < hidden
    n_row = tl.where(n_ok, n, 0)
    kk = tl.arange(0, BLOCK_K)
    w_rows = down_ptr + e.to(tl.int64) * stride_de + n_row[:, None] * stride_dh
    m_rows = mid_ptr + pair[:, None] * stride_mp
    acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
            m = tl.load(m_rows + k[None, :], mask=mine[:, None], other=0.0)
        else:
            k_ok = k[None, :] < inter
            w = tl.load(w_rows + k[None, :], mask=k_ok, other=0.0)
            m = tl.load(m_rows + k[None, :], mask=mine[:, None] & k_ok, other=0.0)
        acc = tl.dot(w, tl.trans(m), acc)  # [BLOCK_N, BLOCK_T]
    acc = acc * weight[None, :]
    out = part_ptr + pair[None, :] * stride_pp + n[:, None]
    tl.store(out, acc, mask=mine[None, :] & n_ok[:, None])


def _check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
           down_proj: torch.Tensor) -> None:
    if x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: want x [T, H], ids and weights [T, k]; got x {tuple(x.shape)}, "
                         f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    e, two_i, h = gate_up_proj.shape
    if h != x.shape[1] or two_i % 2 or down_proj.shape != (e, h, two_i // 2):
        raise ValueError(f"moe_experts: want gate_up_proj [E, 2I, H] and down_proj [E, H, I] with H = "
                         f"{x.shape[1]}; got {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    if not (x.dtype == gate_up_proj.dtype == down_proj.dtype):
        raise ValueError(f"moe_experts: x, gate_up_proj and down_proj must share a dtype; got {x.dtype}, "
                         f"{gate_up_proj.dtype}, {down_proj.dtype}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_experts: ids must be int32 or int64, got {ids.dtype}")


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, tiles: MoETiles | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H] in x's dtype (see the module docstring)."""
    _check(x, ids, weights, gate_up_proj, down_proj)
    tiles = tiles or MoETiles()
    num_tokens, top_k = ids.shape
    n_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    # The kernels take row strides; only the last dim must be dense (no copy of the weights in the usual case).
    x, gate_up_proj, down_proj = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate_up_proj, down_proj))
    ids = ids.contiguous()
    weights = weights.float().contiguous()
    if num_tokens == 0 or top_k == 0:
        return x.new_zeros(num_tokens, hidden)
    mid = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    part = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    # tl.dot wants every side >= 16; past MAX_BLOCK_T tokens, more tiles (each re-reads its expert's rows).
    block_t = min(MAX_BLOCK_T, max(16, triton.next_power_of_2(num_tokens)))
    token_tiles = triton.cdiv(num_tokens, block_t)
    block_j = triton.next_power_of_2(top_k)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    _gate_up_kernel[(n_experts, triton.cdiv(inter, tiles.gate_up_rows), token_tiles)](
        x, ids, weights, gate_up_proj, mid,
        num_tokens, top_k, hidden, inter,
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), mid.stride(0),
        BLOCK_T=block_t, BLOCK_J=block_j, BLOCK_N=tiles.gate_up_rows, BLOCK_K=tiles.gate_up_k,
        EVEN_K=hidden % tiles.gate_up_k == 0, **launch,
    )
    _down_kernel[(n_experts, triton.cdiv(hidden, tiles.down_rows), token_tiles)](
        mid, ids, weights, down_proj, part,
        num_tokens, top_k, hidden, inter,
        mid.stride(0), down_proj.stride(0), down_proj.stride(1), part.stride(0),
        BLOCK_T=block_t, BLOCK_J=block_j, BLOCK_N=tiles.down_rows, BLOCK_K=tiles.down_k,
        EVEN_K=inter % tiles.down_k == 0, **launch,
    )
    return part.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
