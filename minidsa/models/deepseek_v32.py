"""One model definition for DeepSeek-V3.2 and GLM-5 (DSA + MLA + MoE + MTP).

Parameter names follow the checkpoints (`model.layers.L.self_attn.q_a_proj`
...), except that routed experts are stacked per layer
(`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`);
the loader maps the per-expert checkpoint names onto them.

All attention goes through the absorbed MLA form (one KV head of
kv_lora_rank + qk_rope_head_dim dims) over the paged cache, for every
forward mode; the DSA backend decides how the cache is read.

Tensor parallelism (the `TensorParallel` the model is built under, `parallel.state.building_with`):
attention heads split across ranks (q_b_proj and kv_b_proj by heads, o_proj row-parallel + all-reduce); the
latent KV cache is replicated on every rank (it is per token, not per head: each rank attends its heads over
the same 576-value entries); the indexer is replicated too (its top-k must be identical on every rank, and
replicating it is the simple way to guarantee that). Dense MLPs and shared experts are column / row parallel;
routed experts split their intermediate dimension, or with expert parallelism each rank holds
n_routed_experts / size whole experts; the MoE layer sums experts and shared experts with one all-reduce.
Embedding and lm_head are vocab-parallel (logits all-gathered).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minidsa.attention.backend import DSABackend, IndexStep, LayerCaches
from minidsa.common.batch import ForwardBatch
from minidsa.common.tensor_parallel import building_experts_tp, building_tp
from minidsa.config import ModelConfig
from minidsa.kernels import gemv, mla_absorb, norm_quant, reference
from minidsa.kernels.fp8 import FP8_BLOCK, FP8_DTYPE, block_scale_shape
from minidsa.kernels.fused_moe import SKIP
from minidsa.models.layers.linear import (
    FusedLinear,
    Linear,
    QuantizedInput,
    WeightLoadError,
    as_tensor,
    load_block_scaled,
    modules_outside,
)
from minidsa.models.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint_shard,
)
from minidsa.models import two_batch
from minidsa.models.two_batch import OverlapCalls

importlib.import_module("minidsa.kernels.custom_ops")  # registers torch.ops.minidsa.* (fused_moe below)

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """`reference.rms_norm`. Where FP8 linears read the output (`set_norm_quant`, at build), `normed` and
    `add_normed` also quantise it for them in the same Triton launch (`torch.ops.minidsa.rmsnorm_quant`); where
    none does and the engine runs that kernel, the residual add and the norm are its launch without the
    quantisation (`torch.ops.minidsa.add_rmsnorm`). The norms outside the decoder layers run eagerly, uncompiled:
    where the engine chose it (`set_head_norm`, at build) each is one Triton launch
    (`torch.ops.minidsa.rmsnorm_rows`) instead of the reference's chain of kernels."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.quantizes_output = False
        self.quant_for_deep_gemm = False  # the quantised output in DeepGEMM's layout (`set_norm_quant`)
        # Who runs `forward` / `rows` (`set_head_norm`) and an unquantised `add_normed` (`set_norm_quant`).
        self.kernel = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton":
            return torch.ops.minidsa.rmsnorm_rows(x, self.weight, self.eps)
        return reference.rms_norm(x, self.weight, self.eps)

    def rows(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """RMSNorm(x[rows]); with the kernel, the gather is in its launch."""
        if self.kernel == "triton":
            return torch.ops.minidsa.rmsnorm_rows(x, self.weight, self.eps, rows)
        return self(x[rows])

    def normed(self, x: torch.Tensor) -> tuple[torch.Tensor, QuantizedInput | None]:
        """(RMSNorm(x), its FP8 quantisation where this norm makes one, else None)."""
        if not self.quantizes_output:
            return self(x), None
        normed, q, scales = torch.ops.minidsa.rmsnorm_quant(x, self.weight, self.eps, self.quant_for_deep_gemm)
        return normed, (q, scales)

    def add_normed(self, x: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, QuantizedInput | None]:
        """(h = residual + x, RMSNorm(h), its FP8 quantisation where this norm makes one, else None)."""
        if not self.quantizes_output:
            if self.kernel == "triton":
                h, normed = torch.ops.minidsa.add_rmsnorm(x, residual, self.weight, self.eps)
                return h, normed, None
            h = residual + x
            return h, self(h), None
        h, normed, q, scales = torch.ops.minidsa.add_rmsnorm_quant(x, residual, self.weight, self.eps,
                                                                   self.quant_for_deep_gemm)
        return h, normed, (q, scales)


class Rotary(nn.Module):
    """cos/sin by position (YaRN attention factor folded in, fp32), read from a table built once per position.

    A step gathers its positions' rows, one kernel, where computing them took six (cast, multiply, cos, sin, two
    scalings) in every CUDA graph. The table is built on the model's device by the same elementwise ops a step ran
    on its positions, so its rows are the values a step computed, bit for bit. It covers the model's
    max_position_embeddings; an engine whose rows reach further (decode positions past max_model_len) extends it
    once at start-up (`cover`): positions are never checked against it inside a step.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None):
        super().__init__()
        inv_freq, attention_factor = config.rope.inv_freq(config.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_factor = attention_factor
        self.half = inv_freq.numel()  # rope / 2
        self.register_buffer("table", self.compute(torch.arange(config.max_position_embeddings, device=device)),
                             persistent=False)

    def compute(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rope] fp32: cos of each position's angles, then their sin (the table's rows; the reference)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        return torch.cat([freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor], dim=-1)

    def cover(self, num_positions: int) -> None:
        """Extend the table to positions [0, num_positions) (start-up only)."""
        if num_positions > self.table.shape[0]:
            self.table = self.compute(torch.arange(num_positions, device=self.table.device))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope / 2]: views of one gathered [T, rope] block (the kernels read both by one row stride)."""
        rows = self.table[positions]
        return rows[:, : self.half], rows[:, self.half :]


def _fused(module: nn.Module, name: str) -> FusedLinear:
    fused = getattr(module, name, None)
    if fused is None:
        raise RuntimeError(f"{type(module).__name__}.{name} is missing: call model.fuse_projections() after the "
                           "weights are loaded (models.loader.build_model does)")
    return fused


@dataclass
class LayerContext:
    """Per-forward inputs every layer reads."""

    batch: ForwardBatch
    attn: DSABackend
    cos: torch.Tensor  # [T, rope/2]
    sin: torch.Tensor
    index_meta: IndexStep | None = None  # per-step indexer inputs, made once for every layer


class Indexer(nn.Module):
    """Lightning indexer: scores every visible key with a few cheap heads, keeps the top-k."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.interleave = config.indexer_rope_interleave
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # Shipped in high precision (DeepSeek's FP8 checkpoints too): read in fp32, so stored in fp32.
        self.weights_proj = Linear(config.hidden_size, self.n_heads, quantizable=False)
        self.weights_proj.weight.read_in_fp32 = True
        # relu(a * s) = s * relu(a) for s > 0: both scales fold into the per-head weights.
        self.weight_scale = self.n_heads**-0.5 * self.head_dim**-0.5
        self.fp32_gemv = "torch"  # who runs weights_proj (`set_fp32_gemv`)

    def forward(self, caches: LayerCaches, x: torch.Tensor, qr: torch.Tensor, k: torch.Tensor,
                ctx: LayerContext, qr_quantized: QuantizedInput | None = None) -> torch.Tensor:
        """`k` = wk(x), computed with the attention's input projections (one fused GEMV); `qr_quantized`: qr
        quantised by q_a_layernorm (None where it makes none)."""
        num_tokens = x.shape[0]
        # q and k unrotated: the backend rotates them inside the key store and the query quantisation
        q = self.wq_b(qr, qr_quantized).view(num_tokens, self.n_heads, self.head_dim)
        norm = self.k_norm
        ctx.attn.store_index_k(caches, ctx.batch, k, norm.weight, norm.bias, norm.eps, ctx.cos, ctx.sin,
                               self.interleave)
        weights = _fp32_gemv(self.fp32_gemv)(x, self.weights_proj.weight, self.weight_scale)
        return ctx.attn.index_topk(caches, ctx.batch, q, weights, ctx.cos, ctx.sin, self.interleave, ctx.index_meta)


class MLAttention(nn.Module):
    """Multi-head latent attention with DSA top-k selection."""

    def __init__(self, config: ModelConfig, layer_id: int, has_indexer: bool, computes_topk: bool):
        super().__init__()
        self.layer_id = layer_id
        tp = building_tp()
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")[1]  # this rank's heads
        heads = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * (self.nope + self.rope), what="q_b_proj heads")
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        # Kept in the serving dtype even in FP8 (dequantised at load, as SGLang does): absorption uses it as
        # two per-head batched matmuls (W_UK, W_UV), for which no block-scaled w8a8 kernel exists here; it
        # is 2 x 16 MB bf16 per real layer against ~0.6 GB of FP8 weights a decode step reads per layer.
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v_dim), quantizable=False,
                                              what="kv_b_proj heads")
        self.o_proj = RowParallelLinear(heads * self.v_dim, config.hidden_size, what="o_proj heads")
        self.indexer = Indexer(config) if has_indexer else None
        # Decided once: does this layer run its own indexer, or reuse the top-k it is handed?
        self.computes_topk = computes_topk
        self.absorb = "torch"  # who runs the W_UK / W_UV products (`set_mla_absorb`)
        # Does absorb_o also quantise o_proj's input, and in DeepGEMM's layout? (`set_mla_absorb`, at build)
        self.quantizes_o = False
        self.o_quant_for_deep_gemm = False

    def _kv_b_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]  # W_UK [H, nope, L], W_UV [H, v, L]

    def fuse(self) -> None:
        """q_a, the indexer's key projection and kv_a all read x: one GEMM. kv_a (576 rows, not a multiple
        of 128) goes last so that FP8 block scales stack without padding."""
        linears = [self.q_a_proj] + ([self.indexer.wk] if self.indexer is not None else []) + [self.kv_a_proj_with_mqa]
        self.in_proj = FusedLinear(*linears)

    def forward(self, x: torch.Tensor, ctx: LayerContext, prev_topk: torch.Tensor | None,
                caches: LayerCaches, x_quantized: QuantizedInput | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x_quantized`: x quantised by the layer's input norm (None where it makes none)."""
        num_tokens = x.shape[0]
        parts = _fused(self, "in_proj")(x, x_quantized)
        q_in, kv = parts[0], parts[-1]
        index_k = parts[1] if len(parts) == 3 else None
        qr, qr_quantized = self.q_a_layernorm.normed(q_in)
        q = self.q_b_proj(qr, qr_quantized).view(num_tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]  # q_rope rotated by absorb_q

        ctx.attn.store_kv(caches, ctx.batch, kv, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, ctx.cos,
                          ctx.sin)

        if self.computes_topk or prev_topk is None:
            if self.indexer is None:
                raise RuntimeError(
                    f"layer {self.layer_id} shares the previous layer's top-k but was handed none"
                )
            topk = self.indexer(caches, x, qr, index_k, ctx, qr_quantized)
        else:
            topk = prev_topk

        w_uk, w_uv = self._kv_b_halves()
        if self.absorb == "triton":
            absorb_q, absorb_o = torch.ops.minidsa.absorb_q, torch.ops.minidsa.absorb_o
        else:
            absorb_q, absorb_o = mla_absorb.absorb_q_reference, mla_absorb.absorb_o_reference
        q_full = absorb_q(q_nope, q_rope, w_uk, ctx.cos, ctx.sin)  # [t, h, kv_lora_rank + rope]
        o_latent = ctx.attn.sparse_mla(caches, q_full, topk, self.softmax_scale, self.kv_lora_rank)
        if self.quantizes_o:
            o, o_q, o_scales = torch.ops.minidsa.absorb_o_quant(o_latent, w_uv, self.o_quant_for_deep_gemm)
            return self.o_proj(o, (o_q, o_scales)), topk
        return self.o_proj(absorb_o(o_latent, w_uv)), topk


class MLP(nn.Module):
    """SwiGLU; column / row parallel under TP. `reduce_output=False`: the caller sums the partial output.
    Where down_proj is FP8 (`set_swiglu_quant`, at build) the product is quantised for it in the launch that
    computes it (`torch.ops.minidsa.swiglu_quant`)."""

    def __init__(self, hidden: int, inter: int, reduce_output: bool = True, what: str = "intermediate_size"):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, what=what)
        self.up_proj = ColumnParallelLinear(hidden, inter, what=what)
        self.down_proj = RowParallelLinear(inter, hidden, what=what, reduce_output=reduce_output)
        self.quantizes_product = False
        self.product_for_deep_gemm = False  # the quantised product in DeepGEMM's layout

    def fuse(self) -> None:
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, x_quantized: QuantizedInput | None = None) -> torch.Tensor:
        gate, up = _fused(self, "gate_up")(x, x_quantized)
        if self.quantizes_product:
            mid, q, scales = torch.ops.minidsa.swiglu_quant(gate, up, self.product_for_deep_gemm)
            return self.down_proj(mid, (q, scales))
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Grouped sigmoid routing with a correction bias used for choice only (fp32).

    The gate's GEMM runs here (`KernelChoice.fp32_gemv`, set at build by `set_fp32_gemv`); the selection
    (`kernels.reference.route`) runs as the engine chose (`KernelChoice.router`, set once at build by `set_router`):
    the torch reference, or one Triton launch."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.kernel = "torch"
        self.fp32_gemv = "torch"  # who runs the gate's GEMM (`set_fp32_gemv`)
        self.weight = nn.Parameter(torch.zeros(self.n_experts, config.hidden_size))
        self.weight.read_in_fp32 = True  # stored in fp32 (`loader.serving_dtypes_`)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _fp32_gemv(self.fp32_gemv)(x, self.weight, 1.0)
        route = torch.ops.minidsa.route if self.kernel == "triton" else reference.route
        return route(logits, self.e_score_correction_bias.float(), self.top_k, self.n_group, self.topk_group,
                     self.norm_topk_prob, self.scaling)


def set_router(model: nn.Module, kernel: str) -> None:
    """Which implementation selects every MoE layer's experts ("torch" or "triton"), decided once at build."""
    if kernel not in ("torch", "triton"):
        raise ValueError(f"router kernel {kernel!r} is not 'torch' or 'triton'")
    for mod in model.modules():
        if isinstance(mod, Router):
            mod.kernel = kernel


def _reads_quantized_input(linear: Linear) -> bool:
    """Does this linear's GEMM read an input quantised for it (the FP8 Triton GEMM and DeepGEMM; not the torch
    reference, which quantises for itself)?"""
    return linear.is_fp8 and linear.gemm in ("triton", "deepgemm")


def set_mla_absorb(model: nn.Module, kernel: str) -> None:
    """Which implementation runs every MLA layer's absorbed W_UK / W_UV products ("torch": per-head bmm, or
    "triton": `torch.ops.minidsa.absorb_q` / `absorb_o`, `KernelChoice.mla_absorb`), decided once at build, after
    `set_gemm`. With "triton", absorb_o also quantises o_proj's input where o_proj's GEMM reads one
    (`torch.ops.minidsa.absorb_o_quant`; heads of v_head_dim 128 or 256), in DeepGEMM's layout where DeepGEMM
    serves it."""
    if kernel not in ("torch", "triton"):
        raise ValueError(f"mla_absorb kernel {kernel!r} is not 'torch' or 'triton'")
    for mod in model.modules():
        if isinstance(mod, MLAttention):
            mod.absorb = kernel
            mod.quantizes_o = (kernel == "triton" and _reads_quantized_input(mod.o_proj)
                               and mla_absorb.quant_unsupported(mod.v_dim) is None)
            mod.o_quant_for_deep_gemm = mod.quantizes_o and mod.o_proj.gemm == "deepgemm"


def set_swiglu_quant(model: nn.Module, kernel: str) -> list[MLP]:
    """Whether each SwiGLU MLP (dense, shared experts) quantises its product for an FP8 down_proj in the launch
    that computes it ("triton", `KernelChoice.norm_quant`: activations quantised by the kernels producing them) or
    leaves it to the GEMM ("torch"), decided once at build, after `set_gemm`; returns the MLPs that do."""
    if kernel not in ("torch", "triton"):
        raise ValueError(f"swiglu_quant kernel {kernel!r} is not 'torch' or 'triton'")
    fused = []
    for mod in model.modules():
        if isinstance(mod, MLP):
            mod.quantizes_product = kernel == "triton" and _reads_quantized_input(mod.down_proj)
            mod.product_for_deep_gemm = mod.quantizes_product and mod.down_proj.gemm == "deepgemm"
            if mod.quantizes_product:
                fused.append(mod)
    return fused


def _fp32_gemv(kernel: str) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    return torch.ops.minidsa.fp32_gemv if kernel == "triton" else gemv.fp32_gemv_reference


def set_fp32_gemv(model: nn.Module, kernel: str) -> None:
    """Which implementation runs the fp32 GEMVs, the indexers' head weights and the routers' gates ("torch":
    F.linear on x cast to fp32, or "triton": `torch.ops.minidsa.fp32_gemv`, `KernelChoice.fp32_gemv`), decided once
    at build."""
    if kernel not in ("torch", "triton"):
        raise ValueError(f"fp32_gemv kernel {kernel!r} is not 'torch' or 'triton'")
    for mod in model.modules():
        if isinstance(mod, (Indexer, Router)):
            mod.fp32_gemv = kernel


def set_norm_quant(model: nn.Module, kernel: str) -> list[RMSNorm]:
    """Whether each RMSNorm feeding FP8 linears quantises its output for them in its own launch ("triton",
    `KernelChoice.norm_quant`) or leaves it to them ("torch"), decided once at build, after `set_gemm`; returns the
    norms that do. Only norms whose width and dtype the kernel takes (`norm_quant.supported`) and that some FP8
    consumer reads. Where every FP8 consumer is a linear given to DeepGEMM, the output comes in DeepGEMM's layout
    (padded rows, MN-major scales: `fp8_gemm.act_buffers`), which DeepGEMM reads as it is and the Triton GEMM
    serving the same linear at other sizes reads too; the fused MoE reads plain rows only. With "triton", the norms
    that do not quantise run the same kernel without the quantisation (`RMSNorm.kernel`)."""
    if kernel not in ("torch", "triton"):
        raise ValueError(f"norm_quant kernel {kernel!r} is not 'torch' or 'triton'")
    fused = []
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        for norm, consumers in layer.norm_consumers():
            fp8_consumers = [c for c in consumers if c.is_fp8]
            runs_kernel = kernel == "triton" and norm_quant.supported(norm.weight.shape[0], norm.weight.dtype) is None
            norm.quantizes_output = runs_kernel and bool(fp8_consumers)
            norm.quant_for_deep_gemm = norm.quantizes_output and all(
                isinstance(c, Linear) and c.gemm == "deepgemm" for c in fp8_consumers)
            norm.kernel = "triton" if runs_kernel and not norm.quantizes_output else "torch"
            if norm.quantizes_output:
                fused.append(norm)
    return fused


def set_head_norm(model: "DeepseekV32ForCausalLM", kernel: str) -> list[RMSNorm]:
    """Who runs the RMSNorms outside the decoder layers: the final norm (over the logits rows, gathered in its
    launch) and the MTP layer's input and head norms ("torch": the reference's chain of eager kernels; "triton": one
    launch each, `KernelChoice.head_norm`), decided once at build; returns the norms the kernel runs (those whose
    width and dtype it takes, `norm_quant.supported`). The decoder layers' norms are compiled with their layer."""
    if kernel not in ("torch", "triton"):
        raise ValueError(f"head_norm kernel {kernel!r} is not 'torch' or 'triton'")
    mtp = model.mtp_layer
    norms = [model.model.norm] + ([] if mtp is None else [mtp.enorm, mtp.hnorm, mtp.shared_head.norm])
    for norm in norms:
        norm.kernel = ("triton" if kernel == "triton" and norm_quant.supported(norm.weight.shape[0],
                                                                              norm.weight.dtype) is None else "torch")
    return [n for n in norms if n.kernel == "triton"]


def deepgemm_experts(model: nn.Module, skip: nn.Module | None = None
                     ) -> list[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], int, bool]]:
    """((gate_up_proj, scales), (down_proj, scales), top_k, every expert on this rank) of each FP8 expert layer
    `set_gemm` gave to DeepGEMM (its grouped GEMMs serve prefill sizes), those inside `skip` left out."""
    return [((m.gate_up_proj, m.gate_up_proj_scale_inv), (m.down_proj, m.down_proj_scale_inv), m.top_k,
             m.num_local_experts == m.n_experts)
            for m in modules_outside(model, skip) if isinstance(m, Experts) and m.gemm == "deepgemm" and m.is_fp8]


class Experts(nn.Module):
    """Routed experts stacked per layer: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I].

    FP8 (`make_fp8_`): both e4m3, with fp32 block scales gate_up_proj_scale_inv [E, ceil(2I/128), ceil(H/128)]
    and down_proj_scale_inv [E, ceil(H/128), ceil(I/128)]. The checkpoint's per-expert tensors
    (`experts.E.{gate,up,down}_proj.weight` + `.weight_scale_inv`) load through the stacked parameters'
    `weight_loader(param, tensor, scale_inv, name, expert=E, shard="gate" | "up" | "down")`.
    Every token count goes through one fused MoE op (minidsa.kernels.fused_moe): tokens sorted per expert,
    grouped GEMMs that read only the chosen experts (Triton on CUDA, the torch reference on CPU).

    Under tensor parallelism the output is this rank's partial sum (the MoE layer all-reduces): either every
    expert with `moe_intermediate_size / size` of its intermediate rows (gate, up) and columns (down), or with
    expert parallelism experts [first_expert, first_expert + num_local_experts) whole. A (token, choice) pair
    routed to another rank's expert reaches the fused MoE op as `fused_moe.SKIP`: it gets no GEMM rows here.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        tp = self.tp = building_experts_tp()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.n_experts, self.full_inter = e, i
        self.top_k = config.num_experts_per_tok  # each token's pairs: what sizes the grouped GEMM's rows
        if tp.expert_parallel:
            self.first_expert, self.num_local_experts = tp.split(e, "n_routed_experts (expert parallelism)")
            self.inter_start, self.inter = 0, i
        else:
            self.first_expert, self.num_local_experts = 0, e
            self.inter_start, self.inter = tp.split(i, "moe_intermediate_size")
        e_local, i_local = self.num_local_experts, self.inter
        self.gemm = "torch"  # which GEMM serves FP8 experts at prefill sizes (`layers.linear.set_gemm`, at build)
        self.gate_up_proj = nn.Parameter(torch.empty(e_local, 2 * i_local, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e_local, h, i_local), requires_grad=False)
        for p in (self.gate_up_proj, self.down_proj):
            # Which checkpoint experts this rank reads (the loader skips the others without reading them).
            p.local_experts = range(self.first_expert, self.first_expert + e_local)
            p.num_experts = e
        self.gate_up_proj.full_shape, self.down_proj.full_shape = (e, 2 * i, h), (e, h, i)
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)
        self.gate_up_proj.weight_loader = self.load_expert_weight
        self.down_proj.weight_loader = self.load_expert_weight
        self.pow2_scale = False

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_proj_scale_inv is not None

    def make_fp8_(self, pow2_scale: bool = False) -> None:
        """Switch to e4m3 + block scales (empty; meant for the meta device, before loading)."""
        if self.inter % FP8_BLOCK:
            split = self.inter != self.full_inter
            per_rank = f" ({self.full_inter} over tensor_parallel_size {self.tp.size})" if split else ""
            raise ValueError(f"FP8 experts need moe_intermediate_size divisible by {FP8_BLOCK}, got "
                             f"{self.inter}{per_rank}")
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self, name)
            e, rows, cols = p.shape
            p.data = torch.empty(e, rows, cols, dtype=FP8_DTYPE, device=p.device)
            scale = nn.Parameter(torch.empty(e, *block_scale_shape(rows, cols), dtype=torch.float32, device=p.device),
                                 requires_grad=False)
            scale.weight_loader = None  # written by its weight's loader
            setattr(self, f"{name}_scale_inv", scale)
        self.pow2_scale = pow2_scale

    def load_expert_weight(self, param: torch.Tensor, loaded: torch.Tensor, scale_inv: torch.Tensor | None = None,
                           name: str = "", *, expert: int | None = None, shard: str | None = None) -> None:
        """One expert's gate / up / down tensor, or (expert None) the whole stacked tensor as minidsa names it;
        either narrowed to this rank's experts and intermediate slice first."""
        scale_param = self.gate_up_proj_scale_inv if param is self.gate_up_proj else self.down_proj_scale_inv
        name = name or (f"expert {expert} {shard}_proj" if expert is not None else "stacked experts")
        if expert is None:
            loaded, scale_inv = self._local_stack(param, loaded, scale_inv, name)
            load_block_scaled(param.data, None if scale_param is None else scale_param.data, loaded, scale_inv,
                              name, self.pow2_scale)
            return
        if not 0 <= expert < self.n_experts:
            raise WeightLoadError(f"tensor {name}: expert {expert} does not exist (n_routed_experts {self.n_experts})")
        if expert not in param.local_experts:
            return  # another rank's expert
        local = expert - self.first_expert
        dim = -1 if shard == "down" else -2
        loaded, scale_inv = checkpoint_shard(loaded, scale_inv, dim, self.inter_start, self.inter, self.full_inter,
                                             name)
        rows = {"gate": slice(0, self.inter), "up": slice(self.inter, 2 * self.inter), "down": slice(None)}[shard]
        scale = None
        if scale_param is not None:
            block_rows = slice(None) if rows.start is None else slice(rows.start // FP8_BLOCK, rows.stop // FP8_BLOCK)
            scale = scale_param.data[local, block_rows]
        load_block_scaled(param.data[local, rows], scale, loaded, scale_inv, name, self.pow2_scale)

    def _local_stack(self, param: torch.Tensor, loaded, scale_inv, name: str):
        """A stacked [E, 2I, H] / [E, H, I] checkpoint tensor narrowed to this rank's experts and slices."""
        if loaded.shape[0] != self.n_experts:
            raise WeightLoadError(f"tensor {name} has shape {tuple(loaded.shape)}, the config implies "
                                  f"{self.n_experts} experts")
        if self.num_local_experts != self.n_experts:
            loaded = loaded.narrow(0, self.first_expert, self.num_local_experts)
            scale_inv = None if scale_inv is None else scale_inv.narrow(0, self.first_expert, self.num_local_experts)
        if self.inter == self.full_inter:
            return loaded, scale_inv
        if param is self.down_proj:
            return checkpoint_shard(loaded, scale_inv, -1, self.inter_start, self.inter, self.full_inter, name)
        full = self.full_inter
        halves = [checkpoint_shard(loaded.narrow(-2, start, full),
                                   None if scale_inv is None else scale_inv.narrow(-2, start // FP8_BLOCK,
                                                                                     -(-full // FP8_BLOCK)),
                                   -2, self.inter_start, self.inter, full, name) for start in (0, full)]
        weight = torch.cat([as_tensor(w) for w, _ in halves], dim=-2)
        scales = None if scale_inv is None else torch.cat([as_tensor(s) for _, s in halves], dim=-2)
        return weight, scales

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                x_quantized: QuantizedInput | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' output for x [T, H], plus `addend` [T, H] when given, added in the op's launch that
        sums each token's routed rows (no add launch of its own)."""
        expert_parallel = self.num_local_experts != self.n_experts
        if expert_parallel:  # global ids -> this rank's experts; another rank's: SKIP (no GEMM rows here)
            local = ids - self.first_expert
            elsewhere = (local < 0) | (local >= self.num_local_experts)
            ids = local.masked_fill(elsewhere, SKIP)
        x_q, x_scale = x_quantized if x_quantized is not None else (None, None)
        return torch.ops.minidsa.fused_moe(x, ids, weights, self.gate_up_proj, self.down_proj,
                                           getattr(self, "gate_up_proj_scale_inv", None),
                                           getattr(self, "down_proj_scale_inv", None), self.gemm == "deepgemm",
                                           expert_parallel, x_q, x_scale, addend)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, reduce_output=False,
                what="shared experts' intermediate size")
            if config.n_shared_experts > 0 else None
        )
        self.tp = building_tp()
        self.dp = building_experts_tp() if building_experts_tp().dp_attention else None  # DP attention's group

    def forward(self, x: torch.Tensor, x_quantized: QuantizedInput | None = None,
                dp_batch: ForwardBatch | None = None) -> torch.Tensor:
        """Routed + shared experts. The shared experts run before the routed ones, whose op adds their output in
        the launch that sums its rows: a MoE layer runs no add launch of its own (the residual add is the next
        layer's input norm's, `DecoderLayer.forward`). One rounding of routed + shared, from fp32: in bf16 not the
        bytes of adding the rounded routed output to the shared one (eager before), in fp32 the same.

        `dp_batch`: under DP attention, this rank's batch (every rank's row count: `ForwardBatch.dp_tokens`)."""
        if self.dp is not None:
            return self._forward_dp(x, x_quantized, dp_batch)
        ids, weights = self.gate(x)
        shared = self.shared_experts(x, x_quantized) if self.shared_experts is not None else None
        y = self.experts(x, ids, weights, x_quantized, addend=shared)
        return self.tp.all_reduce(y)  # routed and shared partial sums: one all-reduce per MoE layer

    def _forward_dp(self, x: torch.Tensor, x_quantized: QuantizedInput | None, batch: ForwardBatch | None
                    ) -> torch.Tensor:
        """DP attention: the rows of every rank meet here. Each rank's rows, padded to the step's most, are
        all-gathered; the (replicated) router chooses for all of them; this rank's experts add their share for every
        row; a reduce-scatter (sum) hands each rank back its own rows, complete; the (replicated) shared experts
        run on this rank's rows alone. Where the ranks' row counts differ the batch says how (`ForwardBatch.dp_pad`:
        the rows this rank adds; `dp_real_rows`: the gathered rows that are not padding, the only ones the router
        and the experts see); without them every rank has as many rows as this one: start-up's warm-up and
        activation profile (the same batches on every rank) and the DECODE graphs, which every rank replays at the
        same bucket (their padding rows, at the dummy slot, go through the experts like real ones: each row's
        result is its own, and only reaches its own rank's padding row). Nothing here reads a per-step host int,
        so the compiled layer does not guard on the step's counts."""
        dp = self.dp
        gathered = dp.all_gather_rows(self.rows_to_send(x, batch))  # [size * most, H], rank-major
        y = self.routed(gathered, batch.dp_real_rows if batch is not None else None)
        y = dp.reduce_scatter_rows(y)[:x.shape[0]]  # this rank's rows, summed over every rank's experts
        shared = self.shared(x, x_quantized)
        return y if shared is None else y + shared

    @staticmethod
    def rows_to_send(x: torch.Tensor, batch: ForwardBatch | None) -> torch.Tensor:
        """DP attention: this rank's rows, padded to the step's most (`ForwardBatch.dp_pad`)."""
        pad = batch.dp_pad if batch is not None else None
        return x if pad is None else torch.cat([x, x.new_zeros(pad.shape[0], x.shape[1])])

    def routed(self, gathered: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """DP attention: this rank's experts' share of every gathered row (the router chooses for all of them);
        `real`: the gathered rows that are not padding (`ForwardBatch.dp_real_rows`), the only ones the router and
        the experts see (the padding rows' outputs are zero)."""
        rows = gathered if real is None else gathered[real]
        ids, weights = self.gate(rows)
        y = self.experts(rows, ids, weights)
        return y if real is None else y.new_zeros(gathered.shape[0], y.shape[1]).index_copy_(0, real, y)

    def shared(self, x: torch.Tensor, x_quantized: QuantizedInput | None) -> torch.Tensor | None:
        """DP attention: the shared experts' output for this rank's own rows (None: the model has none)."""
        return self.shared_experts(x, x_quantized) if self.shared_experts is not None else None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dense: bool, has_indexer: bool, computes_topk: bool):
        super().__init__()
        self.self_attn = MLAttention(config, layer_id, has_indexer, computes_topk)
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if dense else MoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, pending: torch.Tensor | None, ctx: LayerContext,
                prev_topk: torch.Tensor | None, caches: LayerCaches):
        """`h`: the residual stream; `pending`: the previous layer's MLP / MoE output, not yet added to it (None:
        nothing to add). Returns (h, this layer's MLP / MoE output, top-k), the output unsummed too: the next
        layer's input norm adds it in its own launch (`add_normed`), so the add costs no launch of its own; after
        the last layer the model adds it."""
        h, x, x_quantized, topk = self.attend(h, pending, ctx, prev_topk, caches)
        if self.exchanges_rows:  # DP attention: the ranks' rows meet
            return h, self.mlp(x, x_quantized, ctx.batch), topk
        return h, self.mlp(x, x_quantized), topk

    def attend(self, h: torch.Tensor, pending: torch.Tensor | None, ctx: LayerContext,
               prev_topk: torch.Tensor | None, caches: LayerCaches
               ) -> tuple[torch.Tensor, torch.Tensor, QuantizedInput | None, torch.Tensor]:
        """The layer up to its MLP / MoE: (h, the MLP's input, its FP8 quantisation or None, top-k)."""
        if pending is None:
            x, x_quantized = self.input_layernorm.normed(h)
        else:
            h, x, x_quantized = self.input_layernorm.add_normed(pending, h)
        a, topk = self.self_attn(x, ctx, prev_topk, caches, x_quantized)
        h, x, x_quantized = self.post_attention_layernorm.add_normed(a, h)
        return h, x, x_quantized, topk

    @property
    def exchanges_rows(self) -> bool:
        """A MoE layer under DP attention: the ranks' rows meet in it (`MoE._forward_dp`)."""
        return isinstance(self.mlp, MoE) and self.mlp.dp is not None

    def norm_consumers(self) -> list[tuple[RMSNorm, list[nn.Module]]]:
        """Each norm whose output feeds linears directly, with those linears (or routed experts)."""
        attn, mlp = self.self_attn, self.mlp
        indexer = [] if attn.indexer is None else [attn.indexer]
        after_attn = ([mlp.gate_proj, mlp.up_proj] if isinstance(mlp, MLP) else
                      [mlp.experts] + ([] if mlp.shared_experts is None else
                                       [mlp.shared_experts.gate_proj, mlp.shared_experts.up_proj]))
        return [(self.input_layernorm, [attn.q_a_proj, attn.kv_a_proj_with_mqa] + [i.wk for i in indexer]),
                (attn.q_a_layernorm, [attn.q_b_proj] + [i.wq_b for i in indexer]),
                (self.post_attention_layernorm, after_attn)]


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """The nextn layer: eh_proj([enorm(embed(next_token)) | hnorm(h_prev)]) -> decoder block."""

    def __init__(self, config: ModelConfig, layer_id: int):
        # It carries indexer weights; by default it reuses the top-k it is handed
        # and computes its own only when handed none.
        super().__init__(config, layer_id, dense=False, has_indexer=True, computes_topk=config.mtp_indexer_full)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size)
        self.shared_head = SharedHead(config)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = []
        for i in range(config.num_hidden_layers):
            full = config.indexer_full[i]
            layers.append(DecoderLayer(config, i, config.dense_layers[i], has_indexer=full, computes_topk=full))
        for j in range(config.num_nextn_predict_layers):
            layers.append(MTPLayer(config, config.num_hidden_layers + j))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def call_layer(layer: DecoderLayer, h: torch.Tensor, pending: torch.Tensor | None, ctx: LayerContext,
               prev_topk: torch.Tensor | None, caches: LayerCaches
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer (`DecoderLayer.forward`). The unit of torch.compile (regional compilation): every layer of
    one kind (dense or MoE, own or shared top-k, MTP) reuses one compiled graph, so start-up does not grow with
    depth."""
    return layer(h, pending, ctx, prev_topk, caches)


RunLayer = Callable[[DecoderLayer, torch.Tensor, "torch.Tensor | None", LayerContext, "torch.Tensor | None",
                     LayerCaches], "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [T, hidden], last layer output before the final norm (the MTP layer's input)
    logits: torch.Tensor  # [N, vocab] fp32 at batch.logits_indices
    topk: torch.Tensor | None  # [T, index_topk] slots of the last layer (handed to the MTP layer)


class DeepseekV32ForCausalLM(nn.Module):
    """Serves both DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM checkpoints."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.tp = building_tp()
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, quantizable=False,
                                            what="vocab_size")
        self.rotary = Rotary(config)

    def make_fp8_(self, which: Callable[[str], bool] | None = None, pow2_scale: bool = False) -> list[str]:
        """Switch the projections DeepSeek's recipe stores in FP8 (quantizable Linears, routed experts) to e4m3 +
        128x128 block scales; `which(module_name)` picks a subset (a checkpoint's as-stored layers). Done on
        the meta device, before loading. Returns the names of the modules switched."""
        switched = []
        for name, mod in self.named_modules():
            fp8able = isinstance(mod, Experts) or (isinstance(mod, Linear) and mod.quantizable)
            if not fp8able or (which is not None and not which(name)):
                continue
            if isinstance(mod, Experts) and mod.inter % FP8_BLOCK:
                why = (f"FP8 routed experts need moe_intermediate_size divisible by {FP8_BLOCK} (gate and up scale "
                       f"blocks stack into one tensor), got {mod.inter}")
                if which is None:
                    raise ValueError(why)
                logger.warning("%s: %s; they are dequantised to the serving dtype", name, why)
                continue
            mod.make_fp8_(pow2_scale)
            switched.append(name)
        return switched

    @torch.no_grad()
    def fuse_projections(self) -> "DeepseekV32ForCausalLM":
        """Fuse projections that share an input (`MLAttention.fuse`, `MLP.fuse`: `FusedLinear`); once, after the weights
        are final."""
        for mod in self.modules():
            if isinstance(mod, (MLAttention, MLP)):
                mod.fuse()
        return self

    @property
    def main_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[: self.config.num_hidden_layers])

    def one_layer_per_kind(self) -> list[int]:
        """The first decoder layer of each kind (dense / MoE, own / shared top-k), in model order: a compiled layer
        graph and its kernels are the same for every layer of a kind, so these meet all of them (the start-up
        warm-up runs only these, and does not grow with depth)."""
        first: dict[tuple[bool, bool], int] = {}
        for i in range(self.config.num_hidden_layers):
            first.setdefault((bool(self.config.dense_layers[i]), bool(self.config.indexer_full[i])), i)
        return sorted(first.values())

    @property
    def mtp_layer(self) -> MTPLayer | None:
        n = self.config.num_hidden_layers
        return self.model.layers[n] if len(self.model.layers) > n else None

    def layer_context(self, batch: ForwardBatch, attn: DSABackend) -> LayerContext:
        cos, sin = self.rotary.cos_sin(batch.positions)
        return LayerContext(batch=batch, attn=attn, cos=cos, sin=sin, index_meta=attn.index_metadata(batch))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last_dim(self.lm_head(h)).float()

    def forward(self, batch: ForwardBatch, attn: DSABackend, run_layer: "RunLayer | None" = None,
                layers: list[int] | None = None, overlap: OverlapCalls | None = None) -> ModelOutput:
        """`run_layer`: how each decoder layer is called (the runner hands in a compiled `call_layer`). `layers`:
        only these decoder layers, in order (the start-up warm-up's `one_layer_per_kind`; not the model's output).
        A batch split for two-batch overlap (`ForwardBatch.two_batches`) runs its MoE layers as two interleaved
        micro-batches (models/two_batch.py) through `overlap`'s stages."""
        run_layer = run_layer or call_layer
        ctx = self.layer_context(batch, attn)
        h = self.model.embed_tokens(batch.input_ids)
        # The first layer is handed a pending output as the later ones are: None would trace a second graph of its
        # kind, one the warm-up's `one_layer_per_kind` never meets. -0.0, not 0.0: x + -0.0 is x bit for bit, x =
        # -0.0 included.
        pending = torch.full_like(h, -0.0)
        topk = None
        main = self.main_layers
        order = list(range(len(main))) if layers is None else layers
        split = len(order)  # from here on two micro-batches (`two_batch.run_layers`)
        if batch.two_batches is not None and layers is None:
            split = next((i for i in order if main[i].exchanges_rows), split)
        for i in order[:split]:
            h, pending, topk = run_layer(main[i], h, pending, ctx, topk, attn.layer_caches[i])
        if split < len(order):
            halves = batch.micro_batches()
            contexts = [self.layer_context(half, attn) if half.num_tokens else None for half in halves]
            h, pending, topk = two_batch.run_layers(main[split:], attn.layer_caches[split:len(main)], halves, contexts,
                                                    h, pending, topk, run_layer, overlap or OverlapCalls())
        h = h + pending  # the hidden state handed on (the MTP layer, speculative decoding) is the summed stream
        normed = self.model.norm.rows(h, batch.logits_indices)
        return ModelOutput(hidden=h, logits=self.logits(normed), topk=topk)

    def forward_mtp(self, batch: ForwardBatch, attn: DSABackend, hidden_prev: torch.Tensor,
                    prev_topk: torch.Tensor | None = None, run_layer: "RunLayer | None" = None) -> ModelOutput:
        """Draft forward: batch.input_ids are the *next* tokens, hidden_prev the states at the same rows."""
        mtp = self.mtp_layer
        if mtp is None:
            raise RuntimeError("this checkpoint has no MTP (nextn) layer (num_nextn_predict_layers = 0)")
        ctx = self.layer_context(batch, attn)
        e = mtp.enorm(self.model.embed_tokens(batch.input_ids))
        h = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden_prev)], dim=-1))
        # None: the MTP layer is alone of its kind, so it traces one graph all the same, without a fill
        h, pending, topk = (run_layer or call_layer)(mtp, h, None, ctx, prev_topk,
                                                     attn.layer_caches[self.config.num_hidden_layers])
        h = h + pending
        normed = mtp.shared_head.norm.rows(h, batch.logits_indices)
        return ModelOutput(hidden=h, logits=self.logits(normed), topk=topk)
