"""KV memory: page allocator, req->token table, per-layer MLA and indexer caches.

Slots are token-granular ids `page * page_size + offset`. Page 0 is never
handed out: its slot 0 is the dummy slot that padding rows (CUDA-graph
batches, -1 indices) point at. Both per-layer caches use the same slot ids.

Indexer K cache layouts:
- "model": full-precision keys `[num_slots, D]` in the model dtype (parity
  with transformers, CPU default).
- "fp8": DeepGEMM's paged layout, one uint8 buffer `[num_pages,
  page_size * (D + 4)]` per layer: a page's `page_size * D` e4m3 key bytes
  (Hadamard-rotated), then its `page_size` fp32 scales.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    """KV memory is exhausted; the scheduler preempts or waits."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (page 0 is the reserved dummy page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Low pages first: keeps allocations deterministic and compact.
        self._free = list(range(num_pages - 1, 0, -1))
        self._used = bytearray(num_pages)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self._used[p]:
                raise RuntimeError(f"KV page {p} freed twice")
            self._used[p] = 0
        self._free.extend(reversed(pages))

    def check_all_free(self) -> None:
        """Debug check: raise if any page is still allocated."""
        if len(self._free) != self.num_usable_pages:
            used = [i for i in range(1, self.num_pages) if self._used[i]]
            raise AssertionError(f"KV slot leak: {len(used)} pages still allocated: {used[:20]}")


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def slots_of(pages: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Physical slots of row positions [start, end) for a request holding `pages`."""
    pos = torch.arange(start, end, dtype=torch.int64)
    page_ids = torch.tensor(pages, dtype=torch.int64)
    return page_ids[pos // page_size] * page_size + pos % page_size


class ReqToTokenPool:
    """Rows of row-position -> slot, one per running request."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str):
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfPages("no free req_to_token rows")
        return self._free.pop()

    def free(self, row: int) -> None:
        self.req_to_token[row].zero_()
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(f"row position {end} exceeds the table width {self.max_context_len}")
        self.req_to_token[row, start:end] = slots.to(self.req_to_token.device, torch.int32)

    def check_all_free(self) -> None:
        if len(self._free) != self.max_reqs:
            raise AssertionError(f"req_to_token leak: {self.max_reqs - len(self._free)} rows still allocated")


class KVCache:
    """Per-layer MLA latent cache and indexer key cache, addressed by slot."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_dim: int,
        index_head_dim: int,
        dtype: torch.dtype,
        indexer_fp8: bool,
        device: torch.device | str,
        indexer_layers: list[bool] | None = None,
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.kv_dim = kv_dim
        self.index_head_dim = index_head_dim
        self.dtype = dtype
        self.indexer_fp8 = indexer_fp8
        self.device = torch.device(device)
        # One buffer per cache kind for all layers, so one kernel launch can move rows of every layer.
        self.mla_buffer = torch.zeros(num_layers, self.num_slots, kv_dim, dtype=dtype, device=device)
        self.mla = list(self.mla_buffer.unbind(0))
        # Shared layers never write indexer keys: they get no buffer.
        has_index = indexer_layers if indexer_layers is not None else [True] * num_layers
        self.index_layer_ids = [i for i, h in enumerate(has_index) if h]
        if indexer_fp8:
            shape = (len(self.index_layer_ids), num_pages, page_size * (index_head_dim + 4))
            self.index_buffer = torch.zeros(shape, dtype=torch.uint8, device=device)
        else:
            shape = (len(self.index_layer_ids), self.num_slots, index_head_dim)
            self.index_buffer = torch.zeros(shape, dtype=dtype, device=device)
        views = iter(self.index_buffer.unbind(0))
        self.index_k: list[torch.Tensor | None] = [next(views) if h else None for h in has_index]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_dim: int, index_head_dim: int, dtype: torch.dtype, indexer_fp8: bool,
                        num_indexer_layers: int | None = None) -> int:
        n_idx = num_layers if num_indexer_layers is None else num_indexer_layers
        idx = (index_head_dim + 4) if indexer_fp8 else index_head_dim * dtype.itemsize
        return num_layers * kv_dim * dtype.itemsize + n_idx * idx

    def index_k_fp8_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [num_pages, page_size, D] float8_e4m3fn, scales [num_pages, page_size] fp32) views of one layer."""
        buf = self.index_k[layer]
        assert self.indexer_fp8 and buf is not None
        ps, d = self.page_size, self.index_head_dim
        keys = buf[:, : ps * d].view(torch.float8_e4m3fn).view(self.num_pages, ps, d)
        scales = buf[:, ps * d :].view(torch.float32)
        return keys, scales

    def write_mla(self, layer: int, loc: torch.Tensor, kv: torch.Tensor) -> None:
        self.mla[layer][loc] = kv.to(self.dtype)
