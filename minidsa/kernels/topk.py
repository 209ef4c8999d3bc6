"""Top-k selection over indexer logits, returning physical slots through req_to_token.

Two implementations of `reference.topk_slots`' contract (slots and positions
[T, topk] int32, -1 padded, only visible (> -inf) positions):
- `topk_slots`: Triton radix select, one program per row. Histogram passes
  over the row's orderable 32-bit keys (4 x 8 bits, or 11 + 11 + 10) find the
  exact k-th largest value; a last pass writes every position above it and
  the first positions equal to it (ties go to lower positions). Output is in
  position order, not score order.
- `torch_topk_slots`: `torch.topk` (unsorted) plus a gather of only the k
  chosen slots (the reference gathers the whole req_to_token row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _orderable(x):
    """fp32 -> uint32 whose unsigned order is the float order (-inf lowest among non-NaN)."""
    i = x.to(tl.int32, bitcast=True)
    i = tl.where(i >= 0, i, i ^ 0x7FFFFFFF)  # signed-int order == float order
    return i.to(tl.uint32, bitcast=True) ^ 0x80000000  # flip the sign bit: unsigned order


@triton.jit
def _radix_pass(row_ptr, width, k_rem, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr,
                FIRST: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr):
    """Refine (prefix, k_rem) by the next BITS bits below SHIFT + BITS."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, NBINS)
    hist = tl.zeros((NBINS,), tl.int32)
    for start in range(0, width, BLOCK):
        pos = start + offs
        inb = pos < width
        key = _orderable(tl.load(row_ptr + pos, mask=inb, other=float("-inf")))
        match = inb
        if not FIRST:
            match = match & ((key >> (SHIFT + BITS)) == prefix)
        digit = ((key >> SHIFT) & (NBINS - 1)).to(tl.int32)
        # Non-matching elements land in bin 0 and are taken back out (portable to histogram without mask=).
        digit = tl.where(match, digit, 0)
        hist += tl.histogram(digit, NBINS)
        hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32), axis=0), 0)
    cum = tl.cumsum(hist, axis=0)
    total = tl.sum(hist, axis=0)
    at_or_above = total - cum + hist  # elements in bins >= b
    b = tl.max(tl.where(at_or_above >= k_rem, bins, 0), axis=0)
    above = tl.sum(tl.where(bins > b, hist, 0), axis=0)
    return k_rem - above, (prefix << BITS) | b.to(tl.uint32)


@triton.jit
def _topk_kernel(
    logits_ptr, r2t_ptr, rows_ptr, slots_ptr, pos_ptr,
    width, k, stride_l, stride_r2t, stride_o,
    BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    t = tl.program_id(0)
    row_ptr = logits_ptr + t.to(tl.int64) * stride_l
    offs = tl.arange(0, BLOCK)
    n_valid = tl.zeros((), tl.int32)
    for start in range(0, width, BLOCK):
        pos = start + offs
        x = tl.load(row_ptr + pos, mask=pos < width, other=float("-inf"))
        n_valid += tl.sum((x > float("-inf")).to(tl.int32), axis=0)
    # Threshold key and how many keys equal to it to take; with <= k visible, every visible one.
    thr = _orderable(tl.full((), float("-inf"), tl.float32))
    need_eq = tl.zeros((), tl.int32)
    if n_valid > k:
        k_rem = tl.zeros((), tl.int32) + k
        prefix = tl.zeros((), tl.uint32)
        if RADIX_BITS == 8:
            k_rem, prefix = _radix_pass(row_ptr, width, k_rem, prefix, 24, 8, True, BLOCK, 256)
            k_rem, prefix = _radix_pass(row_ptr, width, k_rem, prefix, 16, 8, False, BLOCK, 256)
            k_rem, prefix = _radix_pass(row_ptr, width, k_rem, prefix, 8, 8, False, BLOCK, 256)
            k_rem, prefix = _radix_pass(row_ptr, width, k_rem, prefix, 0, 8, False, BLOCK, 256)
        else:
            k_rem, prefix = _radix_pass(row_ptr, width, k_rem, prefix, 21, 11, True, BLOCK, 2048)
            k_rem, prefix = _radix_pass(row_ptr, width, k_rem, prefix, 10, 11, False, BLOCK, 2048)
            k_rem, prefix = _radix_pass(row_ptr, width, k_rem, prefix, 0, 10, False, BLOCK, 1024)
        thr = prefix
        need_eq = k_rem
    r2t_row = r2t_ptr + tl.load(rows_ptr + t).to(tl.int64) * stride_r2t
    out_slots = slots_ptr + t.to(tl.int64) * stride_o
    out_pos = pos_ptr + t.to(tl.int64) * stride_o
    n_out = tl.zeros((), tl.int32)
    n_eq = tl.zeros((), tl.int32)
    for start in range(0, width, BLOCK):
        pos = start + offs
        inb = pos < width
        key = _orderable(tl.load(row_ptr + pos, mask=inb, other=float("-inf")))
        eq = inb & (key == thr)
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        take = (inb & (key > thr)) | (eq & (eq_rank < need_eq))
        dst = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
        slot = tl.load(r2t_row + pos, mask=take, other=0)
        tl.store(out_slots + dst, slot, mask=take)
        tl.store(out_pos + dst, pos, mask=take)
        n_out += tl.sum(take.to(tl.int32), axis=0)
        n_eq += tl.sum(eq.to(tl.int32), axis=0)
    for start in range(0, k, BLOCK):
        idx = start + offs
        pad = (idx >= n_out) & (idx < k)
        tl.store(out_slots + idx, tl.full((BLOCK,), -1, tl.int32), mask=pad)
        tl.store(out_pos + idx, tl.full((BLOCK,), -1, tl.int32), mask=pad)


# (BLOCK, RADIX_BITS, num_warps) of the radix select, set from measurements (benchmarks/KERNELS.md).
TOPK_CONFIG = (8192, 8, 16)


def _check(logits: torch.Tensor, topk: int, token_rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"topk: want fp32 logits [T, W], got {logits.dtype} {tuple(logits.shape)}")
    if token_rows.shape != (logits.shape[0],):
        raise ValueError(f"topk: token_rows {tuple(token_rows.shape)} != [T] = {(logits.shape[0],)}")
    if topk < 1:
        raise ValueError(f"topk: k must be >= 1, got {topk}")


def topk_slots(
    logits: torch.Tensor, topk: int, req_to_token: torch.Tensor, token_rows: torch.Tensor,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton radix select: (slots [T, topk] int32, positions [T, topk] int32), -1 padded, position order."""
    _check(logits, topk, token_rows)
    num_tokens, width = logits.shape
    slots = torch.empty(num_tokens, topk, dtype=torch.int32, device=logits.device)
    positions = torch.empty_like(slots)
    if num_tokens == 0:
        return slots, positions
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block, radix_bits, num_warps = config or TOPK_CONFIG
    block = min(block, max(256, triton.next_power_of_2(max(width, topk))))
    _topk_kernel[(num_tokens,)](
        logits, req_to_token, token_rows, slots, positions,
        width, topk, logits.stride(0), req_to_token.stride(0), slots.stride(0),
        BLOCK=block, RADIX_BITS=radix_bits, num_warps=num_warps,
    )
    return slots, positions


def torch_topk_slots(
    logits: torch.Tensor, topk: int, req_to_token: torch.Tensor, token_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk (unsorted) then req_to_token at only the chosen positions; -1 padded."""
    _check(logits, topk, token_rows)
    num_tokens, width = logits.shape
    k = min(topk, width)
    vals, pos = torch.topk(logits, k, dim=-1, sorted=False)
    valid = vals > float("-inf")
    slots = req_to_token[token_rows.unsqueeze(1), pos]
    pos = torch.where(valid, pos, -1).to(torch.int32)
    slots = torch.where(valid, slots, -1).to(torch.int32)
    if k < topk:
        pad = torch.full((num_tokens, topk - k), -1, dtype=torch.int32, device=logits.device)
        pos, slots = torch.cat([pos, pad], 1), torch.cat([slots, pad], 1)
    return slots, pos
