"""One-launch KV move: copy slot rows of every layer's MLA and indexer caches (tree compaction).

Works on the whole-model buffers of `KVCache` (`mla_buffer [L, slots, Dkv]`,
`index_buffer [L_idx, ...]`), viewed as 32-bit words. A program owns one
column chunk of one layer of one cache region for ALL moves: it loads every
source row first, waits at a barrier, then stores, so a move whose source is
another move's destination reads the old value (the reference's
gather-then-scatter semantics), with no second launch.

Regions (the addressing of a slot's words inside one layer):
- MLA rows: `slot * row_words + c`.
- indexer, full precision: the same, with its own row width.
- indexer, fp8 paged: keys at `page * page_words + off * D/4 + c`, the scale at
  `page * page_words + page_size * D/4 + off`.
"""

from __future__ import annotations

import torch

from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

MAX_WORDS_PER_PROGRAM = 4096  # registers per program: moves x column chunk
MAX_MOVES = 8192


@triton.jit
def _copy_region(base_ptr, src_ptr, dst_ptr, n_moves, layer, chunk, layer_words, page_size, page_words,
                 row_words, col0, ncols, BLOCK_M: tl.constexpr, COLS: tl.constexpr):
    m = tl.arange(0, BLOCK_M)
    c = chunk * COLS + tl.arange(0, COLS)
    m_ok = m < n_moves
    ok = m_ok[:, None] & (c[None, :] < ncols)
    src = tl.load(src_ptr + m, mask=m_ok, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + m, mask=m_ok, other=0).to(tl.int64)
    base = base_ptr + layer.to(tl.int64) * layer_words + col0
    s_off = (src // page_size) * page_words + (src % page_size) * row_words
    d_off = (dst // page_size) * page_words + (dst % page_size) * row_words
    x = tl.load(base + s_off[:, None] + c[None, :], mask=ok)
    tl.debug_barrier()  # every read of this chunk before any write (moves may chain)
    tl.store(base + d_off[:, None] + c[None, :], x, mask=ok)


@triton.jit
def _kv_move_kernel(
    src_ptr, dst_ptr, n_moves,
    a_ptr, a_layers, a_chunks, a_layer_words, a_page_size, a_page_words, a_row_words, a_col0, a_ncols,
    b_ptr, b_layers, b_chunks, b_layer_words, b_page_size, b_page_words, b_row_words, b_col0, b_ncols,
    c_ptr, c_layers, c_chunks, c_layer_words, c_page_size, c_page_words, c_row_words, c_col0, c_ncols,
    BLOCK_M: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    n_a = a_layers * a_chunks
    n_b = b_layers * b_chunks
    if pid < n_a:
        _copy_region(a_ptr, src_ptr, dst_ptr, n_moves, pid // a_chunks, pid % a_chunks, a_layer_words,
                     a_page_size, a_page_words, a_row_words, a_col0, a_ncols, BLOCK_M, COLS)
    elif pid < n_a + n_b:
        p = pid - n_a
        _copy_region(b_ptr, src_ptr, dst_ptr, n_moves, p // b_chunks, p % b_chunks, b_layer_words,
                     b_page_size, b_page_words, b_row_words, b_col0, b_ncols, BLOCK_M, COLS)
    else:
        p = pid - n_a - n_b
        _copy_region(c_ptr, src_ptr, dst_ptr, n_moves, p // c_chunks, p % c_chunks, c_layer_words,
                     c_page_size, c_page_words, c_row_words, c_col0, c_ncols, BLOCK_M, COLS)


def _words(buf: torch.Tensor) -> torch.Tensor:
    if buf.stride(-1) != 1 or (buf.shape[-1] * buf.element_size()) % 4:
        raise ValueError(f"kv_move: cache rows must be contiguous whole 32-bit words, got {tuple(buf.shape)} {buf.dtype}")
    return buf.view(torch.int32)


def kv_move(
    mla_buffer: torch.Tensor,
    index_buffer: torch.Tensor | None,
    src: torch.Tensor,
    dst: torch.Tensor,
    page_size: int,
    index_head_dim: int,
) -> None:
    """Copy rows at slots `src` to slots `dst` in every layer of both caches, in one launch.

    mla_buffer: [L, slots, Dkv]; index_buffer: [L_idx, slots, D] (full precision)
    or [L_idx, pages, page_size * (D + 4)] uint8 (fp8 paged), or None.
    """
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"kv_move: src {tuple(src.shape)} and dst {tuple(dst.shape)} must be equal 1-D")
    n = src.shape[0]
    if n == 0:
        return
    if n > MAX_MOVES:
        raise ValueError(f"kv_move: {n} moves in one call, at most {MAX_MOVES}")
    if mla_buffer.dim() != 3:
        raise ValueError(f"kv_move: mla_buffer must be [L, slots, Dkv], got {tuple(mla_buffer.shape)}")
    block_m = max(2, triton.next_power_of_2(n))
    cols = max(1, min(128, MAX_WORDS_PER_PROGRAM // block_m))
    mla = _words(mla_buffer)
    # (ptr, layers, layer_words, page_size, page_words, row_words, col0, ncols)
    regions = [(mla, mla.shape[0], mla.stride(0), 1, mla.shape[2], mla.shape[2], 0, mla.shape[2])]
    if index_buffer is not None and index_buffer.shape[0] > 0:
        idx = _words(index_buffer)
        if index_buffer.dtype == torch.uint8:
            if index_head_dim % 4 or index_buffer.shape[2] != page_size * (index_head_dim + 4):
                raise ValueError(f"kv_move: fp8 index buffer {tuple(index_buffer.shape)} does not match "
                                 f"page_size {page_size} and head dim {index_head_dim}")
            kw = index_head_dim // 4
            page_words = idx.shape[2]
            regions.append((idx, idx.shape[0], idx.stride(0), page_size, page_words, kw, 0, kw))
            regions.append((idx, idx.shape[0], idx.stride(0), page_size, page_words, 1, page_size * kw, 1))
        else:
            regions.append((idx, idx.shape[0], idx.stride(0), 1, idx.shape[2], idx.shape[2], 0, idx.shape[2]))
    while len(regions) < 3:
        regions.append((mla, 0, 0, 1, 1, 1, 0, 1))  # empty region: no programs
    args, total = [], 0
    for ptr, layers, layer_words, ps, page_words, row_words, col0, ncols in regions:
        chunks = triton.cdiv(ncols, cols)
        total += layers * chunks
        args += [ptr, layers, chunks, layer_words, ps, page_words, row_words, col0, ncols]
    _kv_move_kernel[(total,)](src, dst, n, *args, BLOCK_M=block_m, COLS=cols, num_warps=4, **pdl_launch(src.device))
