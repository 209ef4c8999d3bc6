"""The FP8 prefill MoE paths as main served them at 4b24a09 (before branch moe-prefill), for the side-by-side in
benchmarks/scripts/bench_moe_prefill.py. Only the host code differs from today's; the Triton GEMM kernel is today's.

- `fused_moe_triton_before`: alignment by torch ops (a stable sort) above 1024 pairs, quant_act before each GEMM,
  the k-sum as torch `.sum(1, dtype=float32).to(dtype)`. FP8 weights, prefill tiles only (no split gate/up, no
  skipped pairs): what the benchmark times.
- `moe_contiguous_before`: torch alignment + a host sync; quant_act over [T, H], then rows and scales gathered into
  expert order; padding rows labelled with their expert in m_indices; row-major activation scales (DeepGEMM
  transposes them per call); silu * up over every row; the combine through a zero row for skipped pairs.
Timing only: nothing here is imported by minidsa.
"""

from __future__ import annotations

import torch
import triton

from minidsa.kernels import fp8
from minidsa.kernels import fused_moe as fm
from minidsa.kernels.fp8_gemm import quant_act


def fused_moe_triton_before(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv, down_scale_inv,
                            max_chunk_tokens: int = fm.MAX_CHUNK_TOKENS):
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    if num_tokens > max_chunk_tokens:
        return torch.cat([
            fused_moe_triton_before(x[s:s + max_chunk_tokens], topk_ids[s:s + max_chunk_tokens],
                                    topk_weights[s:s + max_chunk_tokens], gate_up_proj, down_proj, gate_up_scale_inv,
                                    down_scale_inv, max_chunk_tokens)
            for s in range(0, num_tokens, max_chunk_tokens)])
    n_experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    assert gate_up_proj.dtype == fp8.FP8_DTYPE
    cfg = fm.tile_config(num_tokens, top_k, n_experts, gate_up_proj.dtype, x.dtype)
    align = fm.align_pairs_to_blocks_triton if topk_ids.numel() <= fm.ALIGN_KERNEL_MAX_PAIRS else fm.align_pairs_to_blocks
    blocks = align(topk_ids, n_experts, cfg.block_m)
    num_m_blocks = blocks.block_expert.numel()
    route_w = topk_weights.reshape(-1).float().contiguous()
    mid = torch.empty(blocks.num_pairs, inter, dtype=x.dtype, device=x.device)
    a, a_scale = quant_act(x)
    per_pair = torch.empty(blocks.num_pairs, hidden, dtype=x.dtype, device=x.device)
    launch = dict(GROUP_M=cfg.group_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FP8=True,
                  PRECISION="tf32", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    s = gate_up_scale_inv
    fm._expert_gemm_kernel[(num_m_blocks * triton.cdiv(inter, cfg.block_n),)](
        a, a_scale, gate_up_proj, s, mid, route_w, blocks.sorted_pair_ids, blocks.block_expert, blocks.num_padded,
        inter, hidden, blocks.num_pairs, top_k, num_m_blocks, a.stride(0), a_scale.stride(0), gate_up_proj.stride(0),
        gate_up_proj.stride(1), mid.stride(0), s.stride(0), s.stride(1), s.stride(2),
        GATED=True, APPLY_ROUTE_W=False, EVEN_K=hidden % cfg.block_k == 0, **launch)
    a, a_scale = quant_act(mid)
    s = down_scale_inv
    fm._expert_gemm_kernel[(num_m_blocks * triton.cdiv(hidden, cfg.block_n),)](
        a, a_scale, down_proj, s, per_pair, route_w, blocks.sorted_pair_ids, blocks.block_expert, blocks.num_padded,
        hidden, inter, blocks.num_pairs, 1, num_m_blocks, a.stride(0), a_scale.stride(0), down_proj.stride(0),
        down_proj.stride(1), per_pair.stride(0), s.stride(0), s.stride(1), s.stride(2),
        GATED=False, APPLY_ROUTE_W=True, EVEN_K=inter % cfg.block_k == 0, **launch)
    return per_pair.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def moe_contiguous_before(gemm, alignment: int, x, topk_ids, topk_weights, gate_up_proj, down_proj,
                          gate_up_scale_inv, down_scale_inv, max_chunk_tokens: int = fm.MAX_CHUNK_TOKENS):
    """`gemm`: the build's contiguous grouped FP8 GEMM (deepgemm.grouped_contiguous(module)[0])."""
    num_tokens, top_k = topk_ids.shape
    n_experts, two_i, hidden = gate_up_proj.shape
    if num_tokens > max_chunk_tokens:
        return torch.cat([
            moe_contiguous_before(gemm, alignment, x[s:s + max_chunk_tokens], topk_ids[s:s + max_chunk_tokens],
                                  topk_weights[s:s + max_chunk_tokens], gate_up_proj, down_proj, gate_up_scale_inv,
                                  down_scale_inv, max_chunk_tokens)
            for s in range(0, num_tokens, max_chunk_tokens)])
    blocks = fm.align_pairs_to_blocks(topk_ids, n_experts, alignment)
    rows = int(blocks.num_padded.item())
    num_pairs = blocks.num_pairs
    pair_of_row = blocks.sorted_pair_ids[:rows].long()
    expert_of_row = blocks.block_expert[:rows // alignment].repeat_interleave(alignment)
    xq, xs = quant_act(x.contiguous())
    token_of_row = torch.where(pair_of_row < num_pairs, pair_of_row // top_k, 0)
    a1, s1 = xq[token_of_row], xs[token_of_row]
    gate_up = torch.empty(rows, two_i, dtype=torch.bfloat16, device=x.device)
    down = torch.empty(rows + 1, hidden, dtype=torch.bfloat16, device=x.device)
    down[rows].zero_()
    gemm((a1, s1), (gate_up_proj, gate_up_scale_inv.float()), gate_up, expert_of_row)
    del a1, s1
    a2, s2 = fm.silu_mul(gate_up, quantise=True)
    del gate_up
    gemm((a2, s2), (down_proj, down_scale_inv.float()), down[:rows], expert_of_row)
    row_of_pair = torch.full((num_pairs + 1,), rows, dtype=torch.int32, device=x.device)
    row_of_pair[pair_of_row] = torch.arange(rows, dtype=torch.int32, device=x.device)
    return fm.combine_rows(down, row_of_pair[:num_pairs].view(num_tokens, top_k), topk_weights)
