"""FP8 block-scaled linear layers: the GEMMs, FP8 checkpoints, quantisation at load, presets, random init.

Widths are small (hidden 256) but every FP8 dimension is cut in 128-blocks, partial ones included.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from hf_tiny import build_hf, rewrite_checkpoint, save_hf
from harness import PagedDriver, random_fp8_linear
from minidsa.config import ConfigError, EngineConfig, ModelConfig
from minidsa.kernels.fp8 import (FP8_DTYPE, dequant_block, quant_act_per_token_group, quant_block,
                                 w8a8_block_matmul_reference)
from minidsa.models.layers.linear import FusedLinear, Linear
from minidsa.models.deepseek_v32 import DeepseekV32ForCausalLM, Experts
from minidsa.models.loader import CheckpointError, build_model, init_random_weights, serving_dtypes_
from minidsa.common.presets import preset_config

WIDE = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=4, num_key_value_heads=4)


def _gemm_case(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    wq, ws = quant_block(w)
    x = torch.randn(m, k, generator=g) * 2
    return x, wq, ws


# ----------------------------------------------------------------------------- GEMMs
def test_reference_gemm_is_dequantised_math_on_quantised_activations():
    x, wq, ws = _gemm_case(7, 200, 300)
    y = w8a8_block_matmul_reference(x, wq, ws)
    xq, xs = quant_act_per_token_group(x)
    a = xq.float() * xs.repeat_interleave(128, 1)[:, :300]
    exact = a @ dequant_block(wq, ws).t()
    assert torch.allclose(y, exact, atol=1e-5, rtol=1e-5)
    # Against unquantised activations the only error is e4m3 rounding of x (3 mantissa bits): a few % of the norm.
    full = x @ dequant_block(wq, ws).t()
    assert (y - full).norm() / full.norm() < 0.05


@pytest.mark.parametrize("m,n,k,tiles", [
    (1, 256, 384, None),          # decode: fused activation quant
    (5, 200, 320, None),          # partial N and K blocks
    (33, 256, 256, None),
    (70, 320, 384, None),         # prefill: separate activation-quant kernel, 128x128 tiles
    (3, 192, 640, (16, 64, 3, True)),    # split-K (fp32 partials), uneven ranges
    (20, 130, 512, (32, 64, 2, False)),  # split-K on pre-quantised activations
])
def test_triton_gemm_matches_reference(m, n, k, tiles):
    from minidsa.kernels.fp8_gemm import GemmTiles, w8a8_block_gemm

    x, wq, ws = _gemm_case(m, n, k, seed=m)
    t = None if tiles is None else GemmTiles(tiles[0], tiles[1], tiles[2], tiles[3], 4, 2)
    y = w8a8_block_gemm(x, wq, ws, t)
    ref = w8a8_block_matmul_reference(x, wq, ws)
    # Same quantised operands, fp32 accumulation in another order.
    assert (y - ref).abs().max() <= 1e-4 * ref.abs().max()
    yb = w8a8_block_gemm(x.bfloat16(), wq, ws, t)
    assert yb.dtype == torch.bfloat16
    refb = w8a8_block_matmul_reference(x.bfloat16(), wq, ws)
    assert (yb.float() - refb.float()).abs().max() <= 2e-2 * refb.float().abs().max()


def test_split_k_ranges_are_added_in_k_order_in_the_kernel(monkeypatch):
    """The last K range to finish a tile adds every range's partial in K order (the same fp32 sum every run), and
    leaves the tile's arrival count at 0 for the next call; without counts (a CUDA graph captured before any were
    made) torch adds the partials, to the same values within rounding."""
    from minidsa.kernels import fp8_gemm
    from minidsa.kernels.fp8_gemm import GemmTiles, w8a8_block_gemm

    x, wq, ws = _gemm_case(3, 192, 640, seed=4)
    tiles = GemmTiles(16, 64, 3, True, 4, 2)  # 5 K blocks in ranges of 2, 2, 1
    y = w8a8_block_gemm(x, wq, ws, tiles)
    whole = GemmTiles(16, 64, 1, True, 4, 2)
    ranges = [w8a8_block_gemm(x[:, a:b].contiguous(), wq[:, a:b].contiguous(), ws[:, a // 128:-(-b // 128)], whole)
              for a, b in ((0, 256), (256, 512), (512, 640))]
    assert torch.equal(y, (ranges[0] + ranges[1]) + ranges[2])
    assert int(fp8_gemm.arrival_counts(x.device).abs().sum()) == 0
    assert torch.equal(w8a8_block_gemm(x, wq, ws, tiles), y)
    monkeypatch.setattr(fp8_gemm, "arrival_counts", lambda device: None)
    assert torch.allclose(w8a8_block_gemm(x, wq, ws, tiles), y, rtol=1e-6, atol=1e-6)


def test_triton_activation_quant_is_the_reference():
    from minidsa.kernels.fp8_gemm import quant_act

    x = torch.randn(19, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, 300)
    x[3] = 0.0
    q, s = quant_act(x)
    rq, rs = quant_act_per_token_group(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.float(), rq.float())  # the same e4m3 values (a tiny negative may round to +0 or -0)


def test_custom_op_serves_fp8_linear_in_the_model_layout():
    from minidsa.kernels import custom_ops  # noqa: F401

    x, wq, ws = _gemm_case(4, 256, 256)
    y = torch.ops.minidsa.fp8_linear(x, wq, ws, False)
    assert torch.allclose(y, w8a8_block_matmul_reference(x, wq, ws), atol=1e-4)


def test_fused_fp8_linear_pads_members_to_128_rows():
    g = torch.Generator().manual_seed(0)
    members = [random_fp8_linear(256, rows, g) for rows in (200, 32, 80)]  # q_a-, wk-, kv_a-like (odd height last)
    x = torch.randn(3, 256, generator=g)
    separate = [lin(x) for lin in members]
    fused = FusedLinear(*members)
    assert fused.weight.shape == (256 + 128 + 80, 256) and fused.weight_scale_inv.shape == (4, 2)
    for a, b in zip(fused(x), separate):
        assert torch.allclose(a, b, atol=1e-6)
    # Members' parameters are views into the fused weight: a load into one is seen by the fused GEMM.
    assert members[1].weight.data_ptr() == fused.weight[256:].data_ptr()


# ----------------------------------------------------------------------------- checkpoints
def _quantise_like_deepseek(tensors: dict, pow2_scale: bool = True, keep: tuple[str, ...] = ()) -> dict:
    """DeepSeek's FP8 layout: every projection e4m3 + weight_scale_inv; norms, embeddings, lm_head, router gate,
    indexer weights_proj and the correction bias as they were."""
    out = {}
    for name, w in tensors.items():
        high_precision = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "weights_proj") + keep
        if name.endswith(".weight") and w.dim() == 2 and not any(h in name for h in high_precision):
            q, s = quant_block(w.float(), pow2_scale=pow2_scale)
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q, s
        else:
            out[name] = w
    return out


def _dequantised(tensors: dict) -> dict:
    return {n: (dequant_block(w, tensors[n[: -len("weight")] + "weight_scale_inv"]) if w.dtype == FP8_DTYPE else w)
            for n, w in tensors.items() if not n.endswith("weight_scale_inv")}


def _write(src: str, dst: str, tensors: dict, config_update: dict | None = None) -> str:
    """A two-shard checkpoint (with its index) holding `tensors`, config.json from `src` updated."""
    return rewrite_checkpoint(src, dst, lambda _: tensors, shards=2, config_update=config_update)


FP8_QCONFIG = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(bf16-free fp32 source, its FP8 version as DeepSeek ships it, the FP8 values dequantised)."""
    hf, kw = build_hf("deepseek_v32", seed=5, initializer_range=0.05, **WIDE)
    root = tmp_path_factory.mktemp("fp8ckpt")
    src = save_hf(hf, kw, str(root / "src"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8 = _quantise_like_deepseek(tensors)
    return (src, _write(src, str(root / "fp8"), fp8, FP8_QCONFIG), _write(src, str(root / "deq"), _dequantised(fp8)),
            fp8)


def _load(path, quantization="auto"):
    config = ModelConfig.from_pretrained(path)
    return build_model(config, path, torch.float32, torch.device("cpu"), progress=False,
                       quantization=quantization), config


def _greedy(model, config, tokens, steps):
    """Prefill logits of every prompt position, then `steps` greedy tokens."""
    driver = PagedDriver(model, config)
    driver.add(tokens, reserve=steps)
    prefill = driver.prefill([0], logits="all")[0][1].logits
    out, nxt = [], int(prefill[-1].argmax())
    for _ in range(steps):
        out.append(nxt)
        nxt = int(driver.decode([0], [nxt]).logits[0].argmax())
    driver.release_all()
    return prefill, out


def test_fp8_checkpoint_loads_as_fp8_and_generates_what_its_dequantised_twin_does(checkpoints, monkeypatch):
    _, fp8_path, deq_path, stored = checkpoints
    fp8, config = _load(fp8_path)
    assert config.quantization == "fp8" and config.fp8_pow2_scales
    layer = fp8.model.layers[1]  # a MoE layer with an indexer
    attn = layer.self_attn
    for lin, name in [(attn.q_a_proj, "self_attn.q_a_proj"), (attn.o_proj, "self_attn.o_proj"),
                      (attn.indexer.wq_b, "self_attn.indexer.wq_b"), (layer.mlp.shared_experts.down_proj,
                                                                     "mlp.shared_experts.down_proj")]:
        assert lin.weight.dtype == FP8_DTYPE, name
        key = f"model.layers.1.{name}.weight"
        assert torch.equal(lin.weight.view(torch.uint8), stored[key].view(torch.uint8)), name
        assert torch.equal(lin.weight_scale_inv, stored[key[: -len("weight")] + "weight_scale_inv"]), name
    experts = layer.mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.down_proj.dtype == FP8_DTYPE
    assert experts.gate_up_proj_scale_inv.shape == (8, 2, 2) and experts.down_proj_scale_inv.shape == (8, 2, 1)
    up = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(experts.gate_up_proj[3, 128:].view(torch.uint8), stored[up].view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale_inv[3, 1:], stored[up[: -len("weight")] + "weight_scale_inv"])
    # Shipped high precision, or served dequantised (kv_b_proj: MLA absorption), as documented.
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.indexer.weights_proj.weight.dtype == torch.float32
    assert fp8.lm_head.weight.dtype == torch.float32 and layer.mlp.gate.weight.dtype == torch.float32
    # The fused input projection of an FP8 layer is FP8 too (q_a | wk padded to 128 rows | kv_a).
    assert attn.in_proj.weight.dtype == FP8_DTYPE and attn.in_proj.weight.shape[0] == 128 + 128 + 80

    twin, _ = _load(deq_path)
    assert twin.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.float32
    tokens = list(range(7, 47))
    a, a_tokens = _greedy(fp8, config, tokens, 8)
    # The twin holds the dequantised weights in fp32; w8a8 also rounds each projection's input to e4m3 per
    # token per 128 channels, so the twin gets the same rounding (a test-side patch of its projections).
    # Then the two compute the same numbers in another order: logits within 1e-4, the same greedy tokens.
    # (Without the activation rounding they differ by ~2.5% per projection, compounding to ~50% of the logits'
    # norm over this random 4-layer net: a tolerance that would hide a wrong block.)
    with monkeypatch.context() as mp:
        mp.setattr(Linear, "forward", _twin_linear_forward)
        mp.setattr(FusedLinear, "forward", _twin_fused_forward)
        mp.setattr(Experts, "forward", _twin_experts_forward)
        b, b_tokens = _greedy(twin, config, tokens, 8)
    assert (a - b).abs().max() < 1e-4 * b.abs().max()
    assert a_tokens == b_tokens


_linear_forward, _fused_forward = Linear.forward, FusedLinear.forward


def _act_rounded(x: torch.Tensor) -> torch.Tensor:
    q, s = quant_act_per_token_group(x.reshape(-1, x.shape[-1]))
    return (q.float() * s.repeat_interleave(128, 1)[:, : x.shape[-1]]).view(x.shape).to(x.dtype)


# The twin is high precision: its norms quantise nothing, so x_quantized is always None here.
def _twin_linear_forward(self, x, x_quantized=None):
    return _linear_forward(self, _act_rounded(x) if self.quantizable else x)


def _twin_fused_forward(self, x, x_quantized=None):
    return _fused_forward(self, _act_rounded(x))


def _twin_experts_forward(self, x, ids, weights, x_quantized=None, addend=None):
    """Each token's chosen experts one by one (dequantised weights), inputs of both GEMMs rounded as w8a8 does;
    plus the shared experts' output (`addend`), as the op adds it."""
    inter = self.gate_up_proj.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t]):
            gate_up = _act_rounded(x[t:t + 1]) @ self.gate_up_proj[e].T
            h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out[t] += w * (_act_rounded(h) @ self.down_proj[e].T)[0]
    return out if addend is None else out + addend


def test_quantization_fp8_quantises_a_bf16_checkpoint_at_load(checkpoints, tmp_path):
    src, _, _, _ = checkpoints
    model, config = _load(src, quantization="fp8")
    source = load_file(os.path.join(src, "model.safetensors"))
    lin = model.model.layers[2].self_attn.q_b_proj
    assert lin.weight.dtype == FP8_DTYPE
    q, s = quant_block(source["model.layers.2.self_attn.q_b_proj.weight"].float())
    assert torch.equal(lin.weight_scale_inv, s) and torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8))
    assert model.model.layers[2].mlp.experts.down_proj.dtype == FP8_DTYPE
    plain, _ = _load(src)  # auto: as stored, high precision
    assert plain.model.layers[2].self_attn.q_b_proj.weight.dtype == torch.float32
    # Quantising at load is the same model as a checkpoint shipped quantised the same way (fp32 scales; kv_b_proj,
    # which the model serves in high precision, is not quantised at load, so it is shipped unquantised here).
    shipped_tensors = _quantise_like_deepseek(source, pow2_scale=False, keep=("kv_b_proj",))
    qconfig = {"quantization_config": {k: v for k, v in FP8_QCONFIG["quantization_config"].items() if k != "scale_fmt"}}
    shipped, _ = _load(_write(src, str(tmp_path / "shipped"), shipped_tensors, qconfig))
    tokens = list(range(3, 30))
    a, a_tokens = _greedy(model, config, tokens, 4)
    b, b_tokens = _greedy(shipped, config, tokens, 4)
    assert torch.equal(a, b) and a_tokens == b_tokens


def test_fp8_checkpoint_without_a_scale_names_it(checkpoints, tmp_path):
    src, fp8_path, _, stored = checkpoints
    victim = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    path = _write(src, str(tmp_path / "noscale"), {k: v for k, v in stored.items() if k != victim}, FP8_QCONFIG)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        _load(path)
    wrong = dict(stored)
    wrong[victim] = torch.ones(3, 3)
    path = _write(src, str(tmp_path / "badscale"), wrong, FP8_QCONFIG)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight's weight_scale_inv has shape \(3, 3\)"):
        _load(path)


def test_quantization_config_and_engine_argument_are_validated():
    raw = preset_config("bench-dsv32")
    raw["quantization_config"] = {**raw["quantization_config"], "weight_block_size": [64, 64]}
    with pytest.raises(ConfigError, match="quantization_config.weight_block_size"):
        ModelConfig.from_dict(raw)
    raw["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(ConfigError, match="quant_method"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="int4").validate()
    with pytest.raises(ValueError, match="positive integer"):
        preset_config("bench-glm5:zero")


# ----------------------------------------------------------------------------- presets
def _count(config: ModelConfig) -> tuple[int, int, int]:
    """(main-model parameters, MTP-layer parameters, bytes as served) of a meta-device build."""
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    model.make_fp8_()
    serving_dtypes_(model, torch.bfloat16)
    n = config.num_hidden_layers
    main = mtp = nbytes = 0
    for name, p in model.named_parameters():
        nbytes += p.numel() * p.element_size()
        if name.endswith("_scale_inv"):
            continue
        if name.startswith(f"model.layers.{n}."):
            mtp += p.numel()
        else:
            main += p.numel()
    return main, mtp, nbytes


def test_bench_presets_carry_the_real_models_fields():
    v = ModelConfig.from_dict(preset_config("bench-dsv32:61"))
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.q_lora_rank, v.kv_lora_rank) == \
        (7168, 61, 128, 1536, 512)
    assert (v.qk_nope_head_dim, v.qk_rope_head_dim, v.v_head_dim) == (128, 64, 128)
    assert (v.index_n_heads, v.index_head_dim, v.index_topk) == (64, 128, 2048)
    assert (v.n_routed_experts, v.num_experts_per_tok, v.n_shared_experts, v.moe_intermediate_size) == (256, 8, 1, 2048)
    assert v.dense_layers[:4] == (True, True, True, False) and v.intermediate_size == 18432
    assert (v.vocab_size, v.n_group, v.topk_group, v.routed_scaling_factor) == (129280, 8, 4, 2.5)
    assert (v.rope.rope_type, v.rope.factor, v.rope.original_max_position_embeddings, v.rope.theta) == \
        ("yarn", 40.0, 4096, 10000.0)
    assert (v.rope.mscale, v.rope.mscale_all_dim) == (1.0, 1.0)
    assert (v.quantization, v.fp8_pow2_scales) == ("fp8", True)
    assert all(v.indexer_full)
    g = ModelConfig.from_dict(preset_config("bench-glm5:78"))
    assert (g.hidden_size, g.num_hidden_layers, g.num_attention_heads, g.q_lora_rank, g.kv_lora_rank) == \
        (6144, 78, 64, 2048, 512)
    assert (g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim, g.index_n_heads, g.index_head_dim) == \
        (192, 64, 256, 32, 128)
    assert (g.n_routed_experts, g.n_group, g.topk_group, g.intermediate_size, g.vocab_size) == (256, 1, 1, 12288, 154880)
    assert g.dense_layers[:4] == (True, True, True, False) and g.rope.theta == 1e6 and g.quantization == "fp8"
    assert sum(g.indexer_full) == 21 and g.indexer_full[:8] == (True, True, True, False, False, False, True, False)
    # Without a count the bench presets fit one GPU: 3 dense + 1 MoE layer (+ MTP); the tiny default is unchanged.
    short = ModelConfig.from_dict(preset_config("bench-dsv32"))
    assert short.num_hidden_layers == 4 and short.dense_layers == (True, True, True, False)
    assert ModelConfig.from_dict(preset_config("tiny")).num_hidden_layers == 3


def test_full_depth_presets_have_the_published_parameter_counts():
    # DeepSeek-V3.2: 671B main-model parameters (+ the indexers, ~0.9B; here 671.9B) and ~14B for the MTP
    # layer (its own copies of embedding and head included; here 11.6B without them), ~690 GB of FP8 shards
    # (here 686.7 GB as served: kv_b_proj in bf16); GLM-5: 744B (here 743.4B + 10.0B MTP). Meta device: no memory.
    main, mtp, nbytes = _count(ModelConfig.from_dict(preset_config("bench-dsv32:61")))
    assert 671e9 < main < 673e9 and 11e9 < mtp < 15e9, (main, mtp)
    assert 680e9 < nbytes < 700e9, nbytes
    main, mtp, nbytes = _count(ModelConfig.from_dict(preset_config("bench-glm5:78")))
    assert 740e9 < main < 748e9 and 9e9 < mtp < 11e9, (main, mtp)


# ----------------------------------------------------------------------------- random init
def _small_fp8_preset() -> ModelConfig:
    raw = preset_config("bench-dsv32:4")
    raw.update(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32, n_routed_experts=16, n_group=4, topk_group=2, index_n_heads=16, index_head_dim=32,
               index_topk=16, vocab_size=512)
    return ModelConfig.from_dict(raw)


class _LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, as ops create and free it: the peak, and the largest storage freed again."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest_freed = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes
        self.largest_freed = max(self.largest_freed, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()  # one Python object per storage while it lives (preserved)
            if getattr(storage, "_tracked", False):
                continue  # an input written in place, or a view
            storage._tracked = True
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, storage.nbytes())
        return out


def test_random_fp8_init_peaks_at_the_final_weights_plus_one_chunk():
    config = _small_fp8_preset()
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    model.make_fp8_(pow2_scale=True)
    serving_dtypes_(model, torch.bfloat16)
    chunk = 128 * 256  # values drawn at a time: one 128-row block of a hidden-wide weight
    with _LiveBytes() as mem:
        init_random_weights(model, seed=1, std=0.02, device=torch.device("cpu"), chunk_elems=chunk)
    gc.collect()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    # Everything still alive is the model; the temporaries were one chunk's (fp32 values, quant_block's padded
    # copy and its e4m3 result): no full-size high-precision copy of an FP8 weight existed.
    assert mem.live == weights
    # (a chunk is whole 128-row blocks: at least 128 rows of the widest weight, eh_proj's 2 x hidden columns)
    chunk_bytes = 4 * max(chunk, 128 * 2 * config.hidden_size)
    assert mem.largest_freed <= chunk_bytes
    # The peak is the weights plus a few chunk temporaries: at real sizes (INIT_CHUNK_ELEMS = 16M values,
    # ~0.25 GB against ~29 GB of bench-dsv32 weights) about 1% over; tests/gpu/test_fp8_gpu.py measures it.
    assert mem.peak - weights <= 4 * chunk_bytes, (mem.peak, weights)
    experts = model.model.layers[3].mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.gate_up_proj.device.type == "cpu"
    assert model.lm_head.weight.dtype == torch.bfloat16
    # ue8m0 scales are powers of two, and the values are what the std asks for.
    s = experts.gate_up_proj_scale_inv
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    w = dequant_block(experts.gate_up_proj, s)
    assert 0.017 < w.std() < 0.023


def test_random_init_is_deterministic_in_the_seed():
    config = _small_fp8_preset()
    a = build_model(config, None, torch.bfloat16, torch.device("cpu"), seed=3)
    b = build_model(config, None, torch.bfloat16, torch.device("cpu"), seed=3)
    c = build_model(config, None, torch.bfloat16, torch.device("cpu"), seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)
    key = "model.layers.3.mlp.experts.down_proj"
    assert not torch.equal(sa[key].view(torch.uint8), sc[key].view(torch.uint8))
    assert isinstance(a.model.layers[3].mlp.experts, Experts) and a.model.layers[3].mlp.experts.is_fp8


def test_llm_serves_an_fp8_checkpoint(checkpoints):
    from minidsa import LLM, SamplingParams

    _, fp8_path, _, _ = checkpoints
    llm = LLM(model=fp8_path, device="cpu", dtype="float32", progress=False)
    assert llm.engine.runner.model.model.layers[1].self_attn.o_proj.is_fp8
    out = llm.generate([[5, 6, 7, 8, 9, 10] * 3], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_fp8_projections_trace_without_graph_breaks():
    # The Triton GEMM is an opaque custom op (fake impl gives the shape): Dynamo traces FP8 layers whole.
    from minidsa.kernels import custom_ops  # noqa: F401

    g = torch.Generator().manual_seed(0)
    members = [random_fp8_linear(256, rows, g, "triton") for rows in (128, 80)]
    fused = FusedLinear(*members)
    x = torch.randn(3, 256, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: fused(t)[1] + members[1](t), fullgraph=True, backend="eager")
    assert torch.allclose(compiled(x), 2 * members[1](x), atol=1e-5)


def test_quantization_flag():
    import argparse

    from minidsa.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    assert engine_config_from_args(parser.parse_args([])).quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])


def test_deepgemm_weights_are_what_runs_each_fused_projection_once():
    """The start-up DeepGEMM warm-up takes the weights that run: a FusedLinear's, not its members' views."""
    from minidsa.models.layers.linear import FusedLinear, Linear, deepgemm_weights, set_gemm

    q_a, kv_a, o = Linear(256, 128), Linear(256, 128), Linear(256, 64)
    plain = Linear(256, 64)  # high precision: not DeepGEMM's
    for lin in (q_a, kv_a, o):
        lin.make_fp8_()
    model = torch.nn.ModuleDict(dict(q_a=q_a, kv_a=kv_a, o=o, plain=plain, fused=FusedLinear(q_a, kv_a)))
    assert deepgemm_weights(model) == []  # no module was given to DeepGEMM
    set_gemm(model, "deepgemm")
    assert sorted(tuple(w.shape) for w, _ in deepgemm_weights(model)) == [(64, 256), (256, 256)]


def test_deepgemm_start_up_leaves_out_a_layer_that_never_runs():
    """Without speculation the engine hands the MTP layer as `skip`: the DeepGEMM warm-up then takes no weight of it
    (its eh_proj shape, its unfused q_b / wq_b) and no expert layer of it, and every weight of the main layers."""
    from minidsa.models.deepseek_v32 import deepgemm_experts
    from minidsa.models.layers.linear import deepgemm_weights, set_gemm

    model = build_model(_small_fp8_preset(), None, torch.bfloat16, torch.device("cpu"), seed=3)
    set_gemm(model, "deepgemm")
    mtp = model.mtp_layer
    in_mtp = {p.untyped_storage().data_ptr() for p in mtp.parameters()}
    every = deepgemm_weights(model)
    main = deepgemm_weights(model, skip=mtp)
    assert {w.untyped_storage().data_ptr() for w, _ in main}.isdisjoint(in_mtp)
    assert [w for w, _ in every if w.untyped_storage().data_ptr() not in in_mtp] == [w for w, _ in main]
    eh_shape = tuple(mtp.eh_proj.weight.shape)
    assert eh_shape in {tuple(w.shape) for w, _ in every} and eh_shape not in {tuple(w.shape) for w, _ in main}
    assert len(deepgemm_experts(model, skip=mtp)) == len(deepgemm_experts(model)) - 1


_COMPILE_GEMM_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minidsa.kernels import fp8_gemm
sig = {"a_ptr": "*bf16", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "out_ptr": "*bf16",
       "part_ptr": "*fp32", "arrivals_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
       "stride_asm": "i32", "stride_ask": "i32", "stride_wn": "i32", "stride_wsn": "i32", "stride_om": "i32",
       "num_kb": "i32", "kb_per_split": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
       "FUSE_ACT_QUANT": "constexpr", "EMULATE_CAST": "constexpr", "NUM_STAGES": "constexpr", "SPLIT_K": "constexpr",
       "REDUCE_IN_KERNEL": "constexpr", "PDL": "constexpr"}
for fuse in (True, False):
    for split, in_kernel in ((False, False), (True, False), (True, True)):
        src = ASTSource(fp8_gemm._w8a8_gemm_kernel, dict(sig, a_ptr="*bf16" if fuse else "*fp8e4nv"), constexprs={
            "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "FUSE_ACT_QUANT": fuse, "EMULATE_CAST": False,
            "NUM_STAGES": 3, "SPLIT_K": split, "REDUCE_IN_KERNEL": in_kernel, "PDL": True})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        if in_kernel:  # the arrival count orders the partials' stores and loads device-wide
            assert "atom.global.gpu.acq_rel.add" in ptx and "bar.sync" in ptx, ptx[-2000:]
src = ASTSource(fp8_gemm._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32",
                "K": "i32", "stride_xm": "i32", "stride_qm": "i32", "stride_sm": "i32", "stride_sk": "i32",
                "ROWS": "constexpr", "BLOCK_K": "constexpr", "EMULATE_CAST": "constexpr", "PDL": "constexpr"},
                constexprs={"ROWS": 16, "BLOCK_K": 128, "EMULATE_CAST": False, "PDL": True})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
assert "div.rn.f32" in ptx and "fma.rn.f32" in ptx  # the exact reciprocal per row and the quotient's correction
print("compiled")
"""


def test_fp8_gemm_and_quant_kernels_compile_for_h100():
    """The GEMM in each mode (quantising inside or reading e4m3, split-K summed by torch or in the kernel) and the
    activation quantisation, compiled for sm_90 without a GPU: what only Triton's compiler refuses fails here."""
    from triton_interp import compile_for_h100

    compile_for_h100(_COMPILE_GEMM_FOR_H100, "_w8a8_gemm_kernel")
