"""DSA attention backend: the one place that picks kernel implementations.

The model calls `DSABackend` for everything that touches the paged caches:
storing MLA / indexer keys, indexer scores + top-k, sparse MLA attention.
Implementations: pure torch (`minidsa.kernels.reference`, CPU and oracle),
Triton, and DeepGEMM's indexer kernels when importable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minidsa.batch import ForwardBatch
from minidsa.kernels import reference as ref
from minidsa.kv_cache import KVCache

logger = logging.getLogger(__name__)


@dataclass
class KernelChoice:
    """Which implementation serves each DSA op (`torch`, `triton` or `deepgemm`)."""

    store_index_k: str = "torch"
    index_logits: str = "torch"
    topk: str = "torch"
    sparse_mla: str = "torch"
    kv_move: str = "torch"
    store_mla: str = "torch"  # the FP8 MLA layout's quantising store (a model-dtype cache is a plain index_put)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.__dict__.items())


def choose_kernels(device: torch.device, kernel_backend: str = "auto", use_deep_gemm: bool = True) -> KernelChoice:
    """Decide once, at start-up, which kernels run; logs the decision."""
    if kernel_backend == "torch" or (kernel_backend == "auto" and device.type != "cuda"):
        choice = KernelChoice()
    else:
        from minidsa.kernels import dispatch  # Triton; imported only when asked for

        choice = dispatch.choose(device, use_deep_gemm=use_deep_gemm)
    logger.info("DSA kernels: %s", choice.describe())
    return choice


class DSABackend:
    """Owns the caches' write/read path for one engine."""

    def __init__(self, kv_cache: KVCache, req_to_token: torch.Tensor, index_topk: int,
                 kernels: KernelChoice | None = None):
        self.kv_cache = kv_cache
        self.req_to_token = req_to_token
        self.topk_width = index_topk
        self.kernels = kernels or KernelChoice()
        # Tests and the notebook set this to a list to see which positions each layer selected.
        self.topk_recorder: list[tuple[int, torch.Tensor]] | None = None
        # The fp8 indexer's query rotation, built once on the cache's device (an input to compiled steps).
        self.hadamard = (ref.hadamard_matrix(kv_cache.index_head_dim, str(kv_cache.device))
                         if kv_cache.indexer_fp8 else None)
        self._ops = None
        if self.kernels != KernelChoice():
            from minidsa.kernels import dispatch

            self._ops = dispatch.ops_for(self.kernels)

    def persistent_tensors(self) -> list[torch.Tensor]:
        """The tensors that live as long as the engine (caches, req_to_token, Hadamard matrix): fixed shapes."""
        extra = [] if self.hadamard is None else [self.hadamard]
        return [self.req_to_token, *self.kv_cache.persistent_tensors(), *extra]

    @property
    def page_size(self) -> int:
        return self.kv_cache.page_size

    # -- cache writes -------------------------------------------------------
    def store_kv(self, layer: int, batch: ForwardBatch, latent_rope: torch.Tensor) -> None:
        """MLA rows [T, latent + rope] at the step's slots; the FP8 layout quantises in the store kernel."""
        if self._ops is not None and self.kernels.store_mla != "torch":
            self._ops.store_mla(self.kv_cache.mla[layer], batch.out_cache_loc, latent_rope,
                                self.kv_cache.mla_layout.latent_dim)
        else:
            self.kv_cache.write_mla(layer, batch.out_cache_loc, latent_rope)

    def store_index_k(self, layer: int, batch: ForwardBatch, k: torch.Tensor) -> None:
        buf = self.kv_cache.index_k[layer]
        if self._ops is not None and self.kernels.store_index_k != "torch":
            self._ops.store_index_k(buf, batch.out_cache_loc, k, self.page_size)
        else:
            ref.store_index_k(buf, batch.out_cache_loc, k, self.page_size)

    # -- indexer ------------------------------------------------------------
    def index_topk(self, layer: int, batch: ForwardBatch, q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Top-k physical slots [T, index_topk] (int32, -1 padded) for each query token."""
        buf = self.kv_cache.index_k[layer]
        if buf is None:
            raise RuntimeError(f"layer {layer} has no indexer cache (a shared layer must reuse top-k)")
        if buf.dtype == torch.uint8:
            q, weights = ref.quant_index_q(q, weights, self.hadamard)
        rows = batch.token_rows
        if self._ops is not None and self.kernels.index_logits != "torch":
            logits = self._ops.index_logits(q, weights, buf, self.page_size, self.req_to_token, rows,
                                            batch.kv_lens, batch.max_kv_len, batch.tree_mask, batch.batch_size)
        else:
            logits = ref.index_logits(q, weights, buf, self.page_size, self.req_to_token, rows,
                                      batch.kv_lens, batch.max_kv_len, batch.tree_mask)
        if self._ops is not None and self.kernels.topk != "torch":
            slots, positions = self._ops.topk(logits, self.topk_width, self.req_to_token, rows)
        else:
            slots, positions = ref.topk_slots(logits, self.topk_width, self.req_to_token, rows)
        if self.topk_recorder is not None:
            self.topk_recorder.append((layer, positions))
        return slots

    # -- attention ----------------------------------------------------------
    def sparse_mla(self, layer: int, q: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
                   v_dim: int) -> torch.Tensor:
        cache = self.kv_cache.mla[layer]
        if self._ops is not None and self.kernels.sparse_mla != "torch":
            return self._ops.sparse_mla(q, cache, topk_slots, sm_scale, v_dim)
        return ref.sparse_mla(q, cache, topk_slots, sm_scale, v_dim)

    def kv_move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's MLA and indexer rows from slots `src` to `dst` (tree compaction)."""
        kv = self.kv_cache
        if self._ops is not None and self.kernels.kv_move != "torch":
            # One launch over every layer of both caches (KVCache keeps each kind in one buffer).
            self._ops.kv_move_buffers(kv.mla_buffer, kv.index_buffer, src, dst, kv.page_size, kv.index_head_dim)
        else:
            ref.kv_move(kv.mla, kv.index_k, src, dst, kv.page_size, kv.index_head_dim)
