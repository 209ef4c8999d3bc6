"""minidsa's model computes what transformers computes, through the paged cache.

Tiny random checkpoints are built with transformers (the oracle), saved, and
loaded by minidsa. Logits are compared in fp32 at prefill and at every step
of a greedy decode, and the top-k index *sets* per layer are compared with
a forward hook on `*.self_attn.indexer`. Prompts are longer than
`index_topk`, so sparsity is real.
"""

from __future__ import annotations

import pytest
import torch

from hf_tiny import build_hf, save_hf
from harness import PagedDriver
from minidsa.config import ModelConfig
from minidsa.models.loader import build_model

# name -> (architecture, overrides of tests/hf_tiny.tiny_kwargs)
MODELS = {
    "deepseek_v32": ("deepseek_v32", {}),
    "glm_moe_dsa": ("glm_moe_dsa", {}),
    # the real models' routing: 256 experts, top-8 among 4 of 8 groups (small widths)
    "deepseek_v32_256_experts": ("deepseek_v32", dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                                                      topk_group=4)),
}
PROMPT_LENS = (21, 34, 17)
DECODE_STEPS = 16
ATOL = 1e-4


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    hf, kw = build_hf(arch, seed=1, **overrides)
    path = save_hf(hf, kw, str(tmp_path_factory.mktemp(request.param)))
    config = ModelConfig.from_pretrained(path)
    model = build_model(config, path, torch.float32, torch.device("cpu"), progress=False)
    return hf, model, config


def hf_run(hf, tokens: list[int]):
    """Full (uncached) HF forward: logits [S, V] and per-layer top-k positions [S, k]."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda m, a, out, i=i: captured.__setitem__(i, out[0])))
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0]
    for h in hooks:
        h.remove()
    return logits, captured


def topk_set(positions: torch.Tensor, t: int) -> set[int]:
    """HF selects among all T columns; only causal ones (<= t) are real choices."""
    return {int(p) for p in positions.tolist() if 0 <= p <= t}


def prompts(config: ModelConfig, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("page_size,chunk", [(1, 0), (64, 0), pytest.param(4, 9, marks=pytest.mark.smoke)])
def test_prefill_and_decode_logits_and_topk_match_transformers(pair, page_size, chunk):
    hf, model, config = pair
    assert min(PROMPT_LENS) > config.index_topk, "prompts must exceed index_topk for sparsity to matter"
    driver = PagedDriver(model, config, page_size=page_size)
    batch_prompts = prompts(config)
    idx = [driver.add(p, reserve=DECODE_STEPS) for p in batch_prompts]
    driver.topk.start()
    outs = driver.prefill(idx, chunk=chunk, logits="all")

    # Prefill: every position's logits and top-k sets.
    full_layers = [i for i, f in enumerate(config.indexer_full) if f]
    last_logits = {}
    for which, out, batch, recorded in outs:
        starts = torch.cat([torch.zeros(1, dtype=torch.long), batch.extend_lens.cumsum(0)]).tolist()
        for b, i in enumerate(which):
            prefix = int(batch.seq_lens[b] - batch.extend_lens[b])
            n = int(batch.extend_lens[b])
            ref_logits, ref_topk = hf_run(hf, batch_prompts[i][: prefix + n])
            ours = out.logits[starts[b]:starts[b] + n]
            assert (ours - ref_logits[prefix:]).abs().max() <= ATOL
            last_logits[i] = ours[-1]
            assert set(recorded) == set(full_layers)
            for layer in full_layers:
                for j in range(n):
                    t = prefix + j
                    assert topk_set(recorded[layer][starts[b] + j], t) == topk_set(ref_topk[layer][t], t), (layer, t)

    # Greedy decode through the paged cache, all requests in one batch per step.
    last = [int(last_logits[i].argmax()) for i in idx]
    for step in range(DECODE_STEPS):
        out = driver.decode(idx, last)
        recorded = driver.last_topk
        for b, i in enumerate(idx):
            seq = driver.reqs[i]["tokens"]
            ref_logits, ref_topk = hf_run(hf, seq)
            assert (out.logits[b] - ref_logits[-1]).abs().max() <= ATOL, (step, b)
            t = len(seq) - 1
            for layer in full_layers:
                assert topk_set(recorded[layer][b], t) == topk_set(ref_topk[layer][t], t), (step, layer)
        last = out.logits.argmax(-1).tolist()
    driver.release_all()


def test_sparsity_changes_logits(pair, tmp_path):
    """Same weights with index_topk >= sequence length (dense attention) give different logits."""
    hf, model, config = pair
    driver = PagedDriver(model, config)
    tokens = prompts(config)[1]
    driver.add(tokens, reserve=0)
    sparse = driver.prefill([0], logits="all")[0][1].logits
    driver.release_all()

    dense_config = ModelConfig.from_dict({**_raw(config), "index_topk": 4096})
    dense_model = type(model)(dense_config)
    dense_model.load_state_dict(model.state_dict())
    dense_model.fuse_projections()
    dense = PagedDriver(dense_model, dense_config)
    dense.add(tokens, reserve=0)
    dense_logits = dense.prefill([0], logits="all")[0][1].logits
    dense.release_all()
    k = config.index_topk
    # Identical while the context fits in top-k, different once it does not.
    assert torch.allclose(sparse[:k], dense_logits[:k], atol=1e-5)
    assert (sparse[k + 1:] - dense_logits[k + 1:]).abs().max() > 1e-3


def _raw(config: ModelConfig) -> dict:
    """Rebuild a raw config dict from a parsed ModelConfig (for variants of a test model)."""
    arch = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[config.architecture]
    r = config.rope
    return dict(
        architectures=[arch], vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, moe_intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        n_routed_experts=config.n_routed_experts, n_shared_experts=config.n_shared_experts,
        num_experts_per_tok=config.num_experts_per_tok, n_group=config.n_group, topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor,
        mlp_layer_types=["dense" if d else "sparse" for d in config.dense_layers],
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim, index_topk=config.index_topk,
        indexer_types=["full" if f else "shared" for f in config.indexer_full],
        indexer_rope_interleave=config.indexer_rope_interleave,
        rope_parameters=dict(rope_type=r.rope_type, rope_theta=r.theta, factor=r.factor,
                             original_max_position_embeddings=r.original_max_position_embeddings,
                             mscale=r.mscale, mscale_all_dim=r.mscale_all_dim),
    )
