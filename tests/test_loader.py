"""Checkpoint loading: shards, fp8 block-scaled weights, MTP layer, clear errors."""

from __future__ import annotations

import os

import pytest
import torch

from hf_tiny import build_hf, rewrite_checkpoint, save_hf
from harness import PagedDriver
from minidsa.config import ModelConfig
from minidsa.kernels.fp8 import FP8_BLOCK
from minidsa.kernels.fp8 import dequant_block as dequant_fp8_block
from minidsa.models.loader import CheckpointError, build_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, kw = build_hf("glm_moe_dsa", seed=3)
    return save_hf(hf, kw, str(tmp_path_factory.mktemp("src")))


def load(path, dtype=torch.float32, quantization="auto"):
    config = ModelConfig.from_pretrained(path)
    return build_model(config, path, dtype, torch.device("cpu"), progress=False, quantization=quantization), config


def prefill_logits(model, config, tokens):
    driver = PagedDriver(model, config)
    driver.add(tokens, reserve=0)
    logits = driver.prefill([0], logits="all")[0][1].logits
    driver.release_all()
    return logits


def to_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(br * FP8_BLOCK, bc * FP8_BLOCK)
    return q[:rows, :cols].contiguous(), scale.float()


def test_sharded_checkpoint_with_index_loads_identically(checkpoint, tmp_path):
    path = rewrite_checkpoint(checkpoint, str(tmp_path / "sharded"), lambda t: t, shards=3)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    a, config = load(checkpoint)
    b, _ = load(path)
    tokens = list(range(3, 40))
    assert torch.equal(prefill_logits(a, config, tokens), prefill_logits(b, config, tokens))


def test_fp8_block_scaled_checkpoint_matches_its_source(checkpoint, tmp_path):
    quantized = {}

    def quantize(tensors):
        out = {}
        for name, w in tensors.items():
            if name.endswith("proj.weight") and w.dim() == 2 and "indexer" not in name:
                q, s = to_fp8_blocks(w.float())
                out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, s
                quantized[name] = dequant_fp8_block(q, s)
            else:
                out[name] = w
        return out

    path = rewrite_checkpoint(checkpoint, str(tmp_path / "fp8"), quantize, shards=2)
    src, config = load(checkpoint)
    fp8, _ = load(path, quantization="none")  # dequantised at load (test_fp8.py: kept FP8)
    assert len(quantized) > 20
    params = dict(fp8.named_parameters())
    # Every quantised tensor is dequantised exactly (block indexing right, including partial blocks).
    for name, deq in quantized.items():
        if ".experts." in name:
            continue
        assert torch.equal(params[name], deq), name
    # The fp8 model computes exactly what the dequantised weights compute...
    deq_path = rewrite_checkpoint(checkpoint, str(tmp_path / "deq"), lambda t: {**t, **quantized})
    deq, _ = load(deq_path)
    tokens = list(range(5, 45))
    a, b, c = prefill_logits(src, config, tokens), prefill_logits(fp8, config, tokens), prefill_logits(deq, config, tokens)
    assert (b - c).abs().max() < 1e-5
    # ...and stays near its source (a random tiny net amplifies e4m3's ~6% per-weight error).
    assert (a - b).norm() / a.norm() < 0.5


def test_missing_tensor_is_named(checkpoint, tmp_path):
    victim = "model.layers.2.self_attn.kv_b_proj.weight"
    path = rewrite_checkpoint(checkpoint, str(tmp_path / "missing"), lambda t: {k: v for k, v in t.items() if k != victim})
    with pytest.raises(CheckpointError, match=r"missing 1 tensors: model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        load(path)
    expert = "model.layers.1.mlp.experts.5.up_proj.weight"
    path = rewrite_checkpoint(checkpoint, str(tmp_path / "missing_expert"), lambda t: {k: v for k, v in t.items() if k != expert})
    with pytest.raises(CheckpointError, match=expert.replace(".", r"\.")):
        load(path)


def test_unexpected_tensor_is_named_and_shared_layer_indexer_is_ignored(checkpoint, tmp_path):
    config = ModelConfig.from_pretrained(checkpoint)
    shared = next(i for i, f in enumerate(config.indexer_full) if not f)

    def add_shared_indexer(t):
        t = dict(t)
        t[f"model.layers.{shared}.self_attn.indexer.wk.weight"] = torch.zeros(config.index_head_dim, config.hidden_size)
        return t

    load(rewrite_checkpoint(checkpoint, str(tmp_path / "shared_extra"), add_shared_indexer))  # ignored with a note

    def add_junk(t):
        return {**t, "model.layers.0.self_attn.surprise.weight": torch.zeros(2)}

    with pytest.raises(CheckpointError, match=r"unexpected 1 tensors: model\.layers\.0\.self_attn\.surprise\.weight"):
        load(rewrite_checkpoint(checkpoint, str(tmp_path / "junk"), add_junk))


def test_mtp_layer_loads_from_nextn_position(checkpoint, tmp_path):
    config = ModelConfig.from_pretrained(checkpoint)
    n = config.num_hidden_layers
    model, _ = load(checkpoint)
    # A MoE layer with an indexer has exactly the nextn block's tensors.
    layer = model.model.layers[max(i for i in range(n) if config.indexer_full[i] and not config.dense_layers[i])]
    g = torch.Generator().manual_seed(0)
    extra = {f"model.layers.{n}.{k}": torch.randn(v.shape, generator=g) * 0.1 for k, v in layer.state_dict().items()}
    h = config.hidden_size
    for k, shape in {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                     "shared_head.norm.weight": (h,), "embed_tokens.weight": (config.vocab_size, h),
                     "shared_head.head.weight": (config.vocab_size, h)}.items():
        extra[f"model.layers.{n}.{k}"] = torch.randn(shape, generator=g)
    path = rewrite_checkpoint(checkpoint, str(tmp_path / "mtp"), lambda t: {**t, **extra}, shards=2,
                   config_update={"num_nextn_predict_layers": 1})
    mtp_model, mtp_config = load(path)
    assert mtp_config.num_nextn_predict_layers == 1
    assert torch.equal(mtp_model.mtp_layer.eh_proj.weight, extra[f"model.layers.{n}.eh_proj.weight"])
    # Without the nextn tensors the same config is an error naming them.
    path = rewrite_checkpoint(checkpoint, str(tmp_path / "mtp_missing"), lambda t: t, config_update={"num_nextn_predict_layers": 1})
    with pytest.raises(CheckpointError, match=rf"model\.layers\.{n}\.\* \(the whole layer \(the MTP / nextn layer\)\)"):
        load(path)


def test_bf16_load_keeps_router_bias_fp32(checkpoint):
    model, _ = load(checkpoint, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_weights_read_in_fp32_are_stored_in_fp32_with_the_checkpoints_values(checkpoint):
    """The router's gate and the indexer's head weights are only read in fp32: stored so, no step casts them. Loaded
    or drawn at random, they hold the serving dtype's values, as when they were stored in it (this checkpoint ships
    them in fp32: rounded to bf16), and the memory estimate counts them in fp32."""
    from safetensors.torch import load_file

    from minidsa.models.deepseek_v32 import DeepseekV32ForCausalLM
    from minidsa.models.loader import serving_dtypes_

    model, config = load(checkpoint, torch.bfloat16)
    gate = model.model.layers[1].mlp.gate.weight
    proj = model.model.layers[0].self_attn.indexer.weights_proj.weight
    assert gate.dtype == proj.dtype == torch.float32
    shipped = {}
    for f in sorted(os.listdir(checkpoint)):
        if f.endswith(".safetensors"):
            shipped.update(load_file(os.path.join(checkpoint, f)))
    assert torch.equal(gate, shipped["model.layers.1.mlp.gate.weight"].bfloat16().float())
    with torch.device("meta"):  # what exec.memory.weight_bytes counts
        counted = DeepseekV32ForCausalLM(config)
    serving_dtypes_(counted, torch.bfloat16)
    assert counted.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert counted.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert counted.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16

    drawn = build_model(config, None, torch.bfloat16, torch.device("cpu"), seed=4, progress=False)
    gate = drawn.model.layers[1].mlp.gate.weight
    assert gate.dtype == torch.float32 and torch.equal(gate, gate.bfloat16().float()) and gate.abs().sum() > 0
