"""The rotary embedding inside the kernels that already read the rows: the queries' (`mla_absorb.absorb_q`,
`indexer.quant_index_q`, through `load_rope_leading`) and the keys' (the cache stores, `rope_sources` and
`rotate_pairs` after their norm). At decode the rotation as a kernel of its own costs a launch per layer for a
few KB.

`load_rope_leading` computes what `reference.rope_leading` does (fp32 products, one rounding per product and one
per sum, in the reference's order), so a caller that rounds its result to the query dtype matches the torch code
bit for bit. Kernels calling it launch with `enable_fp_fusion=False` for that: contracted into an fma,
a * cos - b * sin rounds twice where torch rounds three times. The flag stops LLVM / ptxas fusing separate
multiplies and adds; tl.dot emits MMA (bf16) or explicit fused multiply-adds (fp32), which it leaves alone.
"""

from __future__ import annotations

from minidsa.kernels.triton_compat import tl, triton


@triton.jit
def rope_sources(cols, ROPE, INTERLEAVE: tl.constexpr):
    """Where each output column of a leading rope over ROPE columns reads from: (src_a, src_b, first, pair). Output
    column c is a * cos[pair] - b * sin[pair] (first: c in the first half of the rope) or a * cos + b * sin, with
    a = x[src_a] (the column's own element) and b = x[src_b] (its partner); past the rope, a = x[c]. Interleaved
    pairs come out as [evens | odds], half-split ones in place (`reference.rope_interleaved` / `rope_half`)."""
    half = ROPE // 2
    in_rope = cols < ROPE
    first = cols < half
    pair = tl.where(first, cols, cols - half)  # the pair's frequency
    if INTERLEAVE:
        src_a = tl.where(in_rope, tl.where(first, 2 * pair, 2 * pair + 1), cols)
        src_b = tl.where(first, 2 * pair + 1, 2 * pair)
    else:
        src_a = cols
        src_b = tl.where(first, cols + half, pair)
    return src_a, src_b, first, pair


@triton.jit
def rotate_pairs(a, b, first, cos, sin):
    """The rotated values, in fp32 and the references' op order: a cos - b sin where `first`, else a cos + b sin
    (a, b as `rope_sources` picks them). Unrounded: callers round to their dtype."""
    ac = a * cos
    bs = b * sin
    return tl.where(first, ac - bs, ac + bs)


@triton.jit
def load_rope_leading(row_ptrs, cos_ptrs, sin_ptrs, row_ok, cols, NUM_COLS, ROPE, INTERLEAVE: tl.constexpr):
    """fp32 [rows, cols] of rows whose columns are contiguous from `row_ptrs` [rows], columns `cols` < NUM_COLS,
    the first ROPE of them rotated by cos / sin [rows, ROPE / 2] (from `cos_ptrs` / `sin_ptrs` [rows]), pairs
    interleaved (output [evens | odds]) or half-split; masked rows and columns read 0."""
    in_rope = cols < ROPE
    src_a, src_b, first, j = rope_sources(cols, ROPE, INTERLEAVE)
    ok = row_ok[:, None] & (cols < NUM_COLS)[None, :]
    rot_ok = row_ok[:, None] & in_rope[None, :]
    a = tl.load(row_ptrs[:, None] + src_a[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(row_ptrs[:, None] + src_b[None, :], mask=rot_ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptrs[:, None] + j[None, :], mask=rot_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptrs[:, None] + j[None, :], mask=rot_ok, other=0.0).to(tl.float32)
    return tl.where(in_rope[None, :], rotate_pairs(a, b, first[None, :], c, s), a)
