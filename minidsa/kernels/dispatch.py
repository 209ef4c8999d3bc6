"""The ops object DSABackend calls for one `KernelChoice` (made at start-up by kernels/choice.py).

`DSAOps` methods keep the reference functions' signatures and call the custom ops
(`torch.ops.minidsa.*`, opaque to torch.compile). Nothing here probes, imports or
reads a host-side cache while a step traces: the implementation is the choice's
constant, and shape checks are pure functions of static sizes.
"""

from __future__ import annotations

import logging

import torch

from minidsa.kernels import reference as ref
from minidsa.kernels import sparse_mla as sparse_mla_mod
from minidsa.attention.select import KernelChoice, register_custom_ops

logger = logging.getLogger(__name__)


class DSAOps:
    """The DSA ops for one KernelChoice; same signatures as `minidsa.kernels.reference`."""

    def __init__(self, choice: KernelChoice):
        from minidsa.kernels import topk as topk_mod

        register_custom_ops()  # torch.ops.minidsa.*, before they are bound below
        self.choice = choice
        self._ops = torch.ops.minidsa
        self._torch_topk = topk_mod.torch_topk_slots

    def store_index_k(self, index_k: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
        if self.choice.store_index_k == "torch" or index_k.dtype != torch.uint8:
            ref.store_index_k(index_k, loc, k, page_size)
        else:
            self._ops.store_index_k(index_k, loc, k, page_size)

    def store_mla(self, cache: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor, latent_dim: int) -> None:
        if self.choice.store_mla == "torch" or cache.dtype != torch.uint8:
            ref.store_mla(cache, loc, kv, latent_dim)
        else:
            self._ops.store_mla(cache, loc, kv, latent_dim)

    def index_logits(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        index_k: torch.Tensor,
        page_size: int,
        req_to_token: torch.Tensor,
        token_rows: torch.Tensor,
        kv_lens: torch.Tensor,
        max_kv_len: int,
        tree_mask: torch.Tensor | None = None,
        num_requests: int = 0,
        step_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`num_requests`: how many requests the T tokens come from (0 = unknown). With DeepGEMM, one request's
        causal tokens (a prefill chunk) go to fp8_mqa_logits; in the Triton kernel, a few tokens per request
        (verify, draft-extend) share key tiles."""
        args = (q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len, tree_mask)
        impl = self.choice.index_logits
        if impl == "deepgemm":  # DeepGEMM or Triton per shape, and the fallback, all inside the opaque op
            return self._ops.deepgemm_index_logits(*args, num_requests, *(step_meta or (None, None, None)))
        if impl == "triton" and _pow2(q.shape[1]) and _pow2(q.shape[2]) and q.shape[2] >= 16:
            return self._ops.index_logits(*args, num_requests)
        if impl == "triton":
            _log_fallback(f"DSA indexer: torch reference ({q.shape[1]} heads x {q.shape[2]}: the Triton kernel "
                          "needs powers of two)")
        return ref.index_logits(*args)

    def index_metadata(self, req_to_token: torch.Tensor, token_rows: torch.Tensor, kv_lens: torch.Tensor,
                       max_kv_len: int, tree_mask: torch.Tensor | None, page_size: int, num_sms: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """What DeepGEMM's paged kernel needs per step (context lens, block table, schedule), made once per
        forward for every indexer layer; None when DeepGEMM was not chosen."""
        if self.choice.index_logits != "deepgemm":
            return None
        from minidsa.kernels import deepgemm

        ctx = deepgemm.step_context_lens(kv_lens, tree_mask, max_kv_len)
        table = deepgemm.block_table(req_to_token, token_rows, max_kv_len, page_size)
        return ctx, table, self._ops.deepgemm_schedule(ctx, page_size, num_sms)

    def topk(self, logits: torch.Tensor, topk: int, req_to_token: torch.Tensor,
             token_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.choice.topk == "triton":  # the Triton select or torch.topk, chosen per shape inside the op
            return self._ops.topk_slots(logits, topk, req_to_token, token_rows)
        return self._torch_topk(logits, topk, req_to_token, token_rows)

    def sparse_mla(self, q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
                   v_dim: int) -> torch.Tensor:
        impl = self.choice.sparse_mla
        if impl == "torch":
            return ref.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)
        why = sparse_mla_mod.triton_unsupported(q.shape[1], q.shape[2], v_dim, q.dtype)
        if why is not None:
            _log_fallback(f"DSA sparse MLA: torch reference ({why})")
        elif impl == "flashmla":  # FlashMLA or Triton per shape, and the fallback, all inside the opaque op
            return self._ops.flashmla_sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)
        # The op runs the reference itself for shapes Triton cannot take: opaque, so compiled layers do not
        # trace its loop.
        return self._ops.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)

    def kv_move_buffers(self, mla_buffer: torch.Tensor, index_buffer: torch.Tensor | None, src: torch.Tensor,
                        dst: torch.Tensor, page_size: int, index_head_dim: int) -> None:
        """Every layer of both whole-model buffers (KVCache.mla_buffer / index_buffer) in one launch."""
        if self.choice.kv_move == "torch":
            index_layers = [] if index_buffer is None else list(index_buffer.unbind(0))
            ref.kv_move(list(mla_buffer.unbind(0)), index_layers, src, dst, page_size, index_head_dim)
            return
        self._ops.kv_move(mla_buffer, index_buffer, src, dst, page_size, index_head_dim)


_fallbacks_logged: set[str] = set()


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _log_fallback(msg: str) -> None:
    # Not while torch.compile traces: the graph would guard on this set and recompile once it grows. The
    # same fallback is logged by the eager calls (prefill, or the step functions without compile).
    if torch.compiler.is_compiling():
        return
    if msg not in _fallbacks_logged:
        _fallbacks_logged.add(msg)
        logger.warning(msg)


def ops_for(choice: KernelChoice) -> DSAOps:
    return DSAOps(choice)
