"""Which implementation serves each DSA op, decided once at start-up, and the ops object DSABackend calls.

`choose(device)` -> `KernelChoice` (logged by `attention.dsa.choose_kernels`):
- Triton serves store_index_k, index_logits, sparse_mla and kv_move on CUDA
  (or on CPU under TRITON_INTERPRET=1, for tests); otherwise everything is torch.
- index_logits is "deepgemm" when `deep_gemm` imports, has every function we
  call, and the GPU is SM90/SM100 (`deepgemm.probe`); the reason is logged.
- topk: TOPK_IMPL (set by measurement, see benchmarks/KERNELS.md), or the
  MINIDSA_TOPK environment variable (`torch` | `triton`). With "triton", the
  op picks the Triton select or torch.topk per shape (`topk.triton_wins`).

`ops_for(choice)` -> `DSAOps`, whose methods keep the reference functions'
signatures and call the custom ops (opaque to torch.compile).
"""

from __future__ import annotations

import logging
import os

import torch

from minidsa.attention.dsa import KernelChoice
from minidsa.kernels import deepgemm
from minidsa.kernels import reference as ref

logger = logging.getLogger(__name__)

TOPK_IMPL = "triton"
IMPLS = ("torch", "triton", "deepgemm")


def triton_usable(device: torch.device) -> tuple[bool, str]:
    """(usable, why): Triton runs on CUDA, or on CPU when it was imported as its interpreter."""
    try:
        from triton.runtime.jit import JITFunction

        from minidsa.kernels import indexer
    except Exception as e:
        return False, f"import triton failed: {type(e).__name__}: {e}"
    if device.type == "cuda":
        return torch.cuda.is_available(), "CUDA device" if torch.cuda.is_available() else "CUDA is not available"
    if not isinstance(indexer._paged_logits_kernel, JITFunction):
        return True, "Triton interpreter on CPU (TRITON_INTERPRET=1 was set before triton was imported)"
    return False, f"Triton needs a CUDA device (or TRITON_INTERPRET=1 before importing triton), got {device}"


def choose(device: torch.device | str, use_deep_gemm: bool = True) -> KernelChoice:
    device = torch.device(device)
    ok, why = triton_usable(device)
    if not ok:
        logger.warning("DSA kernels: torch reference (%s)", why)
        return KernelChoice()
    if use_deep_gemm:
        status = deepgemm.probe(device)
        index = "deepgemm" if status.available else "triton"
        logger.info("DSA indexer logits: %s (%s)", "DeepGEMM" if status.available else "Triton",
                    status.reason)
    else:
        index = "triton"
        logger.info("DSA indexer logits: Triton (DeepGEMM disabled by use_deep_gemm=False)")
    topk = os.environ.get("MINIDSA_TOPK", TOPK_IMPL)
    if topk not in ("torch", "triton"):
        raise ValueError(f"MINIDSA_TOPK must be 'torch' or 'triton', got {topk!r}")
    return KernelChoice(store_index_k="triton", index_logits=index, topk=topk, sparse_mla="triton",
                        kv_move="triton")


class DSAOps:
    """The DSA ops for one KernelChoice; same signatures as `minidsa.kernels.reference`."""

    def __init__(self, choice: KernelChoice):
        for name, impl in choice.__dict__.items():
            if impl not in IMPLS:
                raise ValueError(f"KernelChoice.{name} = {impl!r}, want one of {IMPLS}")
        from minidsa.kernels import custom_ops  # noqa: F401  (registers torch.ops.minidsa.*)
        from minidsa.kernels import topk as topk_mod

        self.choice = choice
        self._ops = torch.ops.minidsa
        self._torch_topk = topk_mod.torch_topk_slots

    def store_index_k(self, index_k: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
        if self.choice.store_index_k == "torch" or index_k.dtype != torch.uint8:
            ref.store_index_k(index_k, loc, k, page_size)
        else:
            self._ops.store_index_k(index_k, loc, k, page_size)

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
    ) -> torch.Tensor:
        """`num_requests`: how many requests the T tokens come from (0 = unknown). With DeepGEMM, one request's
        causal tokens (a prefill chunk) go to fp8_mqa_logits; in the Triton kernel, a few tokens per request
        (verify, draft-extend) share key tiles."""
        args = (q, weights, index_k, page_size, req_to_token, token_rows, kv_lens, max_kv_len, tree_mask)
        impl = self.choice.index_logits
        if impl == "deepgemm":
            why_not = self._deepgemm_unsupported(q, index_k, page_size)
            if why_not is None:
                return self._ops.deepgemm_index_logits(*args, num_requests)
            _log_fallback(f"DSA indexer: Triton kernels serve this call (DeepGEMM cannot: {why_not})")
            impl = "triton"
        if impl == "triton" and _pow2(q.shape[1]) and _pow2(q.shape[2]) and q.shape[2] >= 16:
            return self._ops.index_logits(*args, num_requests)
        if impl == "triton":
            _log_fallback(f"DSA indexer: torch reference ({q.shape[1]} heads x {q.shape[2]}: the Triton kernel "
                          "needs powers of two)")
        return ref.index_logits(*args)

    def _deepgemm_unsupported(self, q: torch.Tensor, index_k: torch.Tensor, page_size: int) -> str | None:
        # Recomputed per call, not cached here: compiled graphs would guard on a cache filled while tracing.
        # (probe's own cache was filled by `choose` at start-up.)
        status = deepgemm.probe(q.device)
        if not status.available:
            return status.reason
        return deepgemm.paged_supported(status, q.shape[1], q.shape[2], page_size, index_k.dtype == torch.uint8)

    def ragged_index_logits(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ks: torch.Tensor,
                            ke: torch.Tensor, key_scales: torch.Tensor | None = None) -> torch.Tensor:
        if self.choice.index_logits == "torch":
            if key_scales is not None:
                keys = keys.float() * key_scales.unsqueeze(1)
            return ref.ragged_index_logits(q, weights, keys, ks, ke)
        return self._ops.ragged_index_logits(q, weights, keys, ks, ke, key_scales)

    def topk(self, logits: torch.Tensor, topk: int, req_to_token: torch.Tensor,
             token_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.choice.topk == "triton":  # the Triton select or torch.topk, chosen per shape inside the op
            return self._ops.topk_slots(logits, topk, req_to_token, token_rows)
        return self._torch_topk(logits, topk, req_to_token, token_rows)

    def sparse_mla(self, q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
                   v_dim: int) -> torch.Tensor:
        rope = q.shape[2] - v_dim
        # fp32 is the parity / debug dtype: the kernel's tiles are sized for 2-byte inputs and a
        # [heads x 512] fp32 tile of real models overflows shared memory, so fp32 at that size runs the reference.
        too_big_fp32 = q.dtype == torch.float32 and q.shape[1] * q.shape[2] > 16384
        if self.choice.sparse_mla == "triton" and _pow2(v_dim) and _pow2(rope) and rope >= 16 and not too_big_fp32:
            return self._ops.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)
        if self.choice.sparse_mla == "triton":
            _log_fallback(f"DSA sparse MLA: torch reference (latent {v_dim} + rope {rope}, {q.dtype}, "
                          f"{q.shape[1]} heads: the Triton kernel needs powers of two, rope >= 16, and 2-byte "
                          "inputs at this size)")
        return ref.sparse_mla(q, kv_cache, topk_slots, sm_scale, v_dim)

    def kv_move(self, mla_caches: list[torch.Tensor], index_caches: list[torch.Tensor | None], src: torch.Tensor,
                dst: torch.Tensor, page_size: int, index_head_dim: int) -> None:
        """Per-layer lists (the reference signature): one launch per layer; prefer kv_move_buffers."""
        if self.choice.kv_move == "torch":
            ref.kv_move(mla_caches, index_caches, src, dst, page_size, index_head_dim)
            return
        for i, mla in enumerate(mla_caches):
            idx = index_caches[i] if i < len(index_caches) else None
            self._ops.kv_move(mla.unsqueeze(0), None if idx is None else idx.unsqueeze(0), src, dst, page_size,
                              index_head_dim)

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


def choose_fp8_gemm(device: torch.device | str, kernel_backend: str = "auto", use_deep_gemm: bool = True) -> str:
    """Which GEMM serves FP8 linear layers (`layers.linear.GEMMS`), decided once when the model is built.

    torch reference on CPU (or kernel_backend "torch"); on a GPU DeepGEMM's fp8_gemm_nt when it imports on
    SM90/SM100 (its calls fall back to Triton per shape), else the Triton w8a8 kernel. MINIDSA_FP8_GEMM
    (torch | triton | deepgemm) overrides, for measurements.
    """
    device = torch.device(device)
    if kernel_backend == "torch" or (kernel_backend == "auto" and device.type != "cuda"):
        return "torch"
    forced = os.environ.get("MINIDSA_FP8_GEMM")  # A/B runs: torch | triton | deepgemm
    if forced is not None:
        if forced not in ("torch", "triton", "deepgemm"):
            raise ValueError(f"MINIDSA_FP8_GEMM must be torch, triton or deepgemm, got {forced!r}")
        if forced == "deepgemm" and not deepgemm.fp8_gemm_status(device).available:
            raise ValueError(f"MINIDSA_FP8_GEMM=deepgemm: {deepgemm.fp8_gemm_status(device).reason}")
        logger.info("FP8 linear: %s (MINIDSA_FP8_GEMM)", forced)
        if forced != "torch":
            from minidsa.kernels import custom_ops  # noqa: F401  (registers torch.ops.minidsa.fp8_linear)
        return forced
    ok, why = triton_usable(device)
    if not ok:
        logger.warning("FP8 linear: torch reference (%s)", why)
        return "torch"
    if use_deep_gemm and device.type == "cuda":
        status = deepgemm.fp8_gemm_status(device)
        logger.info("FP8 linear: %s (%s)", "DeepGEMM" if status.available else "Triton", status.reason)
    else:
        logger.info("FP8 linear: Triton")
    from minidsa.kernels import custom_ops  # noqa: F401  (registers torch.ops.minidsa.fp8_linear)

    if use_deep_gemm and device.type == "cuda" and status.available:
        return "deepgemm"
    return "triton"
