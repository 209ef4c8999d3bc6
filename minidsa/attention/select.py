"""Which implementation serves each kernel of an engine: decided once, at start-up, one logged line per decision.

Two steps:
- `select_kernels(device, kernel_backend, use_deep_gemm, use_flash_mla, indexer, router, mla_heads)` ->
  `KernelChoice`, a frozen, picklable record of one implementation per kernel (tensor-parallel ranks receive it
  with the engine's config). It probes DeepGEMM and FlashMLA (import, GPU generation, every function called)
  and reads the environment overrides MINIDSA_TOPK, MINIDSA_SAMPLE and MINIDSA_FP8_GEMM, here and nowhere else.
- `load_libraries(choice, device)` -> `Libraries`: the handles of the optional libraries the choice names
  (`kernels.deepgemm.DeepGEMM`, `kernels.flashmla.FlashMLA`: the module, its status, DeepGEMM's checked
  schedule page sizes, the failures of start-up calls), made on each rank that serves with them.

What the choice says, per kernel:
- "torch": the references (kernels/reference.py), off CUDA by default, with kernel_backend="torch", or where
  Triton cannot run;
- "triton": the Triton kernels, on CUDA (or on CPU under TRITON_INTERPRET=1, for tests);
- index_logits "deepgemm": DeepGEMM's indexer kernels, when deep_gemm imports with every function we call on
  SM90 / SM100 and takes the engine's indexer shape (`deepgemm.paged_supported`); per call, inside the opaque
  op, the faster of DeepGEMM and Triton for the shape (`deepgemm.deepgemm_wins`);
- sparse_mla "flashmla": FlashMLA's sparse kernels, when flash_mla imports with every function we call on SM90
  and takes the engine's query heads per rank (`mla_heads`: 64 or 128, or fewer that divide 64, which it serves
  with the queries zero-padded to 64 heads, logged: `flashmla.padded_heads`); per call, inside the op, FlashMLA
  for the shapes it takes where faster, Triton the rest (`flashmla.unsupported`, `flashmla.flashmla_wins`);
- topk "triton": inside the op, the Triton radix select or torch.topk per shape (`topk.triton_wins`);
  MINIDSA_TOPK=torch keeps torch.topk (A/B measurements);
- sample: the sampler's exponential race, one Triton pass over the logits (kernels/sampling.py) wherever Triton
  runs; MINIDSA_SAMPLE=torch keeps the torch race;
- fp8_gemm (the FP8 linears, models/layers/linear.py): DeepGEMM's fp8_gemm_nt on a GPU where it imports on
  SM90 / SM100 (per call, where measured faster: `deepgemm.fp8_gemm_wins`), else the Triton w8a8 GEMM;
  MINIDSA_FP8_GEMM (torch | triton | deepgemm) overrides;
- moe_gemm (the routed experts' fused MoE op): "deepgemm" where the FP8 linears use DeepGEMM and its build has
  the contiguous grouped GEMM (per call, from `deepgemm.moe_contiguous_wins`), else what the op runs on the
  device: the Triton fused MoE on CUDA, the reference elsewhere;
- router (the MoE router's selection after its gate GEMM): one Triton launch (kernels/router.py) wherever Triton
  runs and the model's experts and groups are powers of two (`router.supported`), else the torch reference;
- norm_quant (an RMSNorm whose output FP8 linears read, with the residual add before it where there is one): the
  norm and the FP8 quantisation of its output in one Triton launch (kernels/norm_quant.py), which the GEMMs read
  where they would quantise in a launch of their own, wherever Triton runs and the FP8 linears are not the torch
  reference (which quantises for itself); else the torch norm (`models.deepseek_v32.set_norm_quant`). A decoder
  norm no FP8 linear reads then runs the same launch without the quantisation, its residual add inside
  (`add_rmsnorm`: inductor failed to compile that add + norm in a layer's graph on the GPU). The same
  choice has SwiGLU's product quantised for an FP8 down projection in the launch computing it
  (kernels/swiglu_quant.py, `models.deepseek_v32.set_swiglu_quant`);
- mla_absorb (MLA's per-head W_UK / W_UV products around the sparse attention): one weight-streaming Triton
  launch each at decode sizes (kernels/mla_absorb.py; above them the op runs cuBLAS's bmm) wherever Triton runs,
  else the torch bmm (`models.deepseek_v32.set_mla_absorb`); absorb_o's launch then also quantises o_proj's
  input where o_proj's GEMM reads one (`absorb_o_quant`);
- fp32_gemv (the fp32 GEMVs: the indexer's head weights, the MoE router's gate): one Triton launch each at decode
  sizes (kernels/gemv.py; above them the op runs cuBLAS's GEMM) wherever Triton runs, else F.linear
  (`models.deepseek_v32.set_fp32_gemv`);
- head_norm (the RMSNorms outside the decoder layers, which run eagerly: the final norm over the logits rows, the
  MTP layer's input and head norms): one Triton launch each (kernels/norm_quant.py `rmsnorm_rows`, the logits rows'
  gather inside it) wherever Triton runs, else the torch reference's chain of kernels
  (`models.deepseek_v32.set_head_norm`).

Per-shape decisions stay inside the custom ops, from pure functions of the concrete sizes: compiled code sees
the choice as constants and gets no guards. Nothing here is called from a traced step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from types import MappingProxyType

import torch

from minidsa.kernels import deepgemm, flashmla, gemv, mla_absorb, router as router_kernel
from minidsa.kernels.deepgemm import DeepGEMM
from minidsa.kernels.flashmla import FlashMLA

logger = logging.getLogger(__name__)

TOPK_IMPL = "triton"
# What each kernel may be served by (`KernelChoice` fields).
IMPLS = MappingProxyType({
    "store_index_k": ("torch", "triton"),
    "index_logits": ("torch", "triton", "deepgemm"),
    "topk": ("torch", "triton"),
    "sparse_mla": ("torch", "triton", "flashmla"),
    "kv_move": ("torch", "triton"),
    "store_mla": ("torch", "triton"),
    "quant_index_q": ("torch", "triton"),
    "sample": ("torch", "triton"),
    "fp8_gemm": ("torch", "triton", "deepgemm"),
    "moe_gemm": ("torch", "triton", "deepgemm"),
    "router": ("torch", "triton"),
    "norm_quant": ("torch", "triton"),
    "mla_absorb": ("torch", "triton"),
    "fp32_gemv": ("torch", "triton"),
    "head_norm": ("torch", "triton"),
})
DSA_OPS = ("store_index_k", "index_logits", "topk", "sparse_mla", "kv_move", "store_mla", "quant_index_q")
# How each decision is named in the start-up log.
LABELS = MappingProxyType({
    "store_index_k": "DSA indexer key norm + rope + store",
    "index_logits": "DSA indexer logits",
    "topk": "DSA top-k",
    "sparse_mla": "DSA sparse MLA",
    "kv_move": "DSA KV move",
    "store_mla": "DSA MLA key norm + rope + store",
    "quant_index_q": "DSA indexer query quantisation",
    "sample": "Sampler race",
    "fp8_gemm": "FP8 linear",
    "moe_gemm": "MoE experts",
    "router": "MoE router",
    "norm_quant": "RMSNorm + FP8 input quantisation",
    "mla_absorb": "MLA absorbed W_UK / W_UV",
    "fp32_gemv": "fp32 GEMVs (indexer head weights, MoE gate)",
    "head_norm": "RMSNorms outside the decoder layers",
})
SERVED = MappingProxyType({  # what an implementation does for a kernel, where it is more than its name
    ("index_logits", "deepgemm"): "DeepGEMM where measured faster, else Triton",
    ("sparse_mla", "flashmla"): "FlashMLA where it takes the shape, else Triton",
    ("topk", "triton"): "Triton radix select or torch.topk, per shape as measured",
    ("fp8_gemm", "deepgemm"): "DeepGEMM where measured faster, else Triton",
    ("moe_gemm", "deepgemm"): "DeepGEMM's grouped GEMMs where measured faster, else the Triton fused MoE",
    ("moe_gemm", "triton"): "the Triton fused MoE",
    ("mla_absorb", "triton"): f"Triton up to {mla_absorb.MAX_TOKENS} tokens, else cuBLAS",
    ("fp32_gemv", "triton"): f"Triton up to {gemv.MAX_TOKENS} tokens, else cuBLAS",
})
NAMES = MappingProxyType({"torch": "torch reference", "triton": "Triton", "deepgemm": "DeepGEMM",
                          "flashmla": "FlashMLA"})


@dataclass(frozen=True)
class KernelChoice:
    """Which implementation serves each kernel of one engine (`IMPLS`): plain strings, picklable."""

    store_index_k: str = "torch"  # the indexer key's LayerNorm + rope and its store (opaque op)
    index_logits: str = "torch"
    topk: str = "torch"
    sparse_mla: str = "torch"
    kv_move: str = "torch"
    store_mla: str = "torch"  # the MLA key's RMSNorm + rope and its store, FP8-quantised or as is (opaque op)
    quant_index_q: str = "torch"  # the indexer queries' rope + rotation + e4m3 per (token, head), for an fp8 cache
    sample: str = "torch"  # the sampler's exponential race (sampling.race_for)
    fp8_gemm: str = "torch"  # the FP8 linears (layers.linear.GEMMS)
    moe_gemm: str = "torch"  # the routed experts' fused MoE op ("deepgemm": its grouped GEMMs where faster)
    router: str = "torch"  # the MoE router's selection (models.deepseek_v32.set_router)
    norm_quant: str = "torch"  # RMSNorm + FP8 quantisation of its output (models.deepseek_v32.set_norm_quant)
    mla_absorb: str = "torch"  # MLA's per-head W_UK / W_UV products (models.deepseek_v32.set_mla_absorb)
    fp32_gemv: str = "torch"  # the indexer's head weights and the router's gate (models.deepseek_v32.set_fp32_gemv)
    head_norm: str = "torch"  # the final norm and the MTP layer's norms (models.deepseek_v32.set_head_norm)

    def __post_init__(self):
        for name, impl in self.__dict__.items():
            if impl not in IMPLS[name]:
                raise ValueError(f"KernelChoice.{name} = {impl!r}, want one of {IMPLS[name]}")

    @property
    def uses_dsa_kernels(self) -> bool:
        """Does any DSA op run something other than its reference?"""
        return any(getattr(self, op) != "torch" for op in DSA_OPS)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.__dict__.items())


@dataclass(frozen=True)
class IndexerShape:
    """What the engine's indexer runs: DeepGEMM's kernels take only some of these (`deepgemm.paged_supported`)."""

    num_heads: int
    head_dim: int
    page_size: int
    fp8_cache: bool


@dataclass(frozen=True)
class RouterShape:
    """The model's routing: the Triton router takes only some (`router.supported`)."""

    n_experts: int
    n_group: int


@dataclass(frozen=True)
class Libraries:
    """The optional libraries one engine's choice uses, as handles (None: not used)."""

    deepgemm: DeepGEMM | None = None
    flashmla: FlashMLA | None = None


@dataclass(frozen=True)
class Overrides:
    """The environment's kernel overrides (for A/B measurements), read once per selection."""

    topk: str = TOPK_IMPL  # MINIDSA_TOPK: torch | triton
    sample: str = "triton"  # MINIDSA_SAMPLE: torch | triton
    fp8_gemm: str | None = None  # MINIDSA_FP8_GEMM: torch | triton | deepgemm

    @classmethod
    def from_environment(cls) -> "Overrides":
        topk = os.environ.get("MINIDSA_TOPK", TOPK_IMPL)
        if topk not in ("torch", "triton"):
            raise ValueError(f"MINIDSA_TOPK must be 'torch' or 'triton', got {topk!r}")
        sample = os.environ.get("MINIDSA_SAMPLE", "triton")
        if sample not in ("torch", "triton"):
            raise ValueError(f"MINIDSA_SAMPLE must be 'torch' or 'triton', got {sample!r}")
        gemm = os.environ.get("MINIDSA_FP8_GEMM")
        if gemm is not None and gemm not in ("torch", "triton", "deepgemm"):
            raise ValueError(f"MINIDSA_FP8_GEMM must be torch, triton or deepgemm, got {gemm!r}")
        return cls(topk, sample, gemm)


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


def select_kernels(device: torch.device | str, kernel_backend: str = "auto", use_deep_gemm: bool = True,
                   use_flash_mla: bool = True, indexer: IndexerShape | None = None,
                   router: RouterShape | None = None, mla_heads: int | None = None) -> KernelChoice:
    """Decide once, at start-up, which implementation serves each kernel; logs each decision and why. `mla_heads`:
    the MLA query heads each rank holds (None: not known, decided per call)."""
    device = torch.device(device)
    moe_off_gpu = "triton" if device.type == "cuda" else "torch"  # what the fused MoE op runs by itself
    if kernel_backend == "torch" or (kernel_backend == "auto" and device.type != "cuda"):
        why = dict.fromkeys(IMPLS, f"kernel_backend={kernel_backend!r} on {device}")
        moe_gemm, why["moe_gemm"] = _moe_gemm(device, "torch", moe_off_gpu, why["fp8_gemm"])
        choice = KernelChoice(moe_gemm=moe_gemm)
        _log(choice, why)
        return choice
    env = Overrides.from_environment()
    ok, triton_why = triton_usable(device)
    fp8_gemm, fp8_why = _fp8_gemm(device, use_deep_gemm, env, ok, triton_why)
    moe_gemm, moe_why = _moe_gemm(device, fp8_gemm, moe_off_gpu, fp8_why)
    if not ok:
        choice = KernelChoice(fp8_gemm=fp8_gemm, moe_gemm=moe_gemm)
        why = dict.fromkeys(IMPLS, triton_why)
        why.update(fp8_gemm=fp8_why, moe_gemm=moe_why)
        _log(choice, why, logging.WARNING)
        return choice
    index, index_why = _index_logits(device, use_deep_gemm, indexer)
    sparse, sparse_why = _sparse_mla(device, use_flash_mla, mla_heads)
    route_why = router_kernel.supported(router.n_experts, router.n_group) if router is not None else None
    norm_quant_why = "the FP8 linears are the torch reference" if fp8_gemm == "torch" else None
    choice = KernelChoice(store_index_k="triton", index_logits=index, topk=env.topk, sparse_mla=sparse,
                          kv_move="triton", store_mla="triton", quant_index_q="triton", sample=env.sample,
                          fp8_gemm=fp8_gemm, moe_gemm=moe_gemm, router="torch" if route_why else "triton",
                          norm_quant="torch" if norm_quant_why else "triton", mla_absorb="triton",
                          fp32_gemv="triton", head_norm="triton")
    why = dict.fromkeys(IMPLS, triton_why)
    why.update(index_logits=index_why, sparse_mla=sparse_why, fp8_gemm=fp8_why, moe_gemm=moe_why,
               router=route_why or triton_why, norm_quant=norm_quant_why or triton_why,
               topk="MINIDSA_TOPK" if "MINIDSA_TOPK" in os.environ else triton_why,
               sample="MINIDSA_SAMPLE" if "MINIDSA_SAMPLE" in os.environ else triton_why)
    _log(choice, why)
    return choice


def _index_logits(device: torch.device, use_deep_gemm: bool, indexer: IndexerShape | None) -> tuple[str, str]:
    if not use_deep_gemm:
        return "triton", "DeepGEMM disabled by use_deep_gemm=False"
    module, status = deepgemm.probe(device, deepgemm.INDEXER_API)
    if module is None:
        return "triton", status.reason
    if indexer is not None:
        why_not = deepgemm.paged_supported(status.sm_major, indexer.num_heads, indexer.head_dim, indexer.page_size,
                                           indexer.fp8_cache)
        if why_not is not None:  # decided here, once: no step asks DeepGEMM for what it cannot take
            return "triton", f"DeepGEMM cannot serve this engine: {why_not}"
    return "deepgemm", status.reason


def _sparse_mla(device: torch.device, use_flash_mla: bool, heads: int | None) -> tuple[str, str]:
    if not use_flash_mla:
        return "triton", "FlashMLA disabled by use_flash_mla=False"
    module, status = flashmla.probe(device)
    if module is None:
        return "triton", status.reason
    if heads is not None:
        why_not = flashmla.heads_unsupported(heads)
        if why_not is not None:  # decided here, once: no step asks FlashMLA for what it cannot take
            return "triton", f"FlashMLA cannot serve this engine: {why_not}"
        note = flashmla.heads_note(heads)
        if note:
            return "flashmla", f"{status.reason}; {note}: the padded heads' outputs are dropped"
    return "flashmla", status.reason


def _fp8_gemm(device: torch.device, use_deep_gemm: bool, env: Overrides, triton_ok: bool,
              triton_why: str) -> tuple[str, str]:
    if env.fp8_gemm is not None:
        if env.fp8_gemm == "deepgemm":
            module, status = deepgemm.probe(device, deepgemm.GEMM_API)
            if module is None:
                raise ValueError(f"MINIDSA_FP8_GEMM=deepgemm: {status.reason}")
        return env.fp8_gemm, "MINIDSA_FP8_GEMM"
    if not triton_ok:
        return "torch", triton_why
    if not use_deep_gemm:
        return "triton", "DeepGEMM disabled by use_deep_gemm=False"
    if device.type != "cuda":
        return "triton", f"DeepGEMM's GEMM is chosen only on a CUDA device, not {device}"
    module, status = deepgemm.probe(device, deepgemm.GEMM_API)
    return ("deepgemm" if module is not None else "triton"), status.reason


def _moe_gemm(device: torch.device, fp8_gemm: str, off: str, fp8_why: str) -> tuple[str, str]:
    if device.type != "cuda":
        return "torch", f"the fused MoE op's reference serves {device}"
    if fp8_gemm != "deepgemm":
        return off, f"FP8 linears: {NAMES[fp8_gemm]} ({fp8_why})"
    module, _ = deepgemm.probe(device, deepgemm.GEMM_API)
    if module is None or deepgemm.grouped_contiguous(module) is None:
        return off, "no contiguous grouped FP8 GEMM in this DeepGEMM build"
    return "deepgemm", f"from {deepgemm.MOE_CONTIGUOUS_MIN_PAIRS_PER_EXPERT} (token, expert) pairs per expert"


def _log(choice: KernelChoice, why: dict[str, str], level: int = logging.INFO) -> None:
    """One line per decision: what serves which kernels, and why (kernels decided alike share a line); then the
    whole choice on one line."""
    lines: dict[tuple[str, str], list[str]] = {}
    for f in fields(choice):
        impl = getattr(choice, f.name)
        lines.setdefault((SERVED.get((f.name, impl), NAMES[impl]), why[f.name]), []).append(LABELS[f.name])
    for (served, reason), labels in lines.items():
        logger.log(level, "%s: %s (%s)", ", ".join(labels), served, reason)
    logger.info("Kernel choice: %s", choice.describe())


def load_libraries(choice: KernelChoice, device: torch.device | str) -> Libraries:
    """The handles of the optional libraries `choice` names, loaded on this rank (their schedule check runs here).
    Raises when one does not load: the choice was made where it did, and every rank serves alike."""
    device = torch.device(device)
    dg = fm = None
    if "deepgemm" in (choice.index_logits, choice.fp8_gemm, choice.moe_gemm):
        api = (deepgemm.INDEXER_API if choice.index_logits == "deepgemm" else ()) + \
            (deepgemm.GEMM_API if "deepgemm" in (choice.fp8_gemm, choice.moe_gemm) else ())
        module, status = deepgemm.probe(device, api)
        if module is None:
            raise RuntimeError(f"the kernel choice ({choice.describe()}) names DeepGEMM, but on {device}: "
                               f"{status.reason}")
        dg = DeepGEMM(module, status, device, check_schedule=choice.index_logits == "deepgemm")
    if choice.sparse_mla == "flashmla":
        module, status = flashmla.probe(device)
        if module is None:
            raise RuntimeError(f"the kernel choice ({choice.describe()}) names FlashMLA, but on {device}: "
                               f"{status.reason}")
        fm = FlashMLA(module, status)
    return Libraries(dg, fm)
