"""Top-k selection over indexer logits, returning physical slots through req_to_token.

Two implementations of `reference.topk_slots`' contract (slots and positions
[T, topk] int32, -1 padded, only visible (> -inf) positions):
- `topk_slots`: Triton radix select. Histogram passes over the row's
  orderable 32-bit keys (4 x 8 bits, or 11 + 11 + 10) find the exact k-th
  largest value; a last pass writes every position above it and the first
  positions equal to it (ties go to lower positions). Output is in position
  order, not score order. Three kernels, by shape (`method=` forces one):
  - many rows ("rows"): one program per row, all passes in one launch;
  - few rows ("split", decode at small batch): each row is split over several
    programs, one launch per pass, histograms summed with atomics, so a
    single long row does not leave the rest of the GPU idle;
  - rows no wider than `REGISTER_MAX_WIDTH` (few rows: `REGISTER_FEW_ROWS_MAX_WIDTH`; "register",
    `register_select_wins`): one launch, one program per row holding the whole
    row in registers (read from memory once; one power-of-two tile, or two where
    that holds the row in fewer lanes: `register_tiles_for`); the k-th largest key comes from
    up to 16 two-bit search steps over those registers (each one `tl.sum` of three
    packed counts over both tiles; it stops once exactly k keys are at or above the
    bits fixed so far, after ~10 steps on distinct logits; or 4 `tl.histogram`
    byte passes), then one `tl.cumsum` places the taken positions.
- `torch_topk_slots`: `torch.topk` (unsorted) plus a gather of only the k
  chosen slots (the reference gathers the whole req_to_token row).
"""

from __future__ import annotations

import torch

from minidsa.kernels import few_rows, num_sms
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton


@triton.jit
def _orderable(x):
    """fp32 -> uint32 whose unsigned order is the float order (-inf lowest among non-NaN)."""
    i = x.to(tl.int32, bitcast=True)
    i = tl.where(i >= 0, i, i ^ 0x7FFFFFFF)  # signed-int order == float order
    return i.to(tl.uint32, bitcast=True) ^ 0x80000000  # flip the sign bit: unsigned order


@triton.jit
def _histogram(row_ptr, lo, hi, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
               BLOCK: tl.constexpr, NBINS: tl.constexpr):
    """Histogram of the BITS bits below SHIFT + BITS of the keys in [lo, hi) whose higher bits equal `prefix`."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, NBINS)
    hist = tl.zeros((NBINS,), tl.int32)
    for start in range(lo, hi, BLOCK):
        pos = start + offs
        inb = pos < hi
        key = _orderable(tl.load(row_ptr + pos, mask=inb, other=float("-inf")))
        match = inb
        if not FIRST:
            match = match & ((key >> (SHIFT + BITS)) == prefix)
        digit = ((key >> SHIFT) & (NBINS - 1)).to(tl.int32)
        # Non-matching elements land in bin 0 and are taken back out (portable to histogram without mask=).
        digit = tl.where(match, digit, 0)
        hist += tl.histogram(digit, NBINS)
        hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32), axis=0), 0)
    return hist


@triton.jit
def _pick_bin(hist, k_rem, NBINS: tl.constexpr):
    """The bin holding the k_rem-th largest key, and k_rem less the keys in the bins above it."""
    bins = tl.arange(0, NBINS)
    cum = tl.cumsum(hist, axis=0)
    at_or_above = tl.sum(hist, axis=0) - cum + hist  # elements in bins >= b
    b = tl.max(tl.where(at_or_above >= k_rem, bins, 0), axis=0)
    return k_rem - tl.sum(tl.where(bins > b, hist, 0), axis=0), b


@triton.jit
def _radix_pass(row_ptr, width, k_rem, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr,
                FIRST: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr):
    """Refine (prefix, k_rem) by the next BITS bits below SHIFT + BITS."""
    hist = _histogram(row_ptr, 0, width, prefix, SHIFT, BITS, FIRST, BLOCK, NBINS)
    k_rem, b = _pick_bin(hist, k_rem, NBINS)
    return k_rem, (prefix << BITS) | b.to(tl.uint32)


@triton.jit
def _write_taken(row_ptr, r2t_row, out_slots, out_pos, lo, hi, thr, need_eq, n_out, n_eq, BLOCK: tl.constexpr):
    """Write, in position order from output index n_out, the positions in [lo, hi) the threshold takes
    (and their slots): every visible key above `thr`, and keys equal to it while fewer than `need_eq`
    were taken before (n_eq equal keys precede lo). Returns the output count after them."""
    neg_inf = _orderable(tl.full((), float("-inf"), tl.float32))
    offs = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        pos = start + offs
        key = _orderable(tl.load(row_ptr + pos, mask=pos < hi, other=float("-inf")))
        visible = key != neg_inf
        eq = visible & (key == thr)
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        take = (visible & (key > thr)) | (eq & (eq_rank < need_eq))
        dst = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
        slot = tl.load(r2t_row + pos, mask=take, other=0)
        tl.store(out_slots + dst, slot, mask=take)
        tl.store(out_pos + dst, pos, mask=take)
        n_out += tl.sum(take.to(tl.int32), axis=0)
        n_eq += tl.sum(eq.to(tl.int32), axis=0)
    return n_out


@triton.jit
def _pad_tail(out_slots, out_pos, first, step, total, k, BLOCK: tl.constexpr):
    """-1 at output indices [total, k), over the blocks starting at first, first + step, ..."""
    offs = tl.arange(0, BLOCK)
    for start in range(first, k, step):
        idx = start + offs
        pad = (idx >= total) & (idx < k)
        tl.store(out_slots + idx, tl.full((BLOCK,), -1, tl.int32), mask=pad)
        tl.store(out_pos + idx, tl.full((BLOCK,), -1, tl.int32), mask=pad)


@triton.jit
def _topk_kernel(
    logits_ptr, r2t_ptr, rows_ptr, slots_ptr, pos_ptr,
    width, k, stride_l, stride_r2t, stride_o,
    BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
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
    zero = tl.zeros((), tl.int32)
    n_out = _write_taken(row_ptr, r2t_row, out_slots, out_pos, 0, width, thr, need_eq, zero, zero, BLOCK)
    _pad_tail(out_slots, out_pos, 0, BLOCK, n_out, k, BLOCK)


@triton.jit
def _tile_keys(row_ptr, first, width, SIZE: tl.constexpr):
    """Positions [first, first + SIZE) of a row and their orderable keys (-inf past the row: never visible)."""
    pos = first + tl.arange(0, SIZE)
    return pos, _orderable(tl.load(row_ptr + pos, mask=pos < width, other=float("-inf")))


@triton.jit
def _packed_at_or_above(key, thr, bit):
    """Per key, three counts packed in 21-bit fields of an int64: key >= thr | (1, 2, 3) * bit (bit = 1 << b, thr's
    bits below b zero). Summed over a tile (at most 16384 keys) no field carries into the next."""
    one = tl.full((), 1, tl.int64)
    f2 = one + (one << 21)
    f3 = f2 + (one << 42)
    return tl.where(key >= (thr | (3 * bit)), f3,
                    tl.where(key >= (thr | (2 * bit)), f2, tl.where(key >= (thr | bit), one, 0)))


@triton.jit
def _search_step(key_h, key_t, k, thr, bit, n_at, n_above, HEAD: tl.constexpr, TAIL: tl.constexpr):
    """One two-bit step of the threshold search at bit = 1 << b (uint32): thr holds T's bits above b + 1, this step
    fixes bits b + 1 and b. In and out: n_at = count(key >= thr) >= k, n_above = count(key >= thr + 4 * bit) < k.
    One tl.sum per tile counts the keys at or above the three candidates thr + (1, 2, 3) * bit."""
    packed = _packed_at_or_above(key_h, thr, bit)
    if TAIL > 0:
        packed_t = _packed_at_or_above(key_t, thr, bit)
        if HEAD >= TAIL:
            packed = tl.sum(tl.reshape(packed, (HEAD // TAIL, TAIL)), axis=0) + packed_t
        else:
            packed = packed + tl.sum(tl.reshape(packed_t, (TAIL // HEAD, HEAD)), axis=0)
    counts = tl.sum(packed, axis=0)
    n1 = (counts & 0x1FFFFF).to(tl.int32)
    n2 = ((counts >> 21) & 0x1FFFFF).to(tl.int32)
    n3 = (counts >> 42).to(tl.int32)
    d = (n1 >= k).to(tl.int32) + (n2 >= k).to(tl.int32) + (n3 >= k).to(tl.int32)
    n_above = tl.where(d == 0, n1, tl.where(d == 1, n2, tl.where(d == 2, n3, n_above)))
    n_at = tl.where(d == 0, n_at, tl.where(d == 1, n1, tl.where(d == 2, n2, n3)))
    return thr | (d.to(tl.uint32) * bit), n_at, n_above


@triton.jit
def _byte_histogram(key, prefix, P: tl.constexpr):
    """Histogram of the byte at 24 - 8 * P of the keys whose higher bytes equal `prefix` (others in bin 0:
    `_pick_bin` never counts bin 0 into k_rem, and bin 0's keys-at-or-above (all keys) passes the k_rem test)."""
    digit = ((key >> (24 - 8 * P)) & 255).to(tl.int32)
    if P > 0:
        digit = tl.where((key >> (32 - 8 * P)) == prefix, digit, 0)
    return tl.histogram(digit, 256)


@triton.jit
def _store_taken(key, pos, visible, thr, need_eq, base, r2t_row, out_slots, out_pos):
    """Write this tile's taken positions (keys above thr, and keys equal to it while fewer than need_eq were taken
    before) after the `base` ones of the tiles before it. `base` packs their counts of keys above thr (low 16 bits)
    and equal to it (high bits); returns it with this tile's added."""
    gt = visible & (key > thr)
    eq = visible & (key == thr)
    # One scan for both running counts, inclusive.
    cum = base + tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
    n_eq = cum >> 16
    take = gt | (eq & (n_eq <= need_eq))  # ties: the lowest positions
    dst = (cum & 0xFFFF) + tl.minimum(n_eq, need_eq) - 1
    tl.store(out_slots + dst, tl.load(r2t_row + pos, mask=take, other=0), mask=take)
    tl.store(out_pos + dst, pos, mask=take)
    return base + tl.sum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)


@triton.jit
def _register_topk_kernel(
    logits_ptr, r2t_ptr, rows_ptr, slots_ptr, pos_ptr,
    width, k, stride_l, stride_r2t, stride_o,
    HEAD: tl.constexpr, TAIL: tl.constexpr, RADIX_BITS: tl.constexpr, EARLY_EXIT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row t (width <= HEAD + TAIL) loaded once into registers, as a HEAD tile and (TAIL > 0) a TAIL tile after it:
    two powers of two cover a width like 4096 + a few decode tokens with 5120 lanes, not the 8192 of one block.
    Every radix step and the write work on those registers; each count sums over both tiles.

    RADIX_BITS 2: a search for the largest key T with count(key >= T) >= k, two bits per step from the top:
    one tl.sum per tile counts, packed into 21-bit fields of an int64, the keys at or above T + 1, 2 and 3 << b.
    EARLY_EXIT (RADIX_BITS 2): a runtime loop that stops once exactly k keys are >= the bits fixed so far (each step
    costs a cross-warp reduction; distinct logits stop after ~10); off, the 16 steps unrolled, as before.
    RADIX_BITS 8: four tl.histogram passes of the next byte of the keys matching the prefix so far."""
    wait_for_producers(PDL)
    t = tl.program_id(0)
    tl.static_assert(HEAD + TAIL <= 16384)  # counts fit the 16-bit fields of the packed cumsum
    row_ptr = logits_ptr + t.to(tl.int64) * stride_l
    neg_inf = _orderable(tl.full((), float("-inf"), tl.float32))
    pos_h, key_h = _tile_keys(row_ptr, 0, width, HEAD)
    vis_h = key_h > neg_inf
    n_valid = tl.sum(vis_h.to(tl.int32), axis=0)
    if TAIL > 0:
        pos_t, key_t = _tile_keys(row_ptr, HEAD, width, TAIL)
        vis_t = key_t > neg_inf
        n_valid += tl.sum(vis_t.to(tl.int32), axis=0)
    else:
        key_t = key_h  # not read: without a tail the search counts the head only
    # Threshold key and how many keys equal to it to take; with <= k visible, every visible one.
    thr = neg_inf
    need_eq = tl.zeros((), tl.int32)
    if n_valid > k:
        if RADIX_BITS == 2:
            # The largest T with count(key >= T) >= k, two bits a step from the top; n_at keys are >= thr (all lanes
            # at first: -inf and padding keys are >= 0), n_above >= thr + 4 * bit (taken, fewer than k).
            thr = tl.zeros((), tl.uint32)
            n_at = tl.zeros((), tl.int32) + (HEAD + TAIL)
            n_above = tl.zeros((), tl.int32)
            if EARLY_EXIT:
                # Once count(key >= thr) is k exactly, the keys >= thr are the ones taken whatever the bits still
                # open: stop. Distinct fp32 logits get there after ~10 of the 16 steps; ties at T run all 16.
                bit = tl.full((), 1 << 30, tl.uint32)
                while (bit != 0) & (n_at != k):
                    thr, n_at, n_above = _search_step(key_h, key_t, k, thr, bit, n_at, n_above, HEAD, TAIL)
                    bit = bit >> 2
            else:  # all 16 steps, unrolled (b a constant each)
                for i in tl.static_range(16):
                    thr, n_at, n_above = _search_step(key_h, key_t, k, thr, tl.full((), 1 << (30 - 2 * i), tl.uint32),
                                                      n_at, n_above, HEAD, TAIL)
            # Exactly k keys >= thr: take every key > thr - 1 (thr > 0: at 0 all HEAD + TAIL lanes count, more than
            # k), no ties to break. Otherwise the search ran to the last bit: thr = T, k - n_above of its equal keys.
            exact = n_at == k
            need_eq = tl.where(exact, 0, k - n_above)
            thr = tl.where(exact, thr - 1, thr)
        else:
            tl.static_assert(RADIX_BITS == 8)
            k_rem = tl.zeros((), tl.int32) + k
            prefix = tl.zeros((), tl.uint32)
            for p in tl.static_range(4):
                hist = _byte_histogram(key_h, prefix, p)
                if TAIL > 0:
                    hist += _byte_histogram(key_t, prefix, p)
                k_rem, b = _pick_bin(hist, k_rem, 256)
                prefix = (prefix << 8) | b.to(tl.uint32)
            thr = prefix
            need_eq = k_rem
    r2t_row = r2t_ptr + tl.load(rows_ptr + t).to(tl.int64) * stride_r2t
    out_slots = slots_ptr + t.to(tl.int64) * stride_o
    out_pos = pos_ptr + t.to(tl.int64) * stride_o
    base = _store_taken(key_h, pos_h, vis_h, thr, need_eq, tl.zeros((), tl.int32), r2t_row, out_slots, out_pos)
    if TAIL > 0:
        _store_taken(key_t, pos_t, vis_t, thr, need_eq, base, r2t_row, out_slots, out_pos)
    # Above k visible: the keys above thr and need_eq equal ones, exactly k.
    _pad_tail(out_slots, out_pos, 0, HEAD, tl.minimum(n_valid, k), k, HEAD)


@triton.jit
def _resolve(hist_ptr, k, NPASS: tl.constexpr):
    """(k_rem, prefix) after NPASS 8-bit passes, from the summed histograms hist[p, 256] of one row."""
    bins = tl.arange(0, 256)
    k_rem = tl.zeros((), tl.int32) + k
    prefix = tl.zeros((), tl.uint32)
    for p in tl.static_range(NPASS):
        k_rem, b = _pick_bin(tl.load(hist_ptr + p * 256 + bins), k_rem, 256)
        prefix = (prefix << 8) | b.to(tl.uint32)
    return k_rem, prefix


@triton.jit
def _split_hist_kernel(logits_ptr, hist_ptr, width, k, chunk, stride_l, PASS: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Pass PASS over chunk c of row t: histogram of the next 8 bits of the keys matching the prefix so far."""
    wait_for_producers(PDL)
    t, c = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + t.to(tl.int64) * stride_l
    hist_row = hist_ptr + t.to(tl.int64) * 1024
    _, prefix = _resolve(hist_row, k, PASS)
    lo = c * chunk
    hist = _histogram(row_ptr, lo, tl.minimum(lo + chunk, width), prefix, 24 - 8 * PASS, 8, PASS == 0, BLOCK, 256)
    tl.atomic_add(hist_row + PASS * 256 + tl.arange(0, 256), hist)


@triton.jit
def _split_count_kernel(logits_ptr, hist_ptr, counts_ptr, width, k, chunk, num_chunks, stride_l,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Per chunk: how many visible keys lie above the k-th largest, and how many equal it."""
    wait_for_producers(PDL)
    t, c = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + t.to(tl.int64) * stride_l
    _, thr = _resolve(hist_ptr + t.to(tl.int64) * 1024, k, 4)
    neg_inf = _orderable(tl.full((), float("-inf"), tl.float32))
    offs = tl.arange(0, BLOCK)
    n_gt = tl.zeros((), tl.int32)
    n_eq = tl.zeros((), tl.int32)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, width)
    for start in range(lo, hi, BLOCK):
        pos = start + offs
        key = _orderable(tl.load(row_ptr + pos, mask=pos < hi, other=float("-inf")))
        visible = key != neg_inf
        n_gt += tl.sum((visible & (key > thr)).to(tl.int32), axis=0)
        n_eq += tl.sum((visible & (key == thr)).to(tl.int32), axis=0)
    out = counts_ptr + (t.to(tl.int64) * num_chunks + c) * 2
    tl.store(out, n_gt)
    tl.store(out + 1, n_eq)


@triton.jit
def _split_write_kernel(logits_ptr, hist_ptr, counts_ptr, r2t_ptr, rows_ptr, slots_ptr, pos_ptr,
                        width, k, chunk, num_chunks, stride_l, stride_r2t, stride_o,
                        BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr = False):
    """Chunk c writes its taken positions after those of chunks < c (position order), then its share of padding."""
    wait_for_producers(PDL)
    t, c = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + t.to(tl.int64) * stride_l
    need_eq, thr = _resolve(hist_ptr + t.to(tl.int64) * 1024, k, 4)
    cc = tl.arange(0, MAX_CHUNKS)
    counts = counts_ptr + t.to(tl.int64) * num_chunks * 2 + cc * 2
    gts = tl.load(counts, mask=cc < num_chunks, other=0)
    eqs = tl.load(counts + 1, mask=cc < num_chunks, other=0)
    n_eq = tl.sum(tl.where(cc < c, eqs, 0), axis=0)
    n_out = tl.sum(tl.where(cc < c, gts, 0), axis=0) + tl.minimum(n_eq, need_eq)
    total = tl.sum(gts, axis=0) + tl.minimum(tl.sum(eqs, axis=0), need_eq)
    r2t_row = r2t_ptr + tl.load(rows_ptr + t).to(tl.int64) * stride_r2t
    out_slots = slots_ptr + t.to(tl.int64) * stride_o
    out_pos = pos_ptr + t.to(tl.int64) * stride_o
    lo = c * chunk
    _write_taken(row_ptr, r2t_row, out_slots, out_pos, lo, tl.minimum(lo + chunk, width), thr, need_eq, n_out, n_eq,
                 BLOCK)
    _pad_tail(out_slots, out_pos, c * BLOCK, num_chunks * BLOCK, total, k, BLOCK)


# (BLOCK, RADIX_BITS, num_warps) of the radix select, set from measurements (benchmarks/kernels/KERNELS.md).
TOPK_CONFIG = (8192, 8, 16)


def _check(logits: torch.Tensor, topk: int, token_rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"topk: want fp32 logits [T, W], got {logits.dtype} {tuple(logits.shape)}")
    if token_rows.shape != (logits.shape[0],):
        raise ValueError(f"topk: token_rows {tuple(token_rows.shape)} != [T] = {(logits.shape[0],)}")
    if topk < 1:
        raise ValueError(f"topk: k must be >= 1, got {topk}")


# Split rows over programs while the rows alone would leave most SMs idle: (BLOCK, num_warps, least keys
# per program). H100, bench-dsv32 decode graph at batch 1 / 4k: 32 us per layer split over 3 programs
# (7 launches) vs 47 us in one program; at 32k and 128k the one-program kernel is 3-6x slower.
SPLIT_CONFIG = (1024, 4, 2048)
SPLIT_MAX_CHUNKS = 64


# torch.topk vs the Triton radix select, by measurement on H100 (benchmarks/kernels/KERNELS.md): one program per row
# (~3.8 us per 1k elements) wins while each SM scans at most one 64k row (batch 64 x 32k: 0.127 vs 0.20-0.29
# ms; 1 x 64k: 0.24 vs 0.30; 128 x 64k: a tie); few rows split over programs (1 x 128k: 0.083 vs 0.166 ms).
TRITON_MAX_ROW_WORK = 64 * 1024


def triton_wins(num_tokens: int, width: int, device: torch.device) -> bool:
    """The measured crossover between the Triton radix select and torch.topk for a [num_tokens, width] batch."""
    if few_rows(num_tokens, device):
        return True
    waves = -(-num_tokens // num_sms(device))
    return waves * width <= TRITON_MAX_ROW_WORK


# Which rows take the register select, from benchmarks/scripts/bench_topk_short.py (H200, k = 2048, us per call in CUDA
# graphs; benchmarks/kernels/topk_short_h200_f931d2f.json). Against the one-program-per-row kernel it wins at every
# batch (1-64) and width measured: 12.5 vs 19.9 us at 4096, 20.0 vs 33.0 at 8192, 35 vs 61 at 16384. Against the split
# select (few rows): 12.1 vs 32.9 at 4096, 19.8 vs 33.2 at 8192, but 34.6 vs 33.0 at 16384. With two tiles (8c4b33f,
# same benchmark, benchmarks/archive/TAIL.md section 4): 27.5 vs 35.8 at one row 8300 wide, 27.4 vs 32.9 at 10240, so
# few rows split above 10240.
REGISTER_MAX_WIDTH = 16384
REGISTER_FEW_ROWS_MAX_WIDTH = 10240
REGISTER_MAX_BLOCK = 16384
# RADIX_BITS of the register select (2: packed-count search, 8: tl.histogram passes): 2 won at every shape of the
# same measurement (4096: 12.1 vs 16.0 us). Its num_warps follows the block (`register_warps`).
REGISTER_RADIX_BITS = 2
# The 2-bit search stops once the bits fixed so far take exactly k keys: indexer-like rows at batch 1, width 4160,
# 16.7 -> 11.1 us against the 16 unrolled steps (H100, bench_topk_short.py --early-exit-ab,
# benchmarks/kernels/topk_early_exit_h100_d5a86ad.json).
REGISTER_EARLY_EXIT = True
TOPK_METHODS = ("register", "split", "rows")


def register_select_wins(num_tokens: int, width: int, device: torch.device) -> bool:
    """The register select (one program per row, one launch, the row read once) over the split select (few rows:
    6 launches) or the one-program-per-row kernel (4 reads of the row), as measured."""
    if few_rows(num_tokens, device):
        return width <= REGISTER_FEW_ROWS_MAX_WIDTH
    return width <= REGISTER_MAX_WIDTH


def register_warps(block: int) -> int:
    """num_warps of the register select for a row block: 8, and 16 for 16384-wide rows, the fastest of 4 to 32 on
    the H200 (8192: 19.1 us at 8 warps, 19.7 at 16, 24.2 at 32; 16384: 34.6 at 16, 39.7 at 32; 2048: within
    0.2 us of each other). ptxas for sm_90, RADIX_BITS 2: 16384 at 16 warps spills 60 bytes a thread."""
    return 16 if block > 8192 else 8


def fastest_topk_slots(logits: torch.Tensor, topk: int, req_to_token: torch.Tensor,
                       token_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_slots` or `torch_topk_slots`, whichever `triton_wins` picks for this shape.

    Called inside an opaque custom op: deciding here, on the concrete shape, keeps the row count and the SM
    count out of compiled graphs (traced, the choice would add guards on the batch size)."""
    if triton_wins(logits.shape[0], logits.shape[1], logits.device):
        return topk_slots(logits, topk, req_to_token, token_rows)
    return torch_topk_slots(logits, topk, req_to_token, token_rows)


def split_chunks(num_tokens: int, width: int, device: torch.device) -> int:
    """Programs per row for the split select (1 = one program per row, the single-launch kernel)."""
    if not few_rows(num_tokens, device):
        return 1
    min_keys = SPLIT_CONFIG[2]
    return max(1, min(SPLIT_MAX_CHUNKS, (2 * num_sms(device)) // num_tokens, triton.cdiv(width, min_keys)))


def topk_slots(
    logits: torch.Tensor, topk: int, req_to_token: torch.Tensor, token_rows: torch.Tensor,
    config: tuple[int, int, int] | None = None, num_chunks: int | None = None, split_block: int | None = None,
    method: str | None = None, register_config: tuple[int, int] | None = None,
    register_tiles: tuple[int, int] | None = None, register_early_exit: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton radix select: (slots [T, topk] int32, positions [T, topk] int32), -1 padded, position order.

    `method` forces a kernel: "register" (row in registers, width <= REGISTER_MAX_BLOCK), "split" (rows split
    over programs) or "rows" (one program per row, re-reading the row each pass). By default: `num_chunks` if
    given, else the register select where `register_select_wins`, else `split_chunks`.
    `num_chunks`: programs per row (default `split_chunks`; 1 runs the one-program-per-row kernel with
    `config`); `split_block` overrides the split kernels' block (tests: several chunks on short rows);
    `register_config`: (RADIX_BITS, num_warps) of the register select; `register_tiles`: its (HEAD, TAIL) tiles
    (default `register_tiles_for(width, topk)`; (P, 0) runs one power-of-two block, as before the tail tile existed);
    `register_early_exit`: whether its 2-bit search may stop early (default REGISTER_EARLY_EXIT; same output)."""
    _check(logits, topk, token_rows)
    if method is not None and method not in TOPK_METHODS:
        raise ValueError(f"topk: method must be one of {TOPK_METHODS}, got {method!r}")
    num_tokens, width = logits.shape
    slots = torch.empty(num_tokens, topk, dtype=torch.int32, device=logits.device)
    positions = torch.empty_like(slots)
    if num_tokens == 0:
        return slots, positions
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if method is None and num_chunks is None and register_select_wins(num_tokens, width, logits.device):
        method = "register"
    if method == "register":
        _register_topk(logits, topk, req_to_token, token_rows, slots, positions, register_config, register_tiles,
                       register_early_exit)
        return slots, positions
    if num_chunks is None:
        num_chunks = split_chunks(num_tokens, width, logits.device)
    if method == "split" or (method is None and num_chunks > 1):
        _split_topk(logits, topk, req_to_token, token_rows, slots, positions, num_chunks, split_block)
        return slots, positions
    block, radix_bits, num_warps = config or TOPK_CONFIG
    block = min(block, max(256, triton.next_power_of_2(max(width, topk))))
    _topk_kernel[(num_tokens,)](
        logits, req_to_token, token_rows, slots, positions,
        width, topk, logits.stride(0), req_to_token.stride(0), slots.stride(0),
        BLOCK=block, RADIX_BITS=radix_bits, num_warps=num_warps, **pdl_launch(logits.device),
    )
    return slots, positions


def register_tiles_for(width: int, topk: int) -> tuple[int, int]:
    """(HEAD, TAIL) register tiles of the register select for rows `width` wide: the power-of-two block P that holds
    the row (and k: rows narrower than k share k's block), or, when the row passes P / 2 by at most P / 8, a P / 2
    tile plus a P / 8 one (4096 + 1024 lanes for 4096 + a few decode tokens, not 8192). Widths that are powers of
    two keep their one block; each rule adds one compiled variant per power of two (7 at k = 2048, 2048 to 16384),
    not one per width."""
    need = max(256, width, topk)
    block = triton.next_power_of_2(need)
    if need <= block // 2 + block // 8:
        return block // 2, block // 8
    return block, 0


def _register_topk(logits, topk, req_to_token, token_rows, slots, positions,
                   config: tuple[int, int] | None = None, tiles: tuple[int, int] | None = None,
                   early_exit: bool | None = None) -> None:
    num_tokens, width = logits.shape
    if triton.next_power_of_2(width) > REGISTER_MAX_BLOCK:
        raise ValueError(f"topk: the register select takes rows up to {REGISTER_MAX_BLOCK} wide, got {width}")
    head, tail = tiles or register_tiles_for(width, topk)
    if head + tail < width or head & (head - 1) or tail & (tail - 1) or head + tail > REGISTER_MAX_BLOCK:
        raise ValueError(f"topk: register tiles {(head, tail)} (powers of two, at most {REGISTER_MAX_BLOCK} lanes) "
                         f"do not hold a {width}-wide row")
    radix_bits, num_warps = config or (REGISTER_RADIX_BITS, register_warps(head + tail))
    _register_topk_kernel[(num_tokens,)](
        logits, req_to_token, token_rows, slots, positions,
        width, topk, logits.stride(0), req_to_token.stride(0), slots.stride(0),
        HEAD=head, TAIL=tail, RADIX_BITS=radix_bits,
        EARLY_EXIT=REGISTER_EARLY_EXIT if early_exit is None else early_exit, num_warps=num_warps,
        **pdl_launch(logits.device),
    )


def _split_topk(logits, topk, req_to_token, token_rows, slots, positions, num_chunks: int,
                block: int | None = None) -> None:
    num_tokens, width = logits.shape
    default_block, num_warps, _ = SPLIT_CONFIG
    block = block or default_block
    chunk = triton.cdiv(triton.cdiv(width, num_chunks), block) * block
    num_chunks = triton.cdiv(width, chunk)
    hist = torch.zeros(num_tokens, 4, 256, dtype=torch.int32, device=logits.device)
    counts = torch.empty(num_tokens, num_chunks, 2, dtype=torch.int32, device=logits.device)
    grid = (num_tokens, num_chunks)
    for p in range(4):
        _split_hist_kernel[grid](logits, hist, width, topk, chunk, logits.stride(0), PASS=p, BLOCK=block,
                                 num_warps=num_warps, **pdl_launch(logits.device))
    _split_count_kernel[grid](logits, hist, counts, width, topk, chunk, num_chunks, logits.stride(0), BLOCK=block,
                              num_warps=num_warps, **pdl_launch(logits.device))
    _split_write_kernel[grid](logits, hist, counts, req_to_token, token_rows, slots, positions,
                              width, topk, chunk, num_chunks, logits.stride(0), req_to_token.stride(0),
                              slots.stride(0), BLOCK=block, MAX_CHUNKS=triton.next_power_of_2(num_chunks),
                              num_warps=num_warps, **pdl_launch(logits.device))


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
