"""benchmarks/scripts/bench_rank_shapes.py (issues 48 / 49) on the CPU: one rank's share of the tiny model, built in
one process with no process group, holds that rank's shapes (heads, expert slices or whole experts, vocabulary), and
under DP attention its experts see every rank's rows; the per-MoE-layer arithmetic of the page. The timings
themselves need a GPU (scripts/gpu_check.sh rank_shapes)."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load

from minidsa.models.deepseek_v32 import MoE


@pytest.fixture(scope="module")
def script():
    return load("bench_rank_shapes")


def _bench(script, mode: str, size: int = 2):
    from minidsa.bench.decode_suite import Bench

    return Bench("tiny", max_context=128, max_batch_tokens=2048, max_bs=8, compile=False,
                 rank=script.rank_of(mode, size), device="cpu")


def _moe(bench) -> MoE:
    return next(m for m in bench.runner.model.modules() if isinstance(m, MoE))


@pytest.mark.parametrize("mode", ["one", "tp", "ep", "dp"])
def test_a_rank_alone_holds_its_shapes_and_runs_a_decode_step(script, mode):
    bench = _bench(script, mode)
    cfg = bench.model_config
    attn = next(m for m in bench.runner.model.modules() if hasattr(m, "num_heads") and hasattr(m, "kv_b_proj"))
    experts = _moe(bench).experts
    heads = cfg.num_attention_heads // (2 if mode == "tp" or mode == "ep" else 1)
    assert attn.num_heads == heads
    assert experts.num_local_experts == cfg.n_routed_experts // (2 if mode in ("ep", "dp") else 1)
    assert experts.inter == cfg.moe_intermediate_size // (2 if mode == "tp" else 1)
    assert bench.runner.config.tensor_parallel_size == (1 if mode == "one" else 2)
    rows, pages = bench.contexts(3, 40)
    out = bench.runner.forward_eager(bench.decode_batch(rows, 40))
    vocab = cfg.vocab_size // (2 if mode in ("tp", "ep") else 1)  # lm_head by vocabulary under tp / ep, no gather
    assert out.logits.shape == (3, vocab)
    assert torch.isfinite(out.logits.float()).all()
    bench.release(rows, pages)


def test_under_dp_attention_the_experts_see_every_ranks_rows(script):
    """The stood-in all-gather hands the experts size x rows (this rank's first, unchanged) and the reduce-scatter
    gives back this rank's block."""
    bench = _bench(script, "dp", size=4)
    moe = _moe(bench)
    seen = []
    handle = moe.experts.register_forward_hook(lambda mod, inputs, out: seen.append(inputs[0].detach().clone()))
    rows, pages = bench.contexts(3, 40)
    out = bench.runner.forward_eager(bench.decode_batch(rows, 40))
    handle.remove()
    assert out.logits.shape[0] == 3
    assert seen and all(x.shape[0] == 12 for x in seen)
    x = torch.randn(3, 8)
    gathered = moe.dp.start_all_gather_rows(x)
    assert gathered.shape == (12, 8) and torch.equal(gathered[:3], x)
    assert not torch.equal(gathered[3:6], gathered[6:9])  # other ranks' rows differ from each other
    assert torch.equal(moe.dp.wait(moe.dp.start_reduce_scatter_rows(gathered)), x)
    bench.release(rows, pages)


def test_per_moe_layer_is_the_depths_difference_and_the_page_shows_the_ratios(script):
    def build(mode, depth, ms, prof=None):
        prof = prof or {}
        rows = [{"bs": bs, "step_ms": v} | ({"profile_us": prof[bs]} if bs in prof else {}) for bs, v in ms.items()]
        return {"mode": mode, "depth": depth, "rows": rows}

    cats = {c: 0.0 for c in script.CATEGORY_NAMES}
    builds = [build("one", 4, {1: 3.0, 16: 6.0, 64: 10.0},
                    {1: cats | {"MoE": 100.0, "kernels": 200, "by_name": {"_expert_gemm_kernel": 60.0}}}),
              build("one", 8, {1: 5.0, 16: 10.0, 64: 18.0},
                    {1: cats | {"MoE": 500.0, "kernels": 400, "by_name": {"_expert_gemm_kernel": 300.0, "x": 4.0}}}),
              build("tp", 4, {1: 2.0, 16: 4.0}), build("tp", 8, {1: 3.0, 16: 5.0}),
              build("dp", 4, {16: 3.0}), build("dp", 8, {16: 4.0})]
    layers = script.per_layer(builds, (4, 8))
    assert layers["one"][1]["layer_ms"] == pytest.approx(0.5)
    assert layers["one"][1]["layer_us"]["MoE"] == pytest.approx(100.0)
    assert layers["one"][1]["layer_us"]["kernels"] == pytest.approx(50.0)
    assert layers["one"][1]["layer_kernels_us"] == pytest.approx({"_expert_gemm_kernel": 60.0, "x": 1.0})
    assert layers["tp"][16]["layer_ms"] == pytest.approx(0.25)
    md = script.to_markdown({"size": 4, "depths": [4, 8], "preset": "bench-dsv32", "device": "d", "date": "t",
                             "commit": "c", "context": 1024, "kv_cache_dtype": "fp8", "command": "x",
                             "builds": builds, "skipped": ["ep:4"]})
    assert "| tp | 1 | 3.000 | 0.2500 | 0.50x |" in md  # 0.25 ms against one GPU's 0.5
    assert "| tp | 16 | 5.000 | 0.2500 | 0.25x | 4.00x |" in md  # one GPU's 1.0 ms a layer at 16 over 0.25
    assert "| dp | 16 | 4.000 | 0.2500 |" in md and "| 8.00x |" in md  # 64 requests: one GPU's 2.0 ms over 0.25
    assert "ep:4" in md
    assert "| MoE | 100.0 |" in md
    assert "| `_expert_gemm_kernel` | MoE | 60.0 |" in md
