"""KV memory: page allocator, req->token table, per-layer MLA and indexer caches.

Slots are token-granular ids `page * page_size + offset`. Page 0 is never
handed out: its slot 0 is the dummy slot that padding rows (CUDA-graph
batches, -1 indices) point at. Both per-layer caches use the same slot ids.

Each cache kind has one layout object that owns its geometry: bytes per
token, the buffer it allocates, the views kernels read, the reference store.

MLA cache layouts (`MLALayout`, chosen by `EngineConfig.kv_cache_dtype`):
- "auto": `[num_slots, latent + rope]` in the model dtype (1152 bytes per
  token per layer in bf16 on the real models).
- "fp8": FlashMLA's layout, uint8 `[num_slots, 656]` per layer: 512 e4m3
  latent values, one power-of-two fp32 scale per 128 of them, 64 bf16 rope
  values (`reference.mla_fp8_views`). Nearly half the bytes per token.

Indexer K cache layouts (`IndexerLayout`):
- "model": full-precision keys `[num_slots, D]` in the model dtype (parity
  with transformers, CPU default).
- "fp8": DeepGEMM's paged layout, one uint8 buffer `[num_pages,
  page_size * (D + 4)]` per layer: a page's `page_size * D` e4m3 key bytes
  (Hadamard-rotated), then its `page_size` fp32 scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidsa.exec.batch import host_to_device
from minidsa.kernels import reference as ref

KV_CACHE_DTYPES = ("auto", "fp8")


class OutOfPages(RuntimeError):
    """KV memory is exhausted; the scheduler preempts or waits."""


class PageAllocator:
    """Hands out KV pages and counts who holds them.

    `ref(page)` is the number of requests holding a page: with prefix caching
    several requests share the pages of a common prefix. Separately a page
    may be *cached*, held by the prefix cache (prefix_cache.py). A page goes
    back to the free list once no request holds it and the cache does not
    either. A cached page no request holds is *evictable*: it keeps its KV
    for later hits, and `alloc` asks the cache to evict such pages when the
    free list runs short, so evictable pages count as available.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (page 0 is the reserved dummy page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Low pages first: keeps allocations deterministic and compact.
        self._free = list(range(num_pages - 1, 0, -1))
        self._ref = [0] * num_pages  # requests holding each page
        self._used = bytearray(num_pages)  # 1 while some request holds the page (ref > 0)
        self._cached = bytearray(num_pages)  # 1 while the prefix cache holds the page
        self.num_cached_pages = 0
        self.num_evictable_pages = 0  # cached, held by no request
        self.cache = None  # the PrefixCache, once one attaches itself

    def attach_cache(self, cache) -> None:
        """`cache` provides evict(n) -> freed and on_evictable(page); see prefix_cache.PrefixCache."""
        if self.cache is not None:
            raise RuntimeError("a prefix cache is already attached to this allocator")
        self.cache = cache

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list (not counting evictable cached pages)."""
        return len(self._free)

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation can get: free ones plus evictable cached ones."""
        return len(self._free) + self.num_evictable_pages

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        """Pages not on the free list: held by a request or by the prefix cache."""
        return self.num_usable_pages - len(self._free)

    @property
    def num_held_pages(self) -> int:
        """Pages held by at least one request."""
        return self.num_used_pages - self.num_evictable_pages

    def ref(self, page: int) -> int:
        return self._ref[page]

    def is_cached(self, page: int) -> bool:
        return bool(self._cached[page])

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.cache is not None and self.num_evictable_pages:
            self.cache.evict(n - len(self._free))
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            assert self._ref[p] == 0 and not self._cached[p], f"KV page {p} on the free list is still held"
            self._ref[p] = 1
            self._used[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more request holds each of `pages` (held or cached ones: prefix-cache hits)."""
        for p in pages:
            if self._ref[p] == 0:
                if not self._cached[p]:
                    raise RuntimeError(f"KV page {p} is free: it cannot be shared")
                self.num_evictable_pages -= 1
                self._used[p] = 1
            self._ref[p] += 1

    def free(self, pages: list[int]) -> None:
        """One request fewer holds each of `pages`; pages nobody holds any more go back (or stay cached)."""
        released = []
        for p in pages:
            if self._ref[p] == 0:
                raise RuntimeError(f"KV page {p} freed twice (no request holds it)")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._used[p] = 0
                if self._cached[p]:
                    self.num_evictable_pages += 1
                    self.cache.on_evictable(p)
                else:
                    released.append(p)
        self._free.extend(reversed(released))

    def cache_add(self, page: int) -> None:
        """The prefix cache takes a page that a request holds (its KV is complete)."""
        if self._ref[page] == 0:
            raise RuntimeError(f"KV page {page} is held by no request: it cannot enter the prefix cache")
        if self._cached[page]:
            raise RuntimeError(f"KV page {page} is already in the prefix cache")
        self._cached[page] = 1
        self.num_cached_pages += 1

    def cache_evict(self, page: int) -> None:
        """The prefix cache drops an evictable page: it goes back to the free list."""
        if not self._cached[page]:
            raise RuntimeError(f"KV page {page} is not in the prefix cache")
        if self._ref[page]:
            raise RuntimeError(f"KV page {page} evicted while {self._ref[page]} requests hold it")
        self._cached[page] = 0
        self.num_cached_pages -= 1
        self.num_evictable_pages -= 1
        self._free.append(page)

    def check_refs(self, holders: dict[int, int]) -> None:
        """Debug check: `holders[page]` (the running requests' count) is every page's reference count, and
        the free list, the cache flags and the counters agree."""
        bad = [p for p in range(1, self.num_pages) if self._ref[p] != holders.get(p, 0)]
        if bad:
            p = bad[0]
            raise AssertionError(f"KV slot leak or early free: {len(bad)} pages with wrong reference counts, "
                                 f"e.g. page {p}: {self._ref[p]} holders counted, {holders.get(p, 0)} running "
                                 f"requests hold it; pages {bad[:20]}")
        free = set(self._free)
        if len(free) != len(self._free) or 0 in free:
            raise AssertionError("KV free list has duplicates or the dummy page")
        wrong = [p for p in free if self._ref[p] or self._cached[p]]
        if wrong:
            raise AssertionError(f"KV pages on the free list are still held: {wrong[:20]}")
        lost = [p for p in range(1, self.num_pages) if p not in free and not self._ref[p] and not self._cached[p]]
        if lost:
            raise AssertionError(f"KV slot leak: {len(lost)} pages held by nobody but not free: {lost[:20]}")
        if any(self._used[p] != (self._ref[p] > 0) for p in range(self.num_pages)):
            raise AssertionError("KV allocator: used flags disagree with reference counts")
        cached = sum(self._cached)
        evictable = sum(1 for p in range(self.num_pages) if self._cached[p] and not self._ref[p])
        if cached != self.num_cached_pages or evictable != self.num_evictable_pages:
            raise AssertionError(f"KV allocator counters: {self.num_cached_pages} cached / "
                                 f"{self.num_evictable_pages} evictable counted, {cached} / {evictable} found")

    def check_all_free(self) -> None:
        """Debug check: raise if any page is still held by a request (pages held only by the prefix cache are
        fine: they are evictable)."""
        held = [i for i in range(1, self.num_pages) if self._ref[i]]
        if held:
            raise AssertionError(f"KV slot leak: {len(held)} pages still allocated: {held[:20]}")
        self.check_refs({})


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def slots_of(pages: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Physical slots of row positions [start, end) for a request holding `pages`."""
    pos = torch.arange(start, end, dtype=torch.int64)
    page_ids = torch.tensor(pages, dtype=torch.int64)
    return page_ids[pos // page_size] * page_size + pos % page_size


def row_slots(req_to_token: torch.Tensor, rows: list[int], starts: list[int], lens: list[int]) -> torch.Tensor:
    """Slots of row positions [starts[b], starts[b] + lens[b]) of each row, concatenated (int64)."""
    assert len(rows) == len(starts) == len(lens)
    parts = [req_to_token[r, s:s + n] for r, s, n in zip(rows, starts, lens)]
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=req_to_token.device)
    return torch.cat(parts).long()


class RowAllocator:
    """Which req_to_token rows are free: host bookkeeping of the control plane (the table is the worker's)."""

    def __init__(self, max_reqs: int):
        self.max_reqs = max_reqs
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfPages("no free req_to_token rows")
        return self._free.pop()

    def free(self, row: int) -> None:
        if row in self._free:
            raise RuntimeError(f"req_to_token row {row} freed twice")
        self._free.append(row)

    def check_all_free(self) -> None:
        if len(self._free) != self.max_reqs:
            raise AssertionError(f"req_to_token leak: {self.max_reqs - len(self._free)} rows still allocated")


class ReqToTokenPool:
    """The req->token table (row position -> slot, one row per running request) and its row allocator.

    Rows are handed out by the scheduler (`rows`); the table is written only by the worker, from the
    step plan's page writes (`write_pages`). A freed row keeps stale slots: a new owner maps every
    position it reads before reading it.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str):
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
        self.rows = RowAllocator(max_reqs)

    @property
    def num_free(self) -> int:
        return self.rows.num_free

    def alloc(self) -> int:
        return self.rows.alloc()

    def free(self, row: int) -> None:
        self.rows.free(row)

    def check_all_free(self) -> None:
        self.rows.check_all_free()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(f"row position {end} exceeds the table width {self.max_context_len}")
        # non-blocking from pinned memory: a page-table write inside a decode step must not wait for the device
        self.req_to_token[row, start:end] = host_to_device(slots.to(torch.int32), self.req_to_token.device)

    def write_pages(self, row: int, first_page: int, pages: list[int] | tuple[int, ...], page_size: int) -> None:
        """Map row positions [first_page * page_size, ...) onto `pages` (clipped to the table width)."""
        start = first_page * page_size
        end = min(start + len(pages) * page_size, self.max_context_len)
        if end > start:
            self.write(row, start, slots_of(list(pages), 0, end - start, page_size))


@dataclass(frozen=True)
class MLALayout:
    """One token's row of the MLA latent cache: `[latent | rope]` in `dtype`, or the FP8 656-byte layout."""

    latent_dim: int  # kv_lora_rank (512 on the real models); also the attention's value width
    rope_dim: int  # qk_rope_head_dim (64)
    dtype: torch.dtype  # the model dtype: "auto" rows are stored in it, fp8 rows are dequantised to it
    fp8: bool

    @classmethod
    def for_model(cls, latent_dim: int, rope_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> "MLALayout":
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype '{kv_cache_dtype}' is not one of {KV_CACHE_DTYPES}")
        fp8 = kv_cache_dtype == "fp8"
        if fp8:
            group = ref.mla_fp8_group(latent_dim)
            # Whole 32-bit words per part: the scales are fp32 and kv_move copies words.
            if latent_dim % group or latent_dim % 4 or rope_dim % 2:
                raise ValueError(f"kv_cache_dtype 'fp8' needs kv_lora_rank a multiple of 4 (and of 128 above 128) "
                                 f"and an even qk_rope_head_dim, got {latent_dim} and {rope_dim}")
        return cls(latent_dim, rope_dim, dtype, fp8)

    @property
    def kind(self) -> str:
        return "fp8" if self.fp8 else "auto"

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token in one layer (656 fp8, 1152 bf16 on the real models)."""
        if self.fp8:
            return ref.mla_fp8_row_bytes(self.latent_dim, self.rope_dim)
        return (self.latent_dim + self.rope_dim) * self.dtype.itemsize

    def allocate(self, num_layers: int, num_slots: int, device: torch.device | str) -> torch.Tensor:
        """The whole-model buffer [layers, slots, row] (one buffer, so one kernel launch can move every layer)."""
        if self.fp8:
            return torch.zeros(num_layers, num_slots, self.bytes_per_token, dtype=torch.uint8, device=device)
        return torch.zeros(num_layers, num_slots, self.latent_dim + self.rope_dim, dtype=self.dtype, device=device)

    def fp8_views(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(latent e4m3 [S, L], scales fp32 [S, L/128], rope bf16 [S, R]) of one layer's FP8 cache."""
        assert self.fp8, "fp8_views of a model-dtype MLA cache"
        return ref.mla_fp8_views(layer_cache, self.latent_dim)

    def store(self, layer_cache: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor) -> None:
        """Reference store of rows `kv [T, L + R]` at slots `loc` (quantising for fp8)."""
        ref.store_mla(layer_cache, loc, kv, self.latent_dim)

    def load(self, layer_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """fp32 rows [..., L + R] at `slots` (dequantised for fp8)."""
        return ref.load_mla(layer_cache, slots, self.latent_dim)


@dataclass(frozen=True)
class IndexerLayout:
    """One token's indexer key: `[D]` in `dtype`, or fp8 in DeepGEMM's paged layout (D e4m3 bytes + fp32 scale)."""

    head_dim: int
    dtype: torch.dtype
    fp8: bool
    page_size: int

    @property
    def bytes_per_token(self) -> int:
        return self.head_dim + 4 if self.fp8 else self.head_dim * self.dtype.itemsize

    def allocate(self, num_layers: int, num_pages: int, device: torch.device | str) -> torch.Tensor:
        if self.fp8:
            shape = (num_layers, num_pages, self.page_size * (self.head_dim + 4))
            return torch.zeros(shape, dtype=torch.uint8, device=device)
        return torch.zeros(num_layers, num_pages * self.page_size, self.head_dim, dtype=self.dtype, device=device)

    def fp8_views(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [num_pages, page_size, D] e4m3, scales [num_pages, page_size] fp32) of one layer."""
        assert self.fp8, "fp8_views of a full-precision indexer cache"
        return ref.fp8_views(layer_cache, self.page_size, self.head_dim)

    def store(self, layer_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor) -> None:
        """Reference store of keys `k [T, D]` at slots `loc` (Hadamard + e4m3 for fp8)."""
        ref.store_index_k(layer_cache, loc, k, self.page_size)


@dataclass(frozen=True)
class CacheLayouts:
    """A model's two cache layouts and which of its layers (MTP layer last) keep indexer keys."""

    mla: MLALayout
    index: IndexerLayout
    indexer_layers: tuple[bool, ...]

    @classmethod
    def for_model(cls, model_config, dtype: torch.dtype, kv_cache_dtype: str, indexer_fp8: bool,
                  page_size: int) -> "CacheLayouts":
        """ValueError (naming kv_cache_dtype) when the model's shapes cannot take the MLA layout asked for."""
        mla = MLALayout.for_model(model_config.kv_lora_rank, model_config.qk_rope_head_dim, dtype, kv_cache_dtype)
        index = IndexerLayout(model_config.index_head_dim, dtype, indexer_fp8, page_size)
        layers = tuple(model_config.indexer_full) + (True,) * model_config.num_nextn_predict_layers
        return cls(mla, index, layers)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.mla, self.index, len(self.indexer_layers), sum(self.indexer_layers))


def kv_bytes_per_token(mla: MLALayout, index: IndexerLayout, num_layers: int, num_indexer_layers: int) -> int:
    """KV bytes one token costs across the model (what capacity is computed from)."""
    return num_layers * mla.bytes_per_token + num_indexer_layers * index.bytes_per_token


class KVCache:
    """Per-layer MLA latent cache and indexer key cache, addressed by slot, in the layouts given."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        mla: MLALayout,
        index: IndexerLayout,
        device: torch.device | str,
        indexer_layers: list[bool] | None = None,
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = index.page_size
        self.num_slots = num_pages * self.page_size
        self.mla_layout = mla
        self.index_layout = index
        self.device = torch.device(device)
        # One buffer per cache kind for all layers, so one kernel launch can move rows of every layer.
        self.mla_buffer = mla.allocate(num_layers, self.num_slots, device)
        self.mla = list(self.mla_buffer.unbind(0))
        # Shared layers never write indexer keys: they get no buffer.
        has_index = indexer_layers if indexer_layers is not None else [True] * num_layers
        if len(has_index) != num_layers:
            raise ValueError(f"indexer_layers has {len(has_index)} entries for {num_layers} layers")
        self.index_layer_ids = [i for i, h in enumerate(has_index) if h]
        self.index_buffer = index.allocate(len(self.index_layer_ids), num_pages, device)
        views = iter(self.index_buffer.unbind(0))
        self.index_k: list[torch.Tensor | None] = [next(views) if h else None for h in has_index]

    # The facts other modules read, named as before the layouts existed.
    @property
    def kv_dim(self) -> int:
        return self.mla_layout.latent_dim + self.mla_layout.rope_dim

    @property
    def index_head_dim(self) -> int:
        return self.index_layout.head_dim

    @property
    def indexer_fp8(self) -> bool:
        return self.index_layout.fp8

    @property
    def mla_fp8(self) -> bool:
        return self.mla_layout.fp8

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.mla_layout, self.index_layout, self.num_layers, len(self.index_layer_ids))

    def persistent_tensors(self) -> list[torch.Tensor]:
        """Every tensor the forward reads from this cache: the buffers and their per-layer views."""
        return [self.mla_buffer, *self.mla, self.index_buffer, *(k for k in self.index_k if k is not None)]
