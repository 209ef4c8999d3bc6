"""Pure-torch reference implementations of every DSA kernel, and of the MoE router's selection.

These are the CPU path and the oracle the Triton / DeepGEMM kernels are
tested against. They favour clarity over speed, but bound their temporary
memory by processing query tokens in blocks.

Shared conventions:
- `index_k` is one layer's indexer key cache: either full precision
  `[num_slots, D]`, or (dtype uint8) DeepGEMM's paged fp8 layout
  `[num_pages, page_size * (D + 4)]` (page's e4m3 bytes, then its fp32 scales).
- Visibility of row positions to query token t: `pos < kv_lens[t]`, or
  `tree_mask[t, pos - kv_lens[t]]` for the positions right after it.
- Top-k results are physical slots (via `req_to_token`), -1 padded.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minidsa.kernels.fp8 import quant_act_per_token_group

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_QUERY_BLOCK = 256


@functools.lru_cache(maxsize=16)
def hadamard_matrix(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix (symmetric, scale d^-0.5): rotating q and k keeps q.k.

    Cached per device, so a CUDA-graph capture (after warm-up) never copies it from the host.
    """
    if d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * d**-0.5).to(device)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3)... rotated; output laid out [evens | odds] (q and k alike, so q.k is unchanged).
    In fp32, rounded back to x's dtype; cos / sin broadcast against x's pairs."""
    dtype = x.dtype
    x = x.float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX half-split rotation: (x[i], x[i + d/2]) pairs; in fp32, rounded back to x's dtype."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def rope_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The indexer's rope: x's first 2 * cos.shape[-1] columns rotated (`rope_interleaved` or `rope_half`), the
    rest as they are."""
    rope_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    rot = (rope_interleaved if interleave else rope_half)(rot, cos, sin)
    return torch.cat([rot, rest], dim=-1)


def hadamard_rotate(x: torch.Tensor, hadamard: torch.Tensor | None = None) -> torch.Tensor:
    """x @ H over the last dim, in fp32. Callers inside torch.compile pass `hadamard` (built once on
    the device): traced, the cached builder would run again and copy it from the host every step."""
    return x.float() @ (hadamard if hadamard is not None else hadamard_matrix(x.shape[-1], str(x.device)))


def quant_fp8_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one power-of-two fp32 scale per row of the last dim: x ~= x8 * scale."""
    x = x.float()
    amax = x.abs().amax(dim=-1).clamp(min=1e-10)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    x8 = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x8, scale


def fp8_views(index_k: torch.Tensor, page_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [P, page_size, D] e4m3, scales [P, page_size] fp32) views of a paged fp8 buffer."""
    num_pages = index_k.shape[0]
    keys = index_k[:, : page_size * head_dim].view(torch.float8_e4m3fn).view(num_pages, page_size, head_dim)
    scales = index_k[:, page_size * head_dim :].view(torch.float32)
    return keys, scales


# --- MLA cache, FP8 layout (FlashMLA's): per token [latent e4m3 | one fp32 scale per 128 latent values |
# rope bf16]; 512 + 16 + 128 = 656 bytes on the real models. Scales are powers of two (ue8m0), so
# dequantising is exact in bf16 and the e4m3 rounding is the only error.
MLA_FP8_GROUP = 128


def mla_fp8_group(latent_dim: int) -> int:
    """Latent values per scale: 128, or the whole latent when it is smaller (tiny test models)."""
    return min(MLA_FP8_GROUP, latent_dim)


def mla_fp8_row_bytes(latent_dim: int, rope_dim: int) -> int:
    return latent_dim + 4 * (latent_dim // mla_fp8_group(latent_dim)) + 2 * rope_dim


def mla_fp8_views(cache: torch.Tensor, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(latent [S, L] e4m3, scales [S, L/group] fp32, rope [S, R] bf16) views of an FP8 MLA cache [S, bytes]."""
    groups = latent_dim // mla_fp8_group(latent_dim)
    scale_end = latent_dim + 4 * groups
    latent = cache[..., :latent_dim].view(torch.float8_e4m3fn)
    scales = cache[..., latent_dim:scale_end].view(torch.float32)
    rope = cache[..., scale_end:].view(torch.bfloat16)
    return latent, scales, rope


def quant_mla_latent(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [T, L] -> (e4m3 [T, L], power-of-two fp32 scales [T, L/group])."""
    num_tokens, dim = latent.shape
    group = mla_fp8_group(dim)
    x8, scales = quant_fp8_ue8m0(latent.reshape(num_tokens, dim // group, group))
    return x8.reshape(num_tokens, dim), scales


def store_mla(cache: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor, latent_dim: int) -> None:
    """Write MLA rows `kv [T, L + R]` at slots `loc`: as is, or quantised into the FP8 layout (uint8 cache)."""
    # index_copy_, not `cache[loc] = ...`: compiled with size-oblivious sizes, index_put_ guards on one row apart.
    if cache.dtype != torch.uint8:
        cache.index_copy_(0, loc, kv.to(cache.dtype))
        return
    # Written as bytes: index_copy_ has no fp8 kernel on CPU, and no view of the cache as fp32 / bf16 is needed.
    x8, s = quant_mla_latent(kv[:, :latent_dim])
    rope = kv[:, latent_dim:].to(torch.bfloat16)
    row = torch.cat([x8.view(torch.uint8), s.view(torch.uint8), rope.view(torch.uint8)], dim=-1)
    cache.index_copy_(0, loc, row)


def norm_rope_store_mla(cache: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The MLA key from its raw projection `kv [T, L + R]` (L = norm_weight's size), stored at slots `loc` as
    `store_mla` stores rows: the latent RMSNorm'd, the rest rotated by `rope_interleaved` (cos / sin [T, R/2])."""
    latent_dim = norm_weight.shape[0]
    latent = rms_norm(kv[:, :latent_dim], norm_weight, eps)
    k_rope = rope_interleaved(kv[:, latent_dim:], cos, sin)
    store_mla(cache, loc, torch.cat([latent, k_rope], dim=-1), latent_dim)


def load_mla(cache: torch.Tensor, slots: torch.Tensor, latent_dim: int) -> torch.Tensor:
    """fp32 MLA rows [..., L + R] at `slots` (any shape); FP8 rows come back dequantised."""
    if cache.dtype != torch.uint8:
        return cache[slots].float()
    latent, scales, rope = mla_fp8_views(cache, latent_dim)
    x = latent[slots].float()
    s = scales[slots]
    groups = s.shape[-1]
    x = (x.unflatten(-1, (groups, latent_dim // groups)) * s.unsqueeze(-1)).flatten(-2)
    return torch.cat([x, rope[slots].float()], dim=-1)


def store_index_k(index_k: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Write indexer keys `k [T, D]` at slots `loc`: as is, or Hadamard + fp8 into the paged layout."""
    if index_k.dtype != torch.uint8:
        index_k.index_copy_(0, loc, k.to(index_k.dtype))  # as store_mla: no guard on one row
        return
    keys, scales = fp8_views(index_k, page_size, k.shape[-1])
    k8, s = quant_fp8_ue8m0(hadamard_rotate(k))
    page, off = loc // page_size, loc % page_size
    keys[page, off] = k8
    scales[page, off] = s


def norm_rope_store_index_k(index_k: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, norm_weight: torch.Tensor,
                            norm_bias: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                            interleaved: bool, page_size: int) -> None:
    """The indexer key from its raw projection `k [T, D]`, stored at slots `loc` as `store_index_k` stores keys:
    LayerNorm'd, then rotated as the queries are (`rope_leading`)."""
    k = F.layer_norm(k, (k.shape[-1],), norm_weight, norm_bias, eps)
    store_index_k(index_k, loc, rope_leading(k, cos, sin, interleaved), page_size)


def load_index_k(index_k: torch.Tensor, slots: torch.Tensor, page_size: int, head_dim: int) -> torch.Tensor:
    """fp32 keys at `slots` (any shape); fp8 keys come back dequantised (still Hadamard-rotated)."""
    if index_k.dtype != torch.uint8:
        return index_k[slots].float()
    keys, scales = fp8_views(index_k, page_size, head_dim)
    page, off = slots // page_size, slots % page_size
    return keys[page, off].float() * scales[page, off].unsqueeze(-1)


def quant_index_q(q: torch.Tensor, weights: torch.Tensor, hadamard: torch.Tensor | None = None,
                  cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                  rope_interleave: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepare indexer queries for the fp8 cache: rope (given cos / sin [T, rope/2]: `rope_leading` on each head),
    Hadamard, e4m3 per (token, head), scale folded into weights.

    Valid because ReLU commutes with positive scales: w * relu(s * a) = (w * s) * relu(a).
    """
    if cos is not None:
        q = rope_leading(q, cos.unsqueeze(1), sin.unsqueeze(1), rope_interleave)
    q8, qs = quant_fp8_ue8m0(hadamard_rotate(q, hadamard))
    return q8, weights * qs


def visible_mask(kv_lens: torch.Tensor, width: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[T, width] bool: which row positions each query token may see."""
    pos = torch.arange(width, device=kv_lens.device)
    vis = pos.unsqueeze(0) < kv_lens.unsqueeze(1)
    if tree_mask is not None:
        rel = pos.unsqueeze(0) - kv_lens.unsqueeze(1)  # [T, width]
        w = tree_mask.shape[1]
        in_tree = (rel >= 0) & (rel < w)
        tree_bits = torch.gather(tree_mask, 1, rel.clamp(0, w - 1))
        vis = vis | (in_tree & tree_bits)
    return vis


def index_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    page_size: int,
    req_to_token: torch.Tensor,
    token_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged indexer scores: logits[t, p] = sum_h weights[t, h] * relu(q[t, h] . k[slot(t, p)]).

    q: [T, H, D] (fp8 or float); weights: [T, H] fp32 with every scale folded
    in. Returns [T, max_kv_len] fp32, -inf where position p is not visible.
    """
    num_tokens, _, head_dim = q.shape
    out = torch.empty(num_tokens, max_kv_len, dtype=torch.float32, device=q.device)
    for s in range(0, num_tokens, _QUERY_BLOCK):
        e = min(s + _QUERY_BLOCK, num_tokens)
        slots = req_to_token[token_rows[s:e], :max_kv_len].long()  # [t, L]
        keys = load_index_k(index_k, slots, page_size, head_dim)  # [t, L, D]
        scores = torch.einsum("thd,tld->thl", q[s:e].float(), keys).relu_()
        logits = torch.einsum("th,thl->tl", weights[s:e].float(), scores)
        vis = visible_mask(kv_lens[s:e], max_kv_len, None if tree_mask is None else tree_mask[s:e])
        out[s:e] = logits.masked_fill(~vis, float("-inf"))
    return out


def topk_slots(
    logits: torch.Tensor, topk: int, req_to_token: torch.Tensor, token_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k visible positions per row -> (slots [T, topk] int32, positions [T, topk] int32), -1 padded."""
    num_tokens, width = logits.shape
    k = min(topk, width)
    vals, pos = logits.topk(k, dim=-1) if k > 0 else (logits[:, :0], logits[:, :0].long())
    valid = vals > float("-inf")
    pos = torch.where(valid, pos, -1)
    slots = torch.gather(req_to_token[token_rows].long(), 1, pos.clamp(min=0))
    slots = torch.where(valid, slots, -1)
    if k < topk:
        pad = torch.full((num_tokens, topk - k), -1, dtype=pos.dtype, device=pos.device)
        pos, slots = torch.cat([pos, pad], 1), torch.cat([slots, pad], 1)
    return slots.to(torch.int32), pos.to(torch.int32)


def ragged_index_logits(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor
) -> torch.Tensor:
    """Prefill (ragged) form: row i scores keys [ks[i], ke[i]) of a contiguous key tensor [S_kv, D].

    Returns [S, S_kv] fp32, -inf outside each row's range (DeepGEMM's fp8_mqa_logits contract).
    """
    scores = torch.einsum("thd,ld->thl", q.float(), keys.float()).relu_()
    logits = torch.einsum("th,thl->tl", weights.float(), scores)
    cols = torch.arange(keys.shape[0], device=q.device)
    inside = (cols.unsqueeze(0) >= ks.unsqueeze(1)) & (cols.unsqueeze(0) < ke.unsqueeze(1))
    return logits.masked_fill(~inside, float("-inf"))


def sparse_mla(
    q: torch.Tensor, kv_cache: torch.Tensor, topk: torch.Tensor, sm_scale: float, v_dim: int
) -> torch.Tensor:
    """MQA over selected latent slots: q [T, H, Dk] x cache [S, Dk] at topk [T, K] (-1 = none) -> [T, H, v_dim].

    `kv_cache` is either in a float dtype or (uint8) the FP8 layout (`mla_fp8_views`, latent = v_dim),
    dequantised here. fp32 softmax; rows with no valid index give zeros.
    """
    num_tokens, heads, _ = q.shape
    out = torch.zeros(num_tokens, heads, v_dim, dtype=q.dtype, device=q.device)
    for s in range(0, num_tokens, _QUERY_BLOCK):
        e = min(s + _QUERY_BLOCK, num_tokens)
        idx = topk[s:e].long()
        valid = idx >= 0
        kv = load_mla(kv_cache, idx.clamp(min=0), v_dim)  # [t, K, Dk] fp32
        scores = torch.einsum("thd,tkd->thk", q[s:e].float(), kv) * sm_scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[s:e] = torch.einsum("thk,tkd->thd", probs, kv[..., :v_dim]).to(q.dtype)
    return out


def kv_move(
    mla_caches: list[torch.Tensor],
    index_caches: list[torch.Tensor | None],
    src: torch.Tensor,
    dst: torch.Tensor,
    page_size: int,
    index_head_dim: int,
) -> None:
    """Copy the rows at slots `src` to slots `dst` in every layer's MLA and indexer cache."""
    src, dst = src.long(), dst.long()
    for cache in mla_caches:
        cache[dst] = cache[src]
    for cache in index_caches:
        if cache is None:
            continue
        if cache.dtype != torch.uint8:
            cache[dst] = cache[src]
            continue
        keys, scales = fp8_views(cache, page_size, index_head_dim)
        sp, so = src // page_size, src % page_size
        dp, do = dst // page_size, dst % page_size
        keys[dp, do] = keys[sp, so]
        scales[dp, do] = scales[sp, so]


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router's selection from fp32 gate logits [T, E] -> (expert ids [T, top_k] int64, weights fp32).

    Sigmoid scores; the correction bias only for choosing; with groups, only the `topk_group` groups whose two best
    biased scores sum highest; the `top_k` best biased scores among them, in descending order; their unbiased
    scores as weights, normalised to sum 1 when `norm`, times `scaling`.
    """
    scores = logits.sigmoid()
    choice = scores + bias
    n_experts = logits.shape[-1]
    if n_group > 1:
        grouped = choice.view(-1, n_group, n_experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(n_experts // n_group, 1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The models' RMSNorm: normalised in fp32, rounded to x's dtype, then times the weight (in their promoted
    dtype)."""
    dtype = x.dtype
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of x (+ residual, the sum in x's dtype) and its FP8 quantisation for a w8a8 GEMM:
    (sum or None, normed [T, K], e4m3 [T, K], fp32 scales [T, ceil(K/128)] as `fp8.quant_act_per_token_group`)."""
    h = x + residual if residual is not None else None
    normed = rms_norm(h if h is not None else x, weight, eps)
    q, scales = quant_act_per_token_group(normed)
    return h, normed, q, scales


# --- Routed experts at prefill sizes: the per-expert row layout of grouped GEMMs and the passes around them
# (kernels/moe_layout.py, kernels/fused_moe.py's silu_mul and combine_rows).


def expert_rows(topk_ids: torch.Tensor, n_experts: int, alignment: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The (token, choice) pairs of topk_ids [T, k] in rows grouped by expert, experts in id order, one expert's pairs
    in pair order, each expert's rows padded to a multiple of `alignment`; a pair with id -1 (SKIP) gets no row.

    Returns (row_expert, row_pair, block_expert, row_of_pair, num_rows): per row of the static bound
    `T*k + min(E, T*k) * (alignment - 1)` (rounded up to the alignment) its expert (-1 on padding) and pair id
    (T*k on padding); per aligned block its expert (-1 past the end); per pair its row (-1: none)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    bound = num_pairs + min(n_experts, num_pairs) * (alignment - 1)
    max_rows = -(-bound // alignment) * alignment
    row_expert = torch.full((max_rows,), -1, dtype=torch.int32)
    row_pair = torch.full((max_rows,), num_pairs, dtype=torch.int32)
    block_expert = torch.full((max_rows // alignment,), -1, dtype=torch.int32)
    row_of_pair = torch.full((num_pairs,), -1, dtype=torch.int32)
    start = 0
    for e in range(n_experts):
        pairs = torch.nonzero(flat.cpu() == e).flatten()
        if pairs.numel() == 0:
            continue
        rows = start + torch.arange(pairs.numel())
        row_expert[rows], row_pair[rows], row_of_pair[pairs] = e, pairs.int(), rows.int()
        padded = -(-pairs.numel() // alignment) * alignment
        block_expert[start // alignment:(start + padded) // alignment] = e
        start += padded
    device = topk_ids.device
    return (row_expert.to(device), row_pair.to(device), block_expert.to(device), row_of_pair.to(device), start)


def quant_scatter(x: torch.Tensor, row_of_pair: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] quantised per token per 128 channels, token t's row copied to the rows of its k pairs (row_of_pair
    [T*k], -1: none) -> (e4m3 [rows, H], fp32 scales [rows, ceil(H/128)]); rows no pair names are zero."""
    from minidsa.kernels import fp8

    num_tokens, hidden = x.shape
    q, s = fp8.quant_act_per_token_group(x)
    top_k = row_of_pair.numel() // max(num_tokens, 1)
    token = torch.arange(row_of_pair.numel(), device=x.device) // max(top_k, 1)
    has = row_of_pair >= 0
    out_q = torch.zeros(rows, hidden, dtype=torch.uint8, device=x.device)  # e4m3 bytes (index_put on fp8: not on CPU)
    out_s = torch.zeros(rows, s.shape[1], dtype=torch.float32, device=x.device)
    out_q[row_of_pair[has].long()] = q.view(torch.uint8)[token[has]]
    out_s[row_of_pair[has].long()] = s[token[has]]
    return out_q.view(fp8.FP8_DTYPE), out_s


def silu_mul(gate_up: torch.Tensor, quantise: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[R, 2I] (gate columns, then up) -> silu(gate) * up rounded to gate_up's dtype (as a GEMM epilogue stores it),
    then with `quantise` e4m3 per row per 128 channels: (e4m3 [R, I], fp32 scales [R, ceil(I/128)])."""
    from minidsa.kernels import fp8

    inter = gate_up.shape[1] // 2
    g = gate_up.float()
    mid = (g[:, :inter] * torch.sigmoid(g[:, :inter]) * g[:, inter:]).to(gate_up.dtype)
    return fp8.quant_act_per_token_group(mid) if quantise else (mid, None)


def combine_rows(rows: torch.Tensor, row_of_pair: torch.Tensor | None, weights: torch.Tensor | None,
                 top_k: int | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * rows[row_of_pair[t, j]] (+ addend[t]) in fp32, in rows' dtype; a row of -1
    adds nothing; row_of_pair None: pair (t, j) is row t * top_k + j; weights None: 1. The addend [T, H] is added
    after the k rows' sum, before the one rounding."""
    if row_of_pair is None:
        row_of_pair = torch.arange(rows.shape[0], device=rows.device).view(-1, top_k)
    idx = row_of_pair.long()
    picked = rows[idx.clamp(min=0).reshape(-1)].view(*idx.shape, rows.shape[1]).float()
    picked = torch.where((idx >= 0).unsqueeze(-1), picked, 0.0)  # not a multiply: padding rows may be NaN
    if weights is not None:
        picked = picked * weights.float().unsqueeze(-1)
    out = picked.sum(1)
    if addend is not None:
        out = out + addend.float()
    return out.to(rows.dtype)
