"""ModelConfig is read from the raw config.json; every rejection names its field."""

from __future__ import annotations

import json

import pytest

from hf_tiny import tiny_kwargs
from minidsa.config import ConfigError, EngineConfig, ModelConfig, indexer_schedule_from_freq


def raw(arch="glm_moe_dsa", **over) -> dict:
    kw = tiny_kwargs(arch)
    kw["architectures"] = ["GlmMoeDsaForCausalLM" if arch == "glm_moe_dsa" else "DeepseekV32ForCausalLM"]
    kw.update(over)
    return kw


def test_freq4_offset3_schedule_over_78_layers():
    sched = indexer_schedule_from_freq(78, 4, 3)
    full = [i for i, f in enumerate(sched) if f]
    assert len(full) == 21
    assert full[:6] == [0, 1, 2, 6, 10, 14]
    cfg = ModelConfig.from_dict(raw(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3))
    assert cfg.indexer_full == sched


@pytest.mark.smoke
def test_offset_zero_is_a_clear_error():
    with pytest.raises(ConfigError, match="index_skip_topk_offset.*layer 0"):
        ModelConfig.from_dict(raw(index_topk_freq=2, index_skip_topk_offset=0))


def test_freq_without_offset_uses_historic_rule():
    cfg = ModelConfig.from_dict({k: v for k, v in raw(index_topk_freq=2).items() if k != "index_skip_topk_offset"})
    assert cfg.indexer_full == (True, True, False, True)  # max(i - 1, 0) % 2 == 0


def test_pattern_and_explicit_types():
    assert ModelConfig.from_dict(raw(index_topk_pattern="FSFS")).indexer_full == (True, False, True, False)
    cfg = ModelConfig.from_dict(raw(indexer_types=["full", "shared", "shared", "full"]))
    assert cfg.indexer_full == (True, False, False, True)
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        ModelConfig.from_dict(raw(index_topk_pattern="FXFS"))
    with pytest.raises(ConfigError, match="layer 0"):
        ModelConfig.from_dict(raw(index_topk_pattern="SFFF"))


def test_head_dim_does_not_override_rope_dim():
    cfg = ModelConfig.from_dict(raw(head_dim=192, qk_rope_head_dim=64, qk_nope_head_dim=192, index_head_dim=128))
    assert cfg.qk_rope_head_dim == 64
    assert cfg.kv_cache_dim == cfg.kv_lora_rank + 64


def test_legacy_rope_scaling_equals_rope_parameters():
    modern = ModelConfig.from_dict(raw())
    params = dict(tiny_kwargs("glm_moe_dsa")["rope_parameters"])
    theta = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    legacy_raw = {k: v for k, v in raw().items() if k != "rope_parameters"}
    legacy = ModelConfig.from_dict({**legacy_raw, "rope_scaling": params, "rope_theta": theta})
    assert legacy.rope == modern.rope
    assert modern.rope.rope_type == "yarn" and modern.softmax_scale != modern.qk_head_dim ** -0.5


def test_indexer_rope_interleave_defaults_per_architecture():
    assert ModelConfig.from_dict(raw("glm_moe_dsa")).indexer_rope_interleave is True
    assert ModelConfig.from_dict(raw("deepseek_v32")).indexer_rope_interleave is False
    assert ModelConfig.from_dict(raw("glm_moe_dsa", indexer_rope_interleave=False)).indexer_rope_interleave is False


@pytest.mark.parametrize("over,field", [
    ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"kv_lora_rank": "512"}, "kv_lora_rank"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"indexer_types": ["full", "shared"]}, "indexer_types"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
])
@pytest.mark.smoke
def test_rejected_configs_name_the_field(over, field):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw(**over))
    assert e.value.field_name == field
    assert field in str(e.value)


def test_from_pretrained_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw("deepseek_v32", num_nextn_predict_layers=1)))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.architecture == "deepseek_v32" and cfg.num_layers_with_mtp == cfg.num_hidden_layers + 1
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("over,field", [
    ({"page_size": 3}, "page_size"),
    ({"max_running_requests": 0}, "max_running_requests"),
    ({"dtype": "float64x"}, "dtype"),
    ({"indexer_cache_dtype": "int4"}, "indexer_cache_dtype"),
    ({"max_mixed_prefill_tokens": 0}, "max_mixed_prefill_tokens"),
    ({"max_mixed_prefill_tokens": -8}, "max_mixed_prefill_tokens"),
    ({"max_mixed_prefill_tokens": True}, "max_mixed_prefill_tokens"),
    ({"max_mixed_prefill_tokens": 512.0}, "max_mixed_prefill_tokens"),
])
@pytest.mark.smoke
def test_engine_config_validation(over, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**over).validate()


def test_more_ranks_than_visible_gpus_is_refused_by_resolve(monkeypatch):
    """--tp larger than the visible GPUs: a ConfigError from resolve, before any rank starts (its GPU count is
    faked here: the check asks torch.cuda only)."""
    import torch

    from minidsa.config import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device in ("cuda", "auto"):
        with pytest.raises(ConfigError, match=r"'tensor_parallel_size': 2 needs 2 GPUs, 1 visible"):
            resolve(EngineConfig(device=device, tensor_parallel_size=2))
    assert resolve(EngineConfig(device="cuda")).args.tensor_parallel_size == 1
    assert resolve(EngineConfig(device="cpu", tensor_parallel_size=2)).args.device == "cpu"  # CPU ranks share it
