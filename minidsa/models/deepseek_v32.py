"""One model definition for DeepSeek-V3.2 and GLM-5 (DSA + MLA + MoE + MTP).

Parameter names follow the checkpoints (`model.layers.L.self_attn.q_a_proj`
...), except that routed experts are stacked per layer
(`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`);
the loader maps the per-expert checkpoint names onto them.

All attention goes through the absorbed MLA form (one KV head of
kv_lora_rank + qk_rope_head_dim dims) over the paged cache, for every
forward mode; the DSA backend decides how the cache is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minidsa.attention.dsa import DSABackend
from minidsa.batch import ForwardBatch
from minidsa.config import ModelConfig
from minidsa.kernels import custom_ops  # noqa: F401  (registers torch.ops.minidsa.*)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables by position (YaRN attention factor folded in); rotation in fp32."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, attention_factor = config.rope.inv_freq(config.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3)... rotated; output laid out [evens | odds] (q and k alike, so q.k is unchanged)."""
    dtype = x.dtype
    x = x.float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX half-split rotation: (x[i], x[i + d/2]) pairs."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def fuse_linears(module: nn.Module, name: str, *linears: nn.Linear) -> None:
    """One weight for several bias-free projections of the same input, as buffer `name` of `module`.

    A decode step then reads them in one GEMV (one launch, better bandwidth on small outputs). The
    Linear modules keep their parameters (checkpoint names, state_dict), re-pointed as views into the
    fused weight, so an in-place load into either is seen by both. Called once the weights are final.
    """
    fused = torch.cat([lin.weight.data for lin in linears], 0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start:start + rows]
        start += rows
    module.register_buffer(name, fused, persistent=False)


def _fused(module: nn.Module, name: str) -> torch.Tensor:
    w = getattr(module, name, None)
    if w is None:
        raise RuntimeError(f"{type(module).__name__}.{name} is missing: call model.fuse_projections() after the "
                           "weights are loaded (models.loader.build_model does)")
    return w


@dataclass
class LayerContext:
    """Per-forward inputs every layer reads."""

    batch: ForwardBatch
    attn: DSABackend
    cos: torch.Tensor  # [T, rope/2]
    sin: torch.Tensor


class Indexer(nn.Module):
    """Lightning indexer: scores every visible key with a few cheap heads, keeps the top-k."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.interleave = config.indexer_rope_interleave
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        # relu(a * s) = s * relu(a) for s > 0: both scales fold into the per-head weights.
        self.weight_scale = self.n_heads**-0.5 * self.head_dim**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        rot = (rope_interleaved if self.interleave else rope_half)(rot, cos, sin)
        return torch.cat([rot, rest], dim=-1)

    def forward(self, layer_id: int, x: torch.Tensor, qr: torch.Tensor, k: torch.Tensor,
                ctx: LayerContext) -> torch.Tensor:
        """`k` = wk(x), computed with the attention's input projections (one fused GEMV)."""
        num_tokens = x.shape[0]
        q = self.wq_b(qr).view(num_tokens, self.n_heads, self.head_dim)
        q = self._rope(q, ctx.cos.unsqueeze(1), ctx.sin.unsqueeze(1))
        k = self._rope(self.k_norm(k), ctx.cos, ctx.sin)
        ctx.attn.store_index_k(layer_id, ctx.batch, k)
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.weight_scale
        return ctx.attn.index_topk(layer_id, ctx.batch, q, weights)


class MLAttention(nn.Module):
    """Multi-head latent attention with DSA top-k selection."""

    def __init__(self, config: ModelConfig, layer_id: int, has_indexer: bool, computes_topk: bool):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=False)
        self.indexer = Indexer(config) if has_indexer else None
        # Decided once: does this layer run its own indexer, or reuse the top-k it is handed?
        self.computes_topk = computes_topk

    def _kv_b_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]  # W_UK [H, nope, L], W_UV [H, v, L]

    def fuse(self) -> None:
        """q_a, kv_a (and the indexer's key projection) all read x: one weight [q_lora + kv + index_dim, H]."""
        linears = [self.q_a_proj, self.kv_a_proj_with_mqa] + ([self.indexer.wk] if self.indexer is not None else [])
        fuse_linears(self, "in_proj_weight", *linears)

    def forward(self, x: torch.Tensor, ctx: LayerContext, prev_topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = x.shape[0]
        q_lora, kv_dim = self.q_a_proj.weight.shape[0], self.kv_lora_rank + self.rope
        proj = F.linear(x, _fused(self, "in_proj_weight"))
        qr = self.q_a_layernorm(proj[:, :q_lora])
        q = self.q_b_proj(qr).view(num_tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
        q_rope = rope_interleaved(q_rope, ctx.cos.unsqueeze(1), ctx.sin.unsqueeze(1))

        kv = proj[:, q_lora:q_lora + kv_dim]
        latent = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        k_rope = rope_interleaved(kv[:, self.kv_lora_rank :], ctx.cos, ctx.sin)
        ctx.attn.store_kv(self.layer_id, ctx.batch, torch.cat([latent, k_rope], dim=-1))

        if self.computes_topk or prev_topk is None:
            if self.indexer is None:
                raise RuntimeError(
                    f"layer {self.layer_id} shares the previous layer's top-k but was handed none"
                )
            topk = self.indexer(self.layer_id, x, qr, proj[:, q_lora + kv_dim:], ctx)
        else:
            topk = prev_topk

        w_uk, w_uv = self._kv_b_halves()
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        q_full = torch.cat([q_latent, q_rope], dim=-1)
        o_latent = ctx.attn.sparse_mla(self.layer_id, q_full, topk, self.softmax_scale, self.kv_lora_rank)
        o = torch.einsum("thl,hvl->thv", o_latent, w_uv).reshape(num_tokens, self.num_heads * self.v_dim)
        return self.o_proj(o), topk


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def fuse(self) -> None:
        fuse_linears(self, "gate_up_weight", self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, _fused(self, "gate_up_weight")).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Grouped sigmoid routing with a correction bias used for choice only (fp32)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.n_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.n_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(self.n_experts // self.n_group, 1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class Experts(nn.Module):
    """The routed experts, stacked: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I].

    FP8 models add gate_up_proj_scale_inv / down_proj_scale_inv (fp32, one per 128x128 block). Every
    token count goes through one fused MoE op (minidsa.kernels.fused_moe): tokens sorted per expert,
    grouped GEMMs that read only the chosen experts (Triton on CUDA, the torch reference on CPU).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.minidsa.fused_moe(x, ids, weights, self.gate_up_proj, self.down_proj,
                                           getattr(self, "gate_up_proj_scale_inv", None),
                                           getattr(self, "down_proj_scale_inv", None))


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        y = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dense: bool, has_indexer: bool, computes_topk: bool):
        super().__init__()
        self.self_attn = MLAttention(config, layer_id, has_indexer, computes_topk)
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if dense else MoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: LayerContext, prev_topk: torch.Tensor | None):
        a, topk = self.self_attn(self.input_layernorm(h), ctx, prev_topk)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, topk


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
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = []
        for i in range(config.num_hidden_layers):
            full = config.indexer_full[i]
            layers.append(DecoderLayer(config, i, config.dense_layers[i], has_indexer=full, computes_topk=full))
        for j in range(config.num_nextn_predict_layers):
            layers.append(MTPLayer(config, config.num_hidden_layers + j))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


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
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)

    @torch.no_grad()
    def fuse_projections(self) -> "DeepseekV32ForCausalLM":
        """Fuse projections that share an input (see `fuse_linears`); once, after the weights are final."""
        for mod in self.modules():
            if isinstance(mod, (MLAttention, MLP)):
                mod.fuse()
        return self

    @property
    def main_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[: self.config.num_hidden_layers])

    @property
    def mtp_layer(self) -> MTPLayer | None:
        n = self.config.num_hidden_layers
        return self.model.layers[n] if len(self.model.layers) > n else None

    def _context(self, batch: ForwardBatch, attn: DSABackend) -> LayerContext:
        cos, sin = self.rotary.cos_sin(batch.positions)
        return LayerContext(batch=batch, attn=attn, cos=cos, sin=sin)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def forward(self, batch: ForwardBatch, attn: DSABackend) -> ModelOutput:
        ctx = self._context(batch, attn)
        h = self.model.embed_tokens(batch.input_ids)
        topk = None
        for layer in self.main_layers:
            h, topk = layer(h, ctx, topk)
        normed = self.model.norm(h[batch.logits_indices])
        return ModelOutput(hidden=h, logits=self.logits(normed), topk=topk)

    def forward_mtp(self, batch: ForwardBatch, attn: DSABackend, hidden_prev: torch.Tensor,
                    prev_topk: torch.Tensor | None = None) -> ModelOutput:
        """Draft forward: batch.input_ids are the *next* tokens, hidden_prev the states at the same rows."""
        mtp = self.mtp_layer
        if mtp is None:
            raise RuntimeError("this checkpoint has no MTP (nextn) layer (num_nextn_predict_layers = 0)")
        ctx = self._context(batch, attn)
        e = mtp.enorm(self.model.embed_tokens(batch.input_ids))
        h = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden_prev)], dim=-1))
        h, topk = mtp(h, ctx, prev_topk)
        normed = mtp.shared_head.norm(h[batch.logits_indices])
        return ModelOutput(hidden=h, logits=self.logits(normed), topk=topk)
