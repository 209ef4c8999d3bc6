"""The MoE router's selection in one Triton launch: sigmoid, correction bias, group scores, group top-k, expert
top-k, the chosen experts' weights, their normalisation and scaling (`reference.route` is the contract).

Why: on an H100 at decode batch 1 (bench-dsv32, benchmarks/decode/tail_profile_h100_d4ff887.json) the torch form costs
~30 us per MoE layer in six torch.topk / sort kernels plus the fills, scatters and gathers around them, for 256 scores
per token. Here one program holds one token's scores in registers: the group scores are the sum of each group's two
largest (the largest taken out once, so a tie counts twice, as torch.topk(2) does), the groups and then the experts are
taken by repeated argmax. Ties go to the lower index; the experts come out in descending order of their choice score, as
`torch.topk(sorted=True)` gives them.

The gate's fp32 GEMM (logits = x @ W^T) stays outside, in cuBLAS.
"""

from __future__ import annotations

import torch

from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton


def supported(n_experts: int, n_group: int) -> str | None:
    """Why this kernel cannot route a model's experts, or None when it can."""
    if n_experts & (n_experts - 1) or n_group & (n_group - 1):
        return f"the Triton router needs power-of-two n_routed_experts and n_group, got {n_experts}, {n_group}"
    if n_group > 1 and n_experts // n_group < 2:
        return f"group scores sum each group's two best experts: {n_experts // n_group} expert(s) per group"
    return None


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, stride_l, scaling,
                  E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E)
    scores = tl.sigmoid(tl.load(logits_ptr + t * stride_l + offs))
    choice = scores + tl.load(bias_ptr + offs)
    if G > 1:
        GS: tl.constexpr = E // G
        grouped = tl.reshape(choice, (G, GS))
        col = tl.arange(0, GS)[None, :]
        best = tl.argmax(grouped, axis=1)
        second = tl.max(tl.where(col == best[:, None], float("-inf"), grouped), axis=1)
        group_score = tl.max(grouped, axis=1) + second
        gid = tl.arange(0, G)
        keep = tl.zeros((G,), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(group_score, axis=0)
            keep = tl.where(gid == g, 1, keep)
            group_score = tl.where(gid == g, float("-inf"), group_score)
        keep_e = tl.reshape(tl.broadcast_to(keep[:, None], (G, GS)), (E,))
        choice = tl.where(keep_e != 0, choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    for i in tl.static_range(TOP_K):
        j = tl.argmax(choice, axis=0)
        ids = tl.where(kk == i, j, ids)
        weights = tl.where(kk == i, tl.sum(tl.where(offs == j, scores, 0.0), axis=0), weights)
        choice = tl.where(offs == j, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    out = t * TOP_K + kk
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=kk < TOP_K)
    tl.store(weights_ptr + out, weights * scaling, mask=kk < TOP_K)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, top_k] int64, weights [T, top_k] fp32) from fp32 gate logits [T, E]: `reference.route`."""
    num_tokens, n_experts = logits.shape
    why_not = supported(n_experts, n_group)
    if why_not is not None:
        raise ValueError(why_not)
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"route: want fp32 logits and bias, got {logits.dtype}, {bias.dtype}")
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    _route_kernel[(num_tokens,)](
        logits, bias.contiguous(), ids, weights, logits.stride(0), float(scaling),
        E=n_experts, G=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
        NORM=norm, num_warps=max(1, min(8, n_experts // 128)), **pdl_launch(logits.device),
    )
    return ids, weights
