"""The DSA kernels as torch custom ops (`torch.ops.minidsa.*`), opaque to torch.compile.

Each op has a fake (meta) implementation giving output shapes, so Dynamo
traces a model that calls them without looking inside the Triton launches.
Registered once, on import (torch.library.custom_op: torch >= 2.4; used on
2.11 and 2.13).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from minidsa.kernels import deepgemm, indexer, kv_move as kv_move_mod, sparse_mla as sparse_mla_mod
from minidsa.kernels import fused_moe as fused_moe_mod
from minidsa.kernels import topk as topk_mod

logger = logging.getLogger(__name__)
_fallback_logged: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _fallback_logged:
        _fallback_logged.add(msg)
        logger.warning(msg)


@torch.library.custom_op("minidsa::store_index_k", mutates_args=("index_k",))
def store_index_k(index_k: Tensor, loc: Tensor, k: Tensor, page_size: int) -> None:
    indexer.store_index_k(index_k, loc, k, page_size)


def _one_request_extend(q: Tensor, tree_mask: Optional[Tensor], num_requests: int) -> bool:
    """Several tokens of one request, causal: DeepGEMM's ragged (prefill) kernel over its gathered keys serves."""
    return num_requests == 1 and tree_mask is None and q.shape[0] > 1


@torch.library.custom_op("minidsa::index_logits", mutates_args=())
def index_logits(
    q: Tensor, weights: Tensor, index_k: Tensor, page_size: int, req_to_token: Tensor, token_rows: Tensor,
    kv_lens: Tensor, max_kv_len: int, tree_mask: Optional[Tensor] = None, num_requests: int = 0,
) -> Tensor:
    """Triton paged indexer logits; `num_requests` = how many requests the tokens come from (0 = unknown)."""
    return indexer.index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len,
                                tree_mask, num_requests)


@index_logits.register_fake
def _(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len, tree_mask=None,
      num_requests=0):
    return q.new_empty(q.shape[0], max_kv_len, dtype=torch.float32)


@torch.library.custom_op("minidsa::deepgemm_index_logits", mutates_args=())
def deepgemm_index_logits(
    q: Tensor, weights: Tensor, index_k: Tensor, page_size: int, req_to_token: Tensor, token_rows: Tensor,
    kv_lens: Tensor, max_kv_len: int, tree_mask: Optional[Tensor] = None, num_requests: int = 0,
) -> Tensor:
    """DeepGEMM's paged (or, for one request's prefill, ragged) indexer; the Triton kernels if it cannot serve."""
    args = (q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len)
    out = None
    if q.shape[0] > 0 and max_kv_len > 0:
        if _one_request_extend(q, tree_mask, num_requests):
            out = deepgemm.extend_index_logits(*args)
        else:
            out = deepgemm.paged_index_logits(*args, tree_mask)
    if out is None:
        if deepgemm.disabled_reason() is not None:
            _log_once(f"DSA indexer: Triton kernels (DeepGEMM {deepgemm.disabled_reason()})")
        out = index_logits(*args, tree_mask, num_requests)
    return out


@deepgemm_index_logits.register_fake
def _(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len, tree_mask=None,
      num_requests=0):
    return q.new_empty(q.shape[0], max_kv_len, dtype=torch.float32)


@torch.library.custom_op("minidsa::ragged_index_logits", mutates_args=())
def ragged_index_logits(
    q: Tensor, weights: Tensor, keys: Tensor, ks: Tensor, ke: Tensor, key_scales: Optional[Tensor] = None
) -> Tensor:
    return indexer.ragged_index_logits(q, weights, keys, ks, ke, key_scales)


@ragged_index_logits.register_fake
def _(q, weights, keys, ks, ke, key_scales=None):
    return q.new_empty(q.shape[0], keys.shape[0], dtype=torch.float32)


@torch.library.custom_op("minidsa::topk_slots", mutates_args=())
def topk_slots(logits: Tensor, topk: int, req_to_token: Tensor, token_rows: Tensor) -> tuple[Tensor, Tensor]:
    # The Triton select or torch.topk, picked here on the concrete shape (no guards in compiled graphs).
    return topk_mod.fastest_topk_slots(logits, topk, req_to_token, token_rows)


@topk_slots.register_fake
def _(logits, topk, req_to_token, token_rows):
    shape = (logits.shape[0], topk)
    return logits.new_empty(shape, dtype=torch.int32), logits.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op("minidsa::sparse_mla", mutates_args=())
def sparse_mla(q: Tensor, kv_cache: Tensor, topk_slots: Tensor, sm_scale: float, v_dim: int) -> Tensor:
    return sparse_mla_mod.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)


@sparse_mla.register_fake
def _(q, kv_cache, topk_slots, sm_scale, v_dim):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


@torch.library.custom_op("minidsa::kv_move", mutates_args=("mla_buffer", "index_buffer"))
def kv_move(
    mla_buffer: Tensor, index_buffer: Optional[Tensor], src: Tensor, dst: Tensor, page_size: int,
    index_head_dim: int,
) -> None:
    kv_move_mod.kv_move(mla_buffer, index_buffer, src, dst, page_size, index_head_dim)


@torch.library.custom_op("minidsa::fused_moe", mutates_args=())
def fused_moe(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
    gate_up_scale_inv: Optional[Tensor] = None, down_scale_inv: Optional[Tensor] = None,
) -> Tensor:
    """Routed experts for any token count (minidsa.kernels.fused_moe): the torch reference on CPU."""
    return fused_moe_mod.fused_moe_reference(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv,
                                             down_scale_inv)


@fused_moe.register_kernel("cuda")
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv=None, down_scale_inv=None):
    # Tiles are picked inside on the concrete token count: compiled graphs see one opaque op, no guards.
    return fused_moe_mod.fused_moe_triton(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv,
                                          down_scale_inv)


@fused_moe.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv=None, down_scale_inv=None):
    return x.new_empty(x.shape[0], gate_up_proj.shape[2])
