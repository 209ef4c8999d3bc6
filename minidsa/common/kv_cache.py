"""KV memory on the device: the req->token table, per-layer MLA and indexer caches, their layouts.

Which pages and rows are free is the control plane's host bookkeeping (sched/pages.py); this module holds
what they address. Slots are token-granular ids `page * page_size + offset`. Page 0 is never handed out: its
slot 0 is the dummy slot that padding rows (CUDA-graph batches, -1 indices) point at. Both per-layer caches use
the same slot ids.

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

from minidsa.common.batch import host_to_device
from minidsa.kernels import reference as ref

KV_CACHE_DTYPES = ("auto", "fp8")


def row_slots(req_to_token: torch.Tensor, rows: list[int], starts: list[int], lens: list[int]) -> torch.Tensor:
    """Slots of row positions [starts[b], starts[b] + lens[b]) of each row, concatenated (int64)."""
    assert len(rows) == len(starts) == len(lens)
    parts = [req_to_token[r, s:s + n] for r, s, n in zip(rows, starts, lens)]
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=req_to_token.device)
    return torch.cat(parts).long()


def slots_of(pages: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Physical slots of row positions [start, end) for a request holding `pages`."""
    pos = torch.arange(start, end, dtype=torch.int64)
    page_ids = torch.tensor(pages, dtype=torch.int64)
    return page_ids[pos // page_size] * page_size + pos % page_size


class ReqToTokenTable:
    """The req->token table: row position -> slot, one row per running request.

    Which rows are free is the control plane's (sched/pages.RowAllocator); the table is written only by the
    worker, from the step plan's page writes (`write_pages`). A freed row keeps stale slots: a new owner maps
    every position it reads before reading it.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str):
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)

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

    def persistent_tensors(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Every tensor the forward reads from this cache, the buffers and their per-layer views, each with its
        dim that grows with the page count."""
        return [(self.mla_buffer, (1,)), *((v, (0,)) for v in self.mla), (self.index_buffer, (1,)),
                *((k, (0,)) for k in self.index_k if k is not None)]
