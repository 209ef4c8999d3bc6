"""Start-up memory checks: a model that cannot fit fails before its weights load, in one line."""

from __future__ import annotations

import pytest
import torch

import minidsa.exec.memory as memory
from minidsa import cli
from minidsa.config import ModelConfig
from minidsa.engine.core import Engine
from minidsa.common.presets import preset_config


def test_weight_bytes_counts_the_serving_formats():
    """FP8 projections count one byte per value (+ scales), the rest the serving dtype: the bench preset's bytes
    match what loading it allocates."""
    config = ModelConfig.from_dict(preset_config("bench-dsv32"))
    fp8 = memory.weight_bytes(config, None, torch.bfloat16, "auto")
    dense = memory.weight_bytes(config, None, torch.bfloat16, "none")
    assert 25 * 2**30 < fp8 < 35 * 2**30
    assert dense > 1.8 * fp8  # the FP8 weights dequantised to bf16
    tiny = ModelConfig.from_dict(preset_config("tiny"))
    assert memory.weight_bytes(tiny, None, torch.float32, "auto") < 2**28


def test_under_dp_attention_a_rank_holds_its_share_of_the_routed_experts_and_the_rest_whole():
    """The per-rank weights the start-up check counts: 1/N of everything under tensor parallelism; under DP attention
    1/N of the routed experts plus every other weight whole (what each rank loads)."""
    config = ModelConfig.from_dict(preset_config("bench-dsv32"))
    whole = memory.weight_bytes(config, None, torch.bfloat16, "auto")
    tp4 = memory.weight_bytes(config, None, torch.bfloat16, "auto", ranks=4)
    dp4 = memory.weight_bytes(config, None, torch.bfloat16, "auto", ranks=4, dp_attention=True)
    assert tp4 == whole // 4
    with torch.device("meta"):
        from minidsa.models.deepseek_v32 import DeepseekV32ForCausalLM

        model = DeepseekV32ForCausalLM(config)
    layer = next(m for m in model.model.layers if hasattr(m.mlp, "experts"))
    assert layer.mlp.experts.num_local_experts == config.n_routed_experts  # built whole here: the share is counted
    assert tp4 < dp4 < whole
    routed = (whole - dp4) * 4 // 3  # dp4 = whole - routed + routed / 4
    assert 0.6 * whole < routed < whole  # the routed experts are most of a MoE model's bytes


@pytest.fixture
def small_machine(monkeypatch):
    """A machine with 8 GiB available, and a model build that must not be reached."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: (8 * 2**30, "of RAM available (test)"))

    def no_build(*args, **kwargs):
        raise AssertionError("the weights were being built although the model cannot fit")

    monkeypatch.setattr("minidsa.exec.runner.build_model", no_build)


def test_a_model_that_cannot_fit_fails_before_loading(small_machine):
    with pytest.raises(memory.DoesNotFit) as e:
        Engine(model="bench-dsv32", device="cpu", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "does not fit" in msg and "8.0 GiB of RAM available" in msg
    assert "weights 30." in msg and "a GPU" in msg


def test_a_kv_cache_given_too_large_fails_before_loading(small_machine):
    """--max-total-tokens is allocated as given, not sized from free memory: one that cannot fit is refused with
    the numbers and the flag to change, before any weight is built (it used to fail inside the allocator)."""
    with pytest.raises(memory.DoesNotFit) as e:
        Engine(model="tiny", device="cpu", progress=False, max_total_tokens=1 << 26, max_model_len=256)
    msg = str(e.value)
    assert "\n" not in msg and f"KV cache for {1 << 26} tokens" in msg and "--max-total-tokens" in msg
    with pytest.raises(AssertionError, match="weights were being built"):  # a cache that fits gets past the check
        Engine(model="tiny", device="cpu", progress=False, max_total_tokens=4096, max_model_len=256)


def test_the_cli_reports_it_in_one_line_with_exit_code_2(small_machine, capsys):
    rc = cli.main(["generate", "--model", "bench-glm5", "--device", "cpu", "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "does not fit" in err and "GiB" in err


def test_the_tiny_model_fits_and_says_what_it_needs(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="minidsa.exec.memory"):
        engine = Engine(device="cpu", progress=False)
    assert any("memory: weights" in r.message for r in caplog.records)
    engine.close()
