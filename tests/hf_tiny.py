"""Tiny random checkpoints built with transformers (the oracle), saved to disk."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

ROPE_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
    "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
}


def tiny_kwargs(arch: str, **over) -> dict:
    kw = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=24, num_experts_per_tok=2,
        first_k_dense_replace=1, index_topk=12, index_head_dim=32, index_n_heads=16, max_position_embeddings=512,
        initializer_range=0.1, rope_parameters=dict(ROPE_YARN), routed_scaling_factor=2.0,
    )
    if arch == "deepseek_v32":
        kw.update(n_group=4, topk_group=2)
    else:
        kw.update(n_group=1, topk_group=1, index_topk_freq=2, index_skip_topk_offset=1)
    kw.update(over)
    return kw


def build_hf(arch: str, seed: int = 0, **over):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    kw = tiny_kwargs(arch, **over)
    if arch == "deepseek_v32":
        model = DeepseekV32ForCausalLM(DeepseekV32Config(**kw))
    else:
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**kw))
    with torch.no_grad():  # HF zero-inits these; random values exercise them
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.2)
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("k_norm.bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model.eval(), kw


def save_hf(model, kw: dict, path: str) -> str:
    model.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    # Sharing-schedule keys travel only as kwargs in some releases: keep them in the raw config.
    for key in ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern"):
        if key in kw:
            cfg[key] = kw[key]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def rewrite_checkpoint(src: str, dst: str, transform, shards: int = 1, config_update: dict | None = None) -> str:
    """Copy a checkpoint, passing its tensors through `transform(dict) -> dict`, split in `shards` files."""
    os.makedirs(dst, exist_ok=True)
    tensors = transform(load_file(os.path.join(src, "model.safetensors")))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_update or {})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(dst, fname))
        weight_map.update({n: fname for n in part})
    if shards > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def save_hf_with_mtp(arch: str, path: str, seed: int, **over) -> str:
    """A tiny HF checkpoint of `arch` plus random nextn-layer (MTP) weights: the block is a full (indexer) MoE
    layer's tensors redrawn, and the MTP-only enorm / hnorm / eh_proj / shared head norm."""
    hf, kw = build_hf(arch, seed=seed, **over)
    save_hf(hf, kw, path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    n, h = kw["num_hidden_layers"], kw["hidden_size"]
    g = torch.Generator().manual_seed(0)
    src = 2  # a full (indexer) MoE layer: same tensors as the nextn block
    for k, v in list(tensors.items()):
        if k.startswith(f"model.layers.{src}."):
            tensors[k.replace(f"layers.{src}.", f"layers.{n}.")] = torch.randn(v.shape, generator=g) * 0.1
    for k, shape in {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                     "shared_head.norm.weight": (h,)}.items():
        tensors[f"model.layers.{n}.{k}"] = torch.randn(shape, generator=g) * 0.1 + (1.0 if "norm" in k else 0.0)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path

