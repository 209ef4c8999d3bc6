"""DSA attention backend: everything the model does with the paged caches.

The model calls `DSABackend` to store MLA / indexer keys, score and pick the
top-k, and run sparse MLA attention, handing each layer its `LayerCaches`.
Which implementation serves each op (pure torch `minidsa.kernels.reference`,
Triton, DeepGEMM, FlashMLA) was decided at start-up (`attention/select.py`);
`bind_ops` binds each op once from that `KernelChoice`, to the reference or
to the custom op (`torch.ops.minidsa.*`) that serves it, and the backend calls
what was bound. Per-shape choices happen inside the custom ops.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minidsa.attention.select import KernelChoice, Libraries
from minidsa.common.batch import ForwardBatch
from minidsa.common.kv_cache import KVCache
from minidsa.kernels import num_sms
from minidsa.kernels import reference as ref

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
    # DeepGEMM's context lens, block table and schedule (None: the build's metadata kernel makes it per layer)
    deepgemm: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None


@dataclass(frozen=True)
class DSAOps:
    """The implementation bound to each DSA op for one engine, with the reference functions' signatures."""

    # (index_k, loc, k, norm_weight, norm_bias, eps, cos, sin, interleaved, page_size): the key from its projection
    store_index_k: Callable[..., None]
    store_mla: Callable[..., None]  # (cache, loc, kv, norm_weight, eps, cos, sin): the key from its projection
    # (q, weights, hadamard, cos, sin, rope_interleave) -> (e4m3 q, weights * q's scales): the queries' side of
    # the fp8 indexer cache, their rope included
    quant_index_q: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len, tree_mask=None,
    #  num_requests=0, step_meta=None): `num_requests` = requests the tokens come from (0 = unknown);
    # `step_meta` = `index_metadata`'s result for the step
    index_logits: Callable[..., torch.Tensor]
    # (req_to_token, req_pool_indices, token_req, kv_lens, max_kv_len, tree_mask, page_size, num_sms) -> (the
    # tokens' req_to_token rows, what DeepGEMM's paged kernel needs per step: context lens, block table, schedule or
    # None; or None when DeepGEMM was not chosen)
    index_metadata: Callable[..., tuple[torch.Tensor, tuple | None]]
    topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (logits, topk, req_to_token, token_rows)
    sparse_mla: Callable[..., torch.Tensor]  # (q, kv_cache, topk_slots, sm_scale, v_dim)
    # (mla_buffer, index_buffer, src, dst, page_size, index_head_dim): every layer of both whole-model buffers
    kv_move: Callable[..., None]


def bind_ops(choice: KernelChoice, libraries: Libraries | None = None, page_size: int = 64) -> DSAOps:
    """Each DSA op bound once to what `choice` says serves it. `libraries`: `select.load_libraries(choice)`;
    `page_size`: the engine's (DeepGEMM's schedule was checked per page size). The stores' ops take both cache
    layouts (FP8 quantised in their kernels, model-dtype rows as they are)."""
    if choice.uses_dsa_kernels:
        importlib.import_module("minidsa.kernels.custom_ops")  # registers torch.ops.minidsa.* (imports Triton)
    ops = torch.ops.minidsa

    def reference_index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len,
                               tree_mask=None, num_requests=0, step_meta=None):
        return ref.index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len,
                                tree_mask)

    def triton_index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len,
                            tree_mask=None, num_requests=0, step_meta=None):
        return ops.index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len,
                                tree_mask, num_requests)

    def no_index_metadata(req_to_token, req_pool_indices, token_req, kv_lens, max_kv_len, tree_mask, page_size,
                          num_sms):
        return req_pool_indices[token_req], None

    if choice.index_logits == "deepgemm":
        index_logits, index_metadata = _bind_deepgemm(libraries, page_size)
    else:
        index_logits = triton_index_logits if choice.index_logits == "triton" else reference_index_logits
        index_metadata = no_index_metadata

    def triton_kv_move(mla_buffer, index_buffer, src, dst, page_size, index_head_dim):
        ops.kv_move(mla_buffer, index_buffer, src, dst, page_size, index_head_dim)

    def reference_kv_move(mla_buffer, index_buffer, src, dst, page_size, index_head_dim):
        index_layers = [] if index_buffer is None else list(index_buffer.unbind(0))
        ref.kv_move(list(mla_buffer.unbind(0)), index_layers, src, dst, page_size, index_head_dim)

    # The ops serve shapes their kernels cannot take themselves (opaque: a compiled layer never traces the
    # reference's per-query-block loop, which would guard on the token count).
    if choice.sparse_mla == "flashmla":
        sparse_mla = ops.flashmla_sparse_mla
    elif choice.sparse_mla == "triton":
        sparse_mla = ops.sparse_mla
    else:
        sparse_mla = ref.sparse_mla
    if choice.topk == "triton":  # the Triton select or torch.topk, chosen per shape inside the op
        topk = ops.topk_slots
    elif choice.uses_dsa_kernels:  # MINIDSA_TOPK=torch beside the kernels: torch.topk, gathering only k slots
        from minidsa.kernels.topk import torch_topk_slots as topk
    else:
        topk = ref.topk_slots
    return DSAOps(
        store_index_k=(ops.norm_rope_store_index_k if choice.store_index_k == "triton"
                       else ref.norm_rope_store_index_k),
        store_mla=ops.norm_rope_store_mla if choice.store_mla == "triton" else ref.norm_rope_store_mla,
        quant_index_q=ops.quant_index_q if choice.quant_index_q == "triton" else ref.quant_index_q,
        index_logits=index_logits,
        index_metadata=index_metadata,
        topk=topk,
        sparse_mla=sparse_mla,
        kv_move=triton_kv_move if choice.kv_move == "triton" else reference_kv_move,
    )


def _bind_deepgemm(libraries: Libraries | None, page_size: int):
    """index_logits and index_metadata through DeepGEMM's op: the handle's facts (the GPU generation, whether
    minidsa computes the schedule at this page size) become the op's plain arguments."""
    handle = libraries.deepgemm if libraries is not None else None
    if handle is None:
        raise ValueError(f"KernelChoice.index_logits = 'deepgemm' needs the DeepGEMM handle "
                         f"(attention.select.load_libraries); got {libraries}")
    sm_major, own_schedule = handle.status.sm_major, handle.own_schedule(page_size)
    ops = torch.ops.minidsa

    def index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len,
                     tree_mask=None, num_requests=0, step_meta=None):
        # DeepGEMM or Triton per shape, and the fallback, all inside the opaque op
        return ops.deepgemm_index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens,
                                         max_kv_len, sm_major, own_schedule, tree_mask, num_requests,
                                         *(step_meta or (None, None, None)))

    def index_metadata(req_to_token, req_pool_indices, token_req, kv_lens, max_kv_len, tree_mask, page_size,
                       num_sms):
        # One launch (kernels/deepgemm_step.py) where torch ran ~30 small kernels per step.
        rows, ctx, table, schedule = ops.deepgemm_step_inputs(
            req_to_token, req_pool_indices, token_req, kv_lens, 0 if tree_mask is None else tree_mask.shape[1],
            max_kv_len, page_size, num_sms)
        # Where the build's schedule differs from minidsa's, its metadata kernel runs inside each layer's op.
        return rows, (ctx, table, schedule if own_schedule else None)

    return index_logits, index_metadata


class DSABackend:
    """Owns the caches' write/read path for one engine."""

    def __init__(self, kv_cache: KVCache, req_to_token: torch.Tensor, index_topk: int,
                 kernels: KernelChoice | None = None, libraries: Libraries | None = None):
        self.kv_cache = kv_cache
        self.req_to_token = req_to_token
        self.topk_width = index_topk
        self.kernels = kernels or KernelChoice()
        # The fp8 indexer's query rotation, built once on the cache's device (an input to compiled steps).
        self.hadamard = (ref.hadamard_matrix(kv_cache.index_head_dim, str(kv_cache.device))
                         if kv_cache.indexer_fp8 else None)
        self.layer_caches = [LayerCaches(i, kv_cache.mla[i], kv_cache.index_k[i]) for i in range(kv_cache.num_layers)]
        # A host constant for DeepGEMM's schedule, read once here (never from a traced step).
        self._num_sms = num_sms(kv_cache.device)
        # Each op's implementation, bound once from the start-up choice: no per-call re-check.
        self.ops = bind_ops(self.kernels, libraries, kv_cache.page_size)

    def persistent_tensors(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """The tensors that live as long as the engine (caches, req_to_token, Hadamard matrix), each with the dims
        the engine's sizing sets (slots or pages, request rows, table width); the model fixes the others."""
        extra = [] if self.hadamard is None else [(self.hadamard, ())]
        return [(self.req_to_token, (0, 1)), *self.kv_cache.persistent_tensors(), *extra]

    @property
    def page_size(self) -> int:
        return self.kv_cache.page_size

    # -- cache writes -------------------------------------------------------
    def store_kv(self, layer: LayerCaches, batch: ForwardBatch, kv: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """MLA keys at the step's slots from the raw projection kv [T, latent + rope]: the latent RMSNorm'd
        (norm_weight, eps), the rope part rotated interleaved (cos / sin [T, rope / 2]); the FP8 layout quantises
        in the same kernel."""
        self.ops.store_mla(layer.mla, batch.out_cache_loc, kv, norm_weight, eps, cos, sin)

    def store_index_k(self, layer: LayerCaches, batch: ForwardBatch, k: torch.Tensor, norm_weight: torch.Tensor,
                      norm_bias: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      interleaved: bool) -> None:
        """Indexer keys at the step's slots from the raw projection k [T, D]: LayerNorm'd (weight, bias, eps), the
        first 2 * cos.shape[-1] dims rotated (interleaved or half-split pairs)."""
        self.ops.store_index_k(layer.index_k, batch.out_cache_loc, k, norm_weight, norm_bias, eps, cos, sin,
                               interleaved, self.page_size)

    # -- indexer ------------------------------------------------------------
    def index_metadata(self, batch: ForwardBatch) -> IndexStep:
        """Per-step indexer inputs shared by every layer (token rows; DeepGEMM's context lens, block table and
        schedule when a kernel needs them): made once per forward instead of once per layer."""
        if not self.kv_cache.indexer_fp8:
            return IndexStep(batch.token_rows, batch.batch_size)
        rows, deepgemm = self.ops.index_metadata(self.req_to_token, batch.req_pool_indices, batch.token_req,
                                                 batch.kv_lens, batch.max_kv_len, batch.tree_mask, self.page_size,
                                                 self._num_sms)
        return IndexStep(rows, batch.batch_size, deepgemm)

    def index_topk(self, layer: LayerCaches, batch: ForwardBatch, q: torch.Tensor, weights: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, rope_interleave: bool,
                   step: IndexStep | None = None) -> torch.Tensor:
        """Top-k physical slots [T, index_topk] (int32, -1 padded) for each query token. `q` [T, H, D] comes
        before its rope, which cos / sin [T, rope/2] apply to its first `rope` columns (`reference.rope_leading`,
        pairs interleaved or half-split): here, so that the fp8 cache's query quantisation, which reads q anyway,
        takes it in. `step`: this forward's `index_metadata` (made here when not handed in)."""
        buf = layer.index_k
        if buf is None:
            raise RuntimeError(f"layer {layer.layer_id} has no indexer cache (a shared layer must reuse top-k)")
        step = step or self.index_metadata(batch)
        if buf.dtype == torch.uint8:
            q, weights = self.ops.quant_index_q(q, weights, self.hadamard, cos, sin, rope_interleave)
        else:  # the logits read q as they are handed it
            q = ref.rope_leading(q, cos.unsqueeze(1), sin.unsqueeze(1), rope_interleave)
        rows = step.token_rows
        logits = self.ops.index_logits(q, weights, buf, self.page_size, self.req_to_token, rows, batch.kv_lens,
                                       batch.max_kv_len, batch.tree_mask, step.num_requests, step.deepgemm)
        slots, _ = self.ops.topk(logits, self.topk_width, self.req_to_token, rows)
        return slots

    # -- attention ----------------------------------------------------------
    def sparse_mla(self, layer: LayerCaches, q: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
                   v_dim: int) -> torch.Tensor:
        return self.ops.sparse_mla(q, layer.mla, topk_slots, sm_scale, v_dim)

    def kv_move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's MLA and indexer rows from slots `src` to `dst` (tree compaction)."""
        kv = self.kv_cache
        # Every layer of both caches (KVCache keeps each kind in one buffer): one launch with Triton.
        self.ops.kv_move(kv.mla_buffer, kv.index_buffer, src, dst, kv.page_size, kv.index_head_dim)
