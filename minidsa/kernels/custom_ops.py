"""The DSA kernels as torch custom ops (`torch.ops.minidsa.*`), opaque to torch.compile.

Each op has a fake (meta) implementation giving output shapes, so Dynamo
traces a model that calls them without looking inside the Triton launches.
Registered once, on import (torch.library.custom_op: torch >= 2.4; used on
2.11 and 2.13).

Which op serves each call site was chosen once per engine (attention/select.py, bound by
attention/backend.py and the model's layers); what an op needs of that choice arrives as plain
arguments (`use_deep_gemm`, `own_schedule`, `sm_major`). Inside, an op picks per shape from pure
functions of the concrete sizes (compiled graphs get no guards), and serves a shape its kernel
cannot take, or a call an optional library fails, another way: for that call, logged once.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from minidsa.kernels import deepgemm, deepgemm_step, deepgemm_warmup, flashmla, fp8_gemm as fp8_gemm_mod
from minidsa.kernels import fused_moe as fused_moe_mod
from minidsa.kernels import indexer
from minidsa.kernels import kv_move as kv_move_mod, log_once, mla_store, reference, sparse_mla as sparse_mla_mod
from minidsa.kernels import norm_quant as norm_quant_mod, router as router_mod, topk as topk_mod
from minidsa.kernels import allreduce as allreduce_mod, gemv, mla_absorb, swiglu_quant as swiglu_quant_mod
from minidsa.kernels.optional_lib import LibraryCallFailed

logger = logging.getLogger(__name__)


def _warn_once(msg: str) -> None:
    log_once(logger, logging.WARNING, msg)


def _error_once(msg: str) -> None:
    log_once(logger, logging.ERROR, msg)


@torch.library.custom_op("minidsa::norm_rope_store_index_k", mutates_args=("index_k",))
def norm_rope_store_index_k(index_k: Tensor, loc: Tensor, k: Tensor, norm_weight: Tensor, norm_bias: Tensor,
                            eps: float, cos: Tensor, sin: Tensor, interleaved: bool, page_size: int) -> None:
    """The indexer key finished and stored in one launch (`reference.norm_rope_store_index_k`), into either cache
    layout. Opaque, so inductor never indexes the cache itself: it would pick 32-bit indexing on a small cache (the
    activation profile's scratch one) and guard on that size, compiling the layer again for the engine's cache."""
    indexer.norm_rope_store_index_k(index_k, loc, k, norm_weight, norm_bias, eps, cos, sin, interleaved, page_size)


@norm_rope_store_index_k.register_fake
def _(index_k, loc, k, norm_weight, norm_bias, eps, cos, sin, interleaved, page_size):
    return None  # it only writes the cache


@torch.library.custom_op("minidsa::quant_index_q", mutates_args=())
def quant_index_q(q: Tensor, weights: Tensor, hadamard: Tensor, cos: Optional[Tensor] = None,
                  sin: Optional[Tensor] = None, rope_interleave: bool = False) -> tuple[Tensor, Tensor]:
    """Indexer queries for the fp8 cache in one Triton launch, their rope included: (e4m3 q, weights * q's
    scales), the contract of `reference.quant_index_q`, which serves a head dim the kernel cannot take
    (`indexer.quant_unsupported`)."""
    why_not = indexer.quant_unsupported(q.shape[2])
    if why_not is not None:
        _warn_once(f"DSA indexer query quantisation: torch reference ({why_not})")
        q8, scaled_weights = reference.quant_index_q(q, weights, hadamard, cos, sin, rope_interleave)
        return q8, scaled_weights.float()
    return indexer.quant_index_q(q, weights, hadamard, cos, sin, rope_interleave)


@quant_index_q.register_fake
def _(q, weights, hadamard, cos=None, sin=None, rope_interleave=False):
    return q.new_empty(q.shape, dtype=torch.float8_e4m3fn), q.new_empty(q.shape[:2], dtype=torch.float32)


def _one_request_extend(q: Tensor, tree_mask: Optional[Tensor], num_requests: int) -> bool:
    """Several tokens of one request, causal: DeepGEMM's ragged (prefill) kernel over its gathered keys serves."""
    return num_requests == 1 and tree_mask is None and q.shape[0] > 1


@torch.library.custom_op("minidsa::index_logits", mutates_args=())
def index_logits(
    q: Tensor, weights: Tensor, index_k: Tensor, page_size: int, req_to_token: Tensor, token_rows: Tensor,
    kv_lens: Tensor, max_kv_len: int, tree_mask: Optional[Tensor] = None, num_requests: int = 0,
) -> Tensor:
    """Triton paged indexer logits; `num_requests` = how many requests the tokens come from (0 = unknown). The
    reference for shapes the kernel cannot take (`indexer.triton_unsupported`)."""
    why_not = indexer.triton_unsupported(q.shape[1], q.shape[2])
    if why_not is not None:
        _warn_once(f"DSA indexer: torch reference ({why_not})")
        return reference.index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len,
                                      tree_mask)
    return indexer.index_logits(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len,
                                tree_mask, num_requests)


@index_logits.register_fake
def _(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len, tree_mask=None,
      num_requests=0):
    return q.new_empty(q.shape[0], max_kv_len, dtype=torch.float32)


@torch.library.custom_op("minidsa::deepgemm_step_inputs", mutates_args=())
def deepgemm_step_inputs(req_to_token: Tensor, req_pool_indices: Tensor, token_req: Tensor, kv_lens: Tensor,
                         tree_width: int, max_kv_len: int, page_size: int,
                         num_sms: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """This step's (token rows, context lengths, block table, schedule) for DeepGEMM's paged kernel in one Triton
    launch (kernels/deepgemm_step.py, `deepgemm_step.step_inputs_reference`): one per forward, every layer uses
    them."""
    return deepgemm_step.step_inputs(req_to_token, req_pool_indices, token_req, kv_lens, tree_width, max_kv_len,
                                     page_size, num_sms)


@deepgemm_step_inputs.register_fake
def _(req_to_token, req_pool_indices, token_req, kv_lens, tree_width, max_kv_len, page_size, num_sms):
    t = token_req.shape[0]
    return (token_req.new_empty(t, dtype=torch.int64), token_req.new_empty(t, 1, dtype=torch.int32),
            token_req.new_empty(t, -(-max_kv_len // page_size), dtype=torch.int32),
            token_req.new_empty(num_sms + 1, 2, dtype=torch.int32))


@torch.library.custom_op("minidsa::deepgemm_index_logits", mutates_args=())
def deepgemm_index_logits(
    q: Tensor, weights: Tensor, index_k: Tensor, page_size: int, req_to_token: Tensor, token_rows: Tensor,
    kv_lens: Tensor, max_kv_len: int, sm_major: int, own_schedule: bool, tree_mask: Optional[Tensor] = None,
    num_requests: int = 0, context_lens: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
    schedule: Optional[Tensor] = None,
) -> Tensor:
    """Indexer logits where DeepGEMM was chosen at start-up: per shape (concrete here, so compiled graphs get no
    guards) DeepGEMM's paged or ragged kernel where measured faster, else Triton; Triton too for a shape DeepGEMM
    cannot take on an SM`sm_major`x GPU, and for a call it fails. Always DeepGEMM's paged output layout
    (`deepgemm.paged_logits_buffer`). (context_lens, block_table, schedule): the step's metadata, made once per
    forward (`DSABackend.index_metadata`); no schedule: the build's metadata kernel makes it per call (where
    `own_schedule` is False, the start-up check found `deepgemm.paged_schedule` different from it)."""
    args = (q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len)
    num_tokens = q.shape[0]
    out = None
    if num_tokens > 0 and max_kv_len > 0:
        ragged = _one_request_extend(q, tree_mask, num_requests)
        why_not = deepgemm.paged_supported(sm_major, q.shape[1], q.shape[2], page_size, index_k.dtype == torch.uint8)
        if why_not is not None:
            _warn_once(f"DSA indexer: Triton kernels serve this shape (DeepGEMM cannot: {why_not})")
        elif deepgemm.deepgemm_wins(num_tokens, max_kv_len, ragged):
            try:
                if ragged:  # its own row stride: into the layout this op returns (prefill only)
                    out = deepgemm.paged_logits_buffer(num_tokens, max_kv_len, q.device).copy_(
                        deepgemm.extend_index_logits(deepgemm.library(), *args))
                else:
                    meta = None if context_lens is None else (context_lens, block_table, schedule)
                    out = deepgemm.paged_index_logits(deepgemm.library(), *args, tree_mask, meta, own_schedule)
            except LibraryCallFailed as e:
                _error_once(f"DeepGEMM {e}; the Triton indexer kernels serve each call it fails")
    if out is None:
        out = indexer.index_logits(*args, tree_mask, num_requests,
                                   out=deepgemm.paged_logits_buffer(num_tokens, max_kv_len, q.device))
    return out


@deepgemm_index_logits.register_fake
def _(q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len, sm_major, own_schedule,
      tree_mask=None, num_requests=0, context_lens=None, block_table=None, schedule=None):
    stride = (max_kv_len + deepgemm.LOGITS_ALIGN - 1) // deepgemm.LOGITS_ALIGN * deepgemm.LOGITS_ALIGN
    return q.new_empty_strided((q.shape[0], max_kv_len), (stride, 1), dtype=torch.float32)


@torch.library.custom_op("minidsa::topk_slots", mutates_args=())
def topk_slots(logits: Tensor, topk: int, req_to_token: Tensor, token_rows: Tensor) -> tuple[Tensor, Tensor]:
    # The Triton select or torch.topk, picked here on the concrete shape (no guards in compiled graphs).
    return topk_mod.fastest_topk_slots(logits, topk, req_to_token, token_rows)


@topk_slots.register_fake
def _(logits, topk, req_to_token, token_rows):
    shape = (logits.shape[0], topk)
    return logits.new_empty(shape, dtype=torch.int32), logits.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op("minidsa::norm_rope_store_mla", mutates_args=("cache",))
def norm_rope_store_mla(cache: Tensor, loc: Tensor, kv: Tensor, norm_weight: Tensor, eps: float, cos: Tensor,
                        sin: Tensor) -> None:
    """The MLA key finished and stored in one launch (`reference.norm_rope_store_mla`, kernels/mla_store.py), into
    the FP8 layout or a model-dtype cache. Opaque for the reason `norm_rope_store_index_k` gives."""
    mla_store.norm_rope_store_mla(cache, loc, kv, norm_weight, eps, cos, sin)


@norm_rope_store_mla.register_fake
def _(cache, loc, kv, norm_weight, eps, cos, sin):
    return None  # it only writes the cache


@torch.library.custom_op("minidsa::sparse_mla", mutates_args=())
def sparse_mla(q: Tensor, kv_cache: Tensor, topk_slots: Tensor, sm_scale: float, v_dim: int) -> Tensor:
    """The Triton kernel, or the reference for shapes it cannot take (`sparse_mla.triton_unsupported`): chosen
    here, inside the opaque op, so a compiled layer never traces the reference's per-query-block loop (which
    would guard on the token count and compile again for every 256 more tokens)."""
    why_not = sparse_mla_mod.triton_unsupported(q.shape[1], q.shape[2], v_dim, q.dtype)
    if why_not is not None:
        _warn_once(f"DSA sparse MLA: torch reference ({why_not})")
        return reference.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)
    return sparse_mla_mod.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)


@sparse_mla.register_fake
def _(q, kv_cache, topk_slots, sm_scale, v_dim):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


@torch.library.custom_op("minidsa::flashmla_sparse_mla", mutates_args=())
def flashmla_sparse_mla(q: Tensor, kv_cache: Tensor, topk_slots: Tensor, sm_scale: float, v_dim: int) -> Tensor:
    """Sparse MLA where FlashMLA was chosen at start-up: its FP8 sparse decode (FP8 cache) or sparse prefill
    (bf16 cache, from one wave of its CTAs) on the concrete shape, else the Triton kernel; Triton too when
    FlashMLA cannot take the shape (heads per rank, dims, dtype, top-k), and for a call it fails (the reference
    for shapes neither takes)."""
    why_not = sparse_mla_mod.triton_unsupported(q.shape[1], q.shape[2], v_dim, q.dtype)
    if why_not is not None:
        _warn_once(f"DSA sparse MLA: torch reference ({why_not})")
        return reference.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)
    why_not = flashmla.unsupported(q, kv_cache, topk_slots.shape[1], v_dim)
    if why_not is not None:
        _warn_once(f"DSA sparse MLA: Triton kernel serves this shape (FlashMLA cannot: {why_not})")
    elif flashmla.flashmla_wins(q.shape[0], q.shape[1], kv_cache.dtype == torch.uint8, q.device):
        try:
            return flashmla.sparse_mla(flashmla.library(), q, kv_cache, topk_slots, sm_scale, v_dim)
        except LibraryCallFailed as e:
            _error_once(f"FlashMLA {e}; the Triton sparse MLA kernel serves each call it fails")
    return sparse_mla_mod.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)


@flashmla_sparse_mla.register_fake
def _(q, kv_cache, topk_slots, sm_scale, v_dim):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


@torch.library.custom_op("minidsa::kv_move", mutates_args=("mla_buffer", "index_buffer"))
def kv_move(
    mla_buffer: Tensor, index_buffer: Optional[Tensor], src: Tensor, dst: Tensor, page_size: int,
    index_head_dim: int,
) -> None:
    kv_move_mod.kv_move(mla_buffer, index_buffer, src, dst, page_size, index_head_dim)


def _act(x_q: Optional[Tensor], x_scale: Optional[Tensor]) -> Optional[tuple[Tensor, Tensor]]:
    return None if x_q is None or x_scale is None else (x_q, x_scale)


@torch.library.custom_op("minidsa::fused_moe", mutates_args=())
def fused_moe(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
    gate_up_scale_inv: Optional[Tensor] = None, down_scale_inv: Optional[Tensor] = None, use_deep_gemm: bool = False,
    has_skipped: bool = False, x_q: Optional[Tensor] = None, x_scale: Optional[Tensor] = None,
    addend: Optional[Tensor] = None,
) -> Tensor:
    """Routed experts for any token count (minidsa.kernels.fused_moe), plus `addend` [T, H] when given (the
    shared experts' output, added to the routed rows' fp32 sum before its one rounding, in the launch that sums
    them, on every path): the torch reference on CPU.

    With `use_deep_gemm` (`KernelChoice.moe_gemm`, given to the layer at model build), FP8 experts at sizes where
    DeepGEMM's contiguous grouped GEMMs are measured faster (`deepgemm.moe_contiguous_wins`) run through them;
    every other call, and one they do not take or fail, runs the Triton fused MoE. `has_skipped`: topk_ids may hold
    `fused_moe.SKIP` (-1: an expert of another rank); those pairs add nothing (the reference always allows it).
    (x_q, x_scale): x already quantised per token per 128 channels (the norm before it, `rmsnorm_quant`), which the
    Triton fused MoE's first GEMM reads instead of quantising x; the reference and DeepGEMM quantise x themselves
    (the same values).
    """
    return fused_moe_mod.fused_moe_reference(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv,
                                             down_scale_inv, addend)


@fused_moe.register_kernel("cuda")
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv=None, down_scale_inv=None,
      use_deep_gemm=False, has_skipped=False, x_q=None, x_scale=None, addend=None):
    # Tiles (and DeepGEMM or Triton) are picked inside on the concrete token count: compiled graphs see one
    # opaque op, no guards.
    if use_deep_gemm and deepgemm.moe_contiguous_wins(*topk_ids.shape, gate_up_proj.shape[0]):
        try:
            out = deepgemm.moe_contiguous(deepgemm.library(), x, topk_ids, topk_weights, gate_up_proj, down_proj,
                                          gate_up_scale_inv, down_scale_inv, addend=addend,
                                          building=deepgemm_warmup.building())
        except LibraryCallFailed as e:
            _error_once(f"DeepGEMM {e}; the Triton fused MoE serves each call it fails")
        else:
            if out is not None:
                return out
    return fused_moe_mod.fused_moe_triton(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv,
                                          down_scale_inv, has_skipped=has_skipped, act=_act(x_q, x_scale),
                                          addend=addend)


@fused_moe.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_scale_inv=None, down_scale_inv=None,
      use_deep_gemm=False, has_skipped=False, x_q=None, x_scale=None, addend=None):
    return x.new_empty(x.shape[0], gate_up_proj.shape[2])


@torch.library.custom_op("minidsa::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, use_deep_gemm: bool, x_q: Optional[Tensor] = None,
               x_scale: Optional[Tensor] = None) -> Tensor:
    """x [M, K] @ e4m3 weight [N, K]^T with 128x128 block scales, w8a8 (layers.linear). Tiles chosen by M inside.

    With `use_deep_gemm` (`KernelChoice.fp8_gemm`, given to the layers at model build), DeepGEMM's fp8_gemm_nt
    where it is measured faster (`deepgemm.fp8_gemm_wins`); a call it does not take, or fails, runs the Triton
    kernel. (x_q, x_scale): x already quantised per token per 128 channels (the norm before it, `rmsnorm_quant`),
    read where the GEMM would quantise x in a launch of its own (the Triton GEMM above decode sizes, DeepGEMM).
    During the activation profile a class DeepGEMM's start-up pool is still building runs on the Triton GEMM
    (`deepgemm_warmup.building()`; None while serving). Which weight shapes DeepGEMM does not take, and why, the
    start-up warm-up says in one INFO line (`deepgemm_warmup.gemm_summary`): nothing is logged per shape here
    (a DeepGEMM failure once, an input dtype it does not take once per dtype).
    """
    act = _act(x_q, x_scale)
    if use_deep_gemm and deepgemm.fp8_gemm_wins(x.shape[0], weight.shape[0], weight.shape[1]):
        building = deepgemm_warmup.building()
        if building is None or not building.defer((deepgemm.gemm_rows(x.shape[0]), *weight.shape)):
            try:
                out = deepgemm.fp8_gemm_nt(deepgemm.library(), x, weight, scale_inv, act)
            except LibraryCallFailed as e:
                _error_once(f"DeepGEMM {e}; the Triton FP8 GEMM serves each call it fails")
            else:
                if out is not None:
                    return out
                if x.dtype != torch.bfloat16:  # one line per dtype, not per shape
                    _warn_once(f"FP8 linear: Triton GEMM serves {x.dtype} inputs (DeepGEMM's fp8_gemm_nt: bfloat16)")
                else:  # a weight shape the start-up line already named (`deepgemm.gemm_unsupported`)
                    log_once(logger, logging.DEBUG, f"FP8 linear: Triton GEMM serves {tuple(x.shape)} x "
                             f"{tuple(weight.shape)} ({deepgemm.gemm_unsupported(*weight.shape) or 'no rows'})")
    return fp8_gemm_mod.w8a8_block_gemm(x, weight, scale_inv, act=act)


@fp8_linear.register_fake
def _(x, weight, scale_inv, use_deep_gemm, x_q=None, x_scale=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("minidsa::rmsnorm_quant", mutates_args=())
def rmsnorm_quant(x: Tensor, weight: Tensor, eps: float, deep_gemm_layout: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """RMSNorm of x and its FP8 per-token-group quantisation in one Triton launch (kernels/norm_quant.py):
    (normed, e4m3, fp32 scales in `fp8_gemm.act_buffers`' layout), `reference.rmsnorm_quant`."""
    _, normed, q, scales = norm_quant_mod.rmsnorm_quant(x, weight, eps, deep_gemm_layout=deep_gemm_layout)
    return normed, q, scales


def _norm_quant_fakes(x: Tensor, weight: Tensor, deep_gemm_layout: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(normed, e4m3, fp32 scales) as `norm_quant.rmsnorm_quant` makes them, for the fake kernels below."""
    m, k = x.shape
    return (x.new_empty(m, k, dtype=torch.promote_types(weight.dtype, x.dtype)),
            *fp8_gemm_mod.act_buffers(m, k, x.device, deep_gemm_layout))


@rmsnorm_quant.register_fake
def _(x, weight, eps, deep_gemm_layout=False):
    return _norm_quant_fakes(x, weight, deep_gemm_layout)


@torch.library.custom_op("minidsa::add_rmsnorm_quant", mutates_args=())
def add_rmsnorm_quant(x: Tensor, residual: Tensor, weight: Tensor, eps: float, deep_gemm_layout: bool = False
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h = x + residual, RMSNorm of h and its FP8 per-token-group quantisation in one Triton launch:
    (h, normed, e4m3, fp32 scales in `fp8_gemm.act_buffers`' layout), `reference.rmsnorm_quant` with a residual."""
    return norm_quant_mod.rmsnorm_quant(x, weight, eps, residual, deep_gemm_layout)


@add_rmsnorm_quant.register_fake
def _(x, residual, weight, eps, deep_gemm_layout=False):
    return (x.new_empty(x.shape), *_norm_quant_fakes(x, weight, deep_gemm_layout))


@torch.library.custom_op("minidsa::add_rmsnorm", mutates_args=())
def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """h = x + residual and RMSNorm of h in one Triton launch, for a norm no FP8 linear reads: (h, normed),
    `add_rmsnorm_quant`'s first two outputs (kernels/norm_quant.py `add_rmsnorm`)."""
    return norm_quant_mod.add_rmsnorm(x, residual, weight, eps)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op("minidsa::rmsnorm_rows", mutates_args=())
def rmsnorm_rows(x: Tensor, weight: Tensor, eps: float, rows: Optional[Tensor] = None) -> Tensor:
    """RMSNorm of x (or of its rows `rows`, gathered in the same launch): kernels/norm_quant.py,
    `norm_quant.rmsnorm_rows_reference`."""
    return norm_quant_mod.rmsnorm_rows(x, weight, eps, rows)


@rmsnorm_rows.register_fake
def _(x, weight, eps, rows=None):
    return x.new_empty(x.shape[0] if rows is None else rows.shape[0], x.shape[1],
                       dtype=torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op("minidsa::route", mutates_args=())
def route(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int, norm: bool,
          scaling: float) -> tuple[Tensor, Tensor]:
    """The MoE router's selection in one Triton launch (kernels/router.py), where the engine chose it."""
    return router_mod.route(logits, bias, top_k, n_group, topk_group, norm, scaling)


@route.register_fake
def _(logits, bias, top_k, n_group, topk_group, norm, scaling):
    return (logits.new_empty(logits.shape[0], top_k, dtype=torch.int64),
            logits.new_empty(logits.shape[0], top_k, dtype=torch.float32))


def _absorb_by_kernel(num_tokens: int) -> bool:
    """Decode sizes: the weight-streaming Triton launch; above them (prefill, verify) cuBLAS's bmm is right there."""
    return num_tokens <= mla_absorb.MAX_TOKENS


@torch.library.custom_op("minidsa::absorb_q", mutates_args=())
def absorb_q(q_nope: Tensor, q_rope: Tensor, w_uk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """MLA's absorbed query [T, H, L + rope], q_rope rotated (`mla_absorb.absorb_q_reference`), where the engine
    chose the kernel: one Triton launch at decode sizes, the reference above them (picked here, on the concrete
    token count)."""
    if _absorb_by_kernel(q_nope.shape[0]):
        return mla_absorb.absorb_q(q_nope, q_rope, w_uk, cos, sin)
    return mla_absorb.absorb_q_reference(q_nope, q_rope, w_uk, cos, sin)


@absorb_q.register_fake
def _(q_nope, q_rope, w_uk, cos, sin):
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uk.shape[2] + q_rope.shape[2])


@torch.library.custom_op("minidsa::absorb_o", mutates_args=())
def absorb_o(o_latent: Tensor, w_uv: Tensor) -> Tensor:
    """MLA's per-head output [T, H * v] from the latent one (`mla_absorb.absorb_o_reference`), as `absorb_q` picks."""
    if _absorb_by_kernel(o_latent.shape[0]):
        return mla_absorb.absorb_o(o_latent, w_uv)
    return mla_absorb.absorb_o_reference(o_latent, w_uv)


@absorb_o.register_fake
def _(o_latent, w_uv):
    return o_latent.new_empty(o_latent.shape[0], o_latent.shape[1] * w_uv.shape[1])


@torch.library.custom_op("minidsa::absorb_o_quant", mutates_args=())
def absorb_o_quant(o_latent: Tensor, w_uv: Tensor, deep_gemm_layout: bool) -> tuple[Tensor, Tensor, Tensor]:
    """`absorb_o` and o_proj's FP8 input quantised from it (`mla_absorb.absorb_o_quant_reference`: e4m3 + fp32
    scales in `fp8_gemm.act_buffers`' layout): at decode sizes in the same launch, above them the reference bmm and
    one quantisation launch (the one o_proj's GEMM would make there)."""
    if _absorb_by_kernel(o_latent.shape[0]):
        return mla_absorb.absorb_o_quant(o_latent, w_uv, deep_gemm_layout)
    o = mla_absorb.absorb_o_reference(o_latent, w_uv)
    q, scales = fp8_gemm_mod.act_buffers(o.shape[0], o.shape[1], o.device, deep_gemm_layout)
    if o.shape[0]:
        fp8_gemm_mod.quant_act(o, out=(q, scales))
    return o, q, scales


@absorb_o_quant.register_fake
def _(o_latent, w_uv, deep_gemm_layout):
    num_tokens, width = o_latent.shape[0], o_latent.shape[1] * w_uv.shape[1]
    return (o_latent.new_empty(num_tokens, width),
            *fp8_gemm_mod.act_buffers(num_tokens, width, o_latent.device, deep_gemm_layout))


@torch.library.custom_op("minidsa::swiglu_quant", mutates_args=())
def swiglu_quant(gate: Tensor, up: Tensor, deep_gemm_layout: bool) -> tuple[Tensor, Tensor, Tensor]:
    """F.silu(gate) * up and its FP8 quantisation for the down projection in one Triton launch
    (kernels/swiglu_quant.py): (product, e4m3, fp32 scales in `fp8_gemm.act_buffers`' layout)."""
    return swiglu_quant_mod.swiglu_quant(gate, up, deep_gemm_layout)


@swiglu_quant.register_fake
def _(gate, up, deep_gemm_layout):
    return (gate.new_empty(gate.shape),
            *fp8_gemm_mod.act_buffers(gate.shape[0], gate.shape[1], gate.device, deep_gemm_layout))


@torch.library.custom_op("minidsa::fp32_gemv", mutates_args=())
def fp32_gemv(x: Tensor, weight: Tensor, scale: float) -> Tensor:
    """(x @ weight^T) * scale in fp32 (`gemv.fp32_gemv_reference`: the indexer's head weights, the router's gate),
    where the engine chose the kernel: one Triton launch at decode sizes, cuBLAS above them (picked here, on the
    concrete token count)."""
    if x.shape[0] <= gemv.MAX_TOKENS:
        return gemv.fp32_gemv(x, weight, scale)
    return gemv.fp32_gemv_reference(x, weight, scale)


@fp32_gemv.register_fake
def _(x, weight, scale):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("minidsa::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group_name: str, buffer_ptrs: Tensor, signal_ptrs: Tensor, rank: int, world: int,
               capacity: int, max_bytes: int) -> Tensor:
    """Sum of x over the ranks of the process group `group_name`: the one-shot peer-to-peer kernel
    (kernels/allreduce.py, over the buffers of `allreduce.PeerBuffers`) where it serves this size (`allreduce.serves`:
    up to `max_bytes`, picked here on the concrete size, so compiled graphs get no guards), NCCL (torch's functional
    all-reduce) above it. Opaque: Dynamo traces one op whatever the size."""
    if allreduce_mod.serves(x.numel() * x.element_size(), x.dtype, x.is_contiguous(), max_bytes):
        return allreduce_mod.one_shot_all_reduce(x, buffer_ptrs, signal_ptrs, rank, world, capacity)
    out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


@all_reduce.register_fake
def _(x, group_name, buffer_ptrs, signal_ptrs, rank, world, capacity, max_bytes):
    return x.new_empty(x.shape)
