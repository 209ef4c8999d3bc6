"""Which implementation serves each DSA op: decided once, at engine start-up, and logged.

`choose_kernels(device, kernel_backend, use_deep_gemm, use_flash_mla)` -> `KernelChoice`:
- "torch" (the references in kernels/reference.py) off CUDA, or when asked for;
- Triton for store_index_k, store_mla, index_logits, sparse_mla and kv_move on CUDA (or on
  CPU under TRITON_INTERPRET=1, for tests);
- index_logits "deepgemm" when `deep_gemm` imports, has every function we call
  and the GPU is SM90 / SM100 (`deepgemm.probe`, run here and nowhere else);
  the reason is logged either way. Per call, inside the opaque custom op, the
  faster of DeepGEMM and Triton for that shape is taken from measurements
  (`deepgemm.deepgemm_wins`).
- sparse_mla "flashmla" when `flash_mla` imports, has every function we call and the
  GPU is SM90 (`flashmla.probe`, run here and nowhere else); the reason is logged
  either way. Per call, inside the opaque custom op, FlashMLA serves the shapes it
  takes (64 / 128 heads per rank, 512 + 64 dims, bf16 queries) where it is faster,
  Triton the rest (`flashmla.unsupported`, `flashmla.flashmla_wins`).
- sample: the sampler's exponential race, one Triton pass over the logits
  (kernels/sampling.py) wherever Triton runs; MINIDSA_SAMPLE=torch keeps the
  torch race (A/B measurements).
- topk: TOPK_IMPL, or MINIDSA_TOPK (`torch` | `triton`); with "triton" the op
  picks the Triton select or torch.topk per shape (`topk.triton_wins`).

Compiled code sees the choice as constants: nothing here is called from a traced step.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

IMPLS = ("torch", "triton", "deepgemm", "flashmla")
TOPK_IMPL = "triton"


@dataclass(frozen=True)
class KernelChoice:
    """Which implementation serves each DSA op (`torch`, `triton`, `deepgemm` or `flashmla`)."""

    store_index_k: str = "torch"
    index_logits: str = "torch"
    topk: str = "torch"
    sparse_mla: str = "torch"
    kv_move: str = "torch"
    store_mla: str = "torch"  # the FP8 MLA layout's quantising store (a model-dtype cache is a plain index_put)
    sample: str = "torch"  # the sampler's exponential race (sampling.race_for)

    def __post_init__(self):
        for name, impl in self.__dict__.items():
            if impl not in IMPLS:
                raise ValueError(f"KernelChoice.{name} = {impl!r}, want one of {IMPLS}")

    @property
    def uses_kernels(self) -> bool:
        return self != KernelChoice()

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.__dict__.items())


def triton_usable(device: torch.device | str) -> tuple[bool, str]:
    """(usable, why): Triton runs on CUDA, or on CPU when it was imported as its interpreter."""
    device = torch.device(device)
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


def _optional_library(device: torch.device, enabled: bool, module: str, op: str, library: str, served: str,
                      flag: str) -> bool:
    """Does an optional library (`minidsa.kernels.<module>`, probed here and only here) serve `op`? Logs why."""
    if not enabled:
        logger.info("%s: Triton (%s disabled by %s=False)", op, library, flag)
        return False
    status = importlib.import_module(f"minidsa.kernels.{module}").probe(device)
    logger.info("%s: %s (%s)", op, served if status.available else "Triton", status.reason)
    return status.available


@dataclass(frozen=True)
class IndexerShape:
    """What the engine's indexer runs: DeepGEMM's kernels take only some of these (`deepgemm.paged_supported`)."""

    num_heads: int
    head_dim: int
    page_size: int
    fp8_cache: bool


def choose(device: torch.device | str, use_deep_gemm: bool = True, use_flash_mla: bool = True,
           indexer: IndexerShape | None = None) -> KernelChoice:
    """The Triton / DeepGEMM / FlashMLA choice on `device` (the torch references where Triton cannot run)."""
    device = torch.device(device)
    ok, why = triton_usable(device)
    if not ok:
        logger.warning("DSA kernels: torch reference (%s)", why)
        return KernelChoice()
    index = "deepgemm" if _optional_library(device, use_deep_gemm, "deepgemm", "DSA indexer logits", "DeepGEMM",
                                            "DeepGEMM where measured faster, else Triton", "use_deep_gemm") else "triton"
    if index == "deepgemm" and indexer is not None:
        dg = _deepgemm()
        why_not = dg.paged_supported(dg.probe(device), indexer.num_heads, indexer.head_dim, indexer.page_size,
                                     indexer.fp8_cache)
        if why_not is not None:  # decided here, once: no step asks DeepGEMM for what it cannot take
            logger.info("DSA indexer logits: Triton (DeepGEMM cannot serve this engine: %s)", why_not)
            index = "triton"
    sparse_mla = "flashmla" if _optional_library(device, use_flash_mla, "flashmla", "DSA sparse MLA", "FlashMLA",
                                                 "FlashMLA where it takes the shape, else Triton", "use_flash_mla") \
        else "triton"
    topk = os.environ.get("MINIDSA_TOPK", TOPK_IMPL)
    if topk not in ("torch", "triton"):
        raise ValueError(f"MINIDSA_TOPK must be 'torch' or 'triton', got {topk!r}")
    sample = os.environ.get("MINIDSA_SAMPLE", "triton")  # A/B runs: the torch race on the GPU
    if sample not in ("torch", "triton"):
        raise ValueError(f"MINIDSA_SAMPLE must be 'torch' or 'triton', got {sample!r}")
    return KernelChoice(store_index_k="triton", index_logits=index, topk=topk, sparse_mla=sparse_mla,
                        kv_move="triton", store_mla="triton", sample=sample)


def choose_kernels(device: torch.device | str, kernel_backend: str = "auto", use_deep_gemm: bool = True,
                   use_flash_mla: bool = True, indexer: IndexerShape | None = None) -> KernelChoice:
    """Decide once, at start-up, which kernels run; logs the decision."""
    device = torch.device(device)
    if kernel_backend == "torch" or (kernel_backend == "auto" and device.type != "cuda"):
        choice = KernelChoice()
    else:
        choice = choose(device, use_deep_gemm=use_deep_gemm, use_flash_mla=use_flash_mla, indexer=indexer)
    logger.info("DSA kernels: %s", choice.describe())
    return choice


def _deepgemm():
    from minidsa.kernels import deepgemm  # imports Triton: only when a GPU path is being chosen

    return deepgemm


def register_custom_ops() -> None:
    """Importing minidsa.kernels.custom_ops registers torch.ops.minidsa.* (an import for its side effect)."""
    importlib.import_module("minidsa.kernels.custom_ops")


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
        if forced == "deepgemm" and not _deepgemm().fp8_gemm_status(device).available:
            raise ValueError(f"MINIDSA_FP8_GEMM=deepgemm: {_deepgemm().fp8_gemm_status(device).reason}")
        logger.info("FP8 linear: %s (MINIDSA_FP8_GEMM)", forced)
        if forced != "torch":
            register_custom_ops()  # torch.ops.minidsa.fp8_linear
        return forced
    ok, why = triton_usable(device)
    if not ok:
        logger.warning("FP8 linear: torch reference (%s)", why)
        return "torch"
    if use_deep_gemm and device.type == "cuda":
        status = _deepgemm().fp8_gemm_status(device)
        logger.info("FP8 linear: %s (%s)", "DeepGEMM" if status.available else "Triton", status.reason)
    else:
        logger.info("FP8 linear: Triton")
    register_custom_ops()  # torch.ops.minidsa.fp8_linear

    if use_deep_gemm and device.type == "cuda" and status.available:
        return "deepgemm"
    return "triton"
