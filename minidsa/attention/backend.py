"""DSA attention backend: everything the model does with the paged caches.

The model calls `DSABackend` to store MLA / indexer keys, score and pick the
top-k, and run sparse MLA attention, handing each layer its `LayerCaches`.
Which implementation serves each op (pure torch `minidsa.kernels.reference`,
Triton, DeepGEMM) was decided at start-up (`minidsa.kernels.choice`); this
backend only follows that `KernelChoice`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minidsa.exec.batch import ForwardBatch
from minidsa.kernels import num_sms
from minidsa.kernels import reference as ref
from minidsa.attention.select import KernelChoice
from minidsa.exec.kv_cache import KVCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerCaches:
    """One layer's cache views, handed to the layer's forward.

    Compiled code reads the tensors (graph inputs), never `layer_id`: layers of one kind then share one
    compiled graph (regional compilation) instead of specialising on their index.
    """

    layer_id: int
    mla: torch.Tensor
    index_k: torch.Tensor | None


@dataclass(frozen=True)
class IndexStep:
    """Per-forward indexer inputs, made once in eager code before the layers run and shared by all of them.

    Deriving them here keeps the batch's request-sized tensors (req_pool_indices, token_req) out of the
    compiled layer: read there, Dynamo would specialise the layer on a batch of one request (a second graph)
    and on the views those tensors are of (`ForwardBatch.build` packs them into one buffer).
    """

    token_rows: torch.Tensor  # [T] req_to_token row of each query token
    num_requests: int  # requests the tokens come from (a host hint the kernels pick tiles / DeepGEMM's form by)
    deepgemm: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # context lens, block table, schedule


class DSABackend:
    """Owns the caches' write/read path for one engine."""

    def __init__(self, kv_cache: KVCache, req_to_token: torch.Tensor, index_topk: int,
                 kernels: KernelChoice | None = None):
        self.kv_cache = kv_cache
        self.req_to_token = req_to_token
        self.topk_width = index_topk
        self.kernels = kernels or KernelChoice()
        # The fp8 indexer's query rotation, built once on the cache's device (an input to compiled steps).
        self.hadamard = (ref.hadamard_matrix(kv_cache.index_head_dim, str(kv_cache.device))
                         if kv_cache.indexer_fp8 else None)
        self._ops = None
        if self.kernels.uses_kernels:
            from minidsa.kernels import dispatch  # Triton: imported only when a kernel serves

            self._ops = dispatch.ops_for(self.kernels)
        self.layer_caches = [LayerCaches(i, kv_cache.mla[i], kv_cache.index_k[i]) for i in range(kv_cache.num_layers)]
        # A host constant for DeepGEMM's schedule, read once here (never from a traced step).
        self._num_sms = num_sms(kv_cache.device)
        # Each op's implementation, bound once from the start-up choice: no per-call re-check.
        ops = self._ops
        served = lambda op: ops is not None and getattr(self.kernels, op) != "torch"  # noqa: E731
        mla = kv_cache.mla_layout
        self._store_mla = (lambda c, loc, x: ops.store_mla(c, loc, x, mla.latent_dim)) if served("store_mla") \
            else mla.store
        self._store_index_k = ops.store_index_k if served("store_index_k") else ref.store_index_k
        self._index_logits = ops.index_logits if served("index_logits") else None  # None: the reference
        self._topk = ops.topk if served("topk") else ref.topk_slots
        self._sparse_mla = ops.sparse_mla if served("sparse_mla") else ref.sparse_mla
        self._kv_move = served("kv_move")

    def persistent_tensors(self) -> list[torch.Tensor]:
        """The tensors that live as long as the engine (caches, req_to_token, Hadamard matrix): fixed shapes."""
        extra = [] if self.hadamard is None else [self.hadamard]
        return [self.req_to_token, *self.kv_cache.persistent_tensors(), *extra]

    @property
    def page_size(self) -> int:
        return self.kv_cache.page_size

    # -- cache writes -------------------------------------------------------
    def store_kv(self, layer: LayerCaches, batch: ForwardBatch, latent_rope: torch.Tensor) -> None:
        """MLA rows [T, latent + rope] at the step's slots; the FP8 layout quantises in the store kernel."""
        self._store_mla(layer.mla, batch.out_cache_loc, latent_rope)

    def store_index_k(self, layer: LayerCaches, batch: ForwardBatch, k: torch.Tensor) -> None:
        self._store_index_k(layer.index_k, batch.out_cache_loc, k, self.page_size)

    # -- indexer ------------------------------------------------------------
    def index_metadata(self, batch: ForwardBatch) -> IndexStep:
        """Per-step indexer inputs shared by every layer (token rows; DeepGEMM's context lens, block table and
        schedule when a kernel needs them): made once per forward instead of once per layer."""
        rows = batch.token_rows
        deepgemm = None
        if self._ops is not None and self.kv_cache.indexer_fp8:
            deepgemm = self._ops.index_metadata(self.req_to_token, rows, batch.kv_lens, batch.max_kv_len,
                                                batch.tree_mask, self.page_size, self._num_sms)
        return IndexStep(rows, batch.batch_size, deepgemm)

    def index_topk(self, layer: LayerCaches, batch: ForwardBatch, q: torch.Tensor, weights: torch.Tensor,
                   step: IndexStep | None = None) -> torch.Tensor:
        """Top-k physical slots [T, index_topk] (int32, -1 padded) for each query token. `step`: this forward's
        `index_metadata` (made here when not handed in)."""
        buf = layer.index_k
        if buf is None:
            raise RuntimeError(f"layer {layer.layer_id} has no indexer cache (a shared layer must reuse top-k)")
        step = step or self.index_metadata(batch)
        if buf.dtype == torch.uint8:
            q, weights = ref.quant_index_q(q, weights, self.hadamard)
        rows = step.token_rows
        if self._index_logits is not None:
            logits = self._index_logits(q, weights, buf, self.page_size, self.req_to_token, rows,
                                        batch.kv_lens, batch.max_kv_len, batch.tree_mask, step.num_requests,
                                        step.deepgemm)
        else:
            logits = ref.index_logits(q, weights, buf, self.page_size, self.req_to_token, rows,
                                      batch.kv_lens, batch.max_kv_len, batch.tree_mask)
        slots, _ = self._topk(logits, self.topk_width, self.req_to_token, rows)
        return slots

    # -- attention ----------------------------------------------------------
    def sparse_mla(self, layer: LayerCaches, q: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
                   v_dim: int) -> torch.Tensor:
        return self._sparse_mla(q, layer.mla, topk_slots, sm_scale, v_dim)

    def kv_move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's MLA and indexer rows from slots `src` to `dst` (tree compaction)."""
        kv = self.kv_cache
        if self._kv_move:
            # One launch over every layer of both caches (KVCache keeps each kind in one buffer).
            self._ops.kv_move_buffers(kv.mla_buffer, kv.index_buffer, src, dst, kv.page_size, kv.index_head_dim)
        else:
            ref.kv_move(kv.mla, kv.index_k, src, dst, kv.page_size, kv.index_head_dim)
