"""`minidsa generate | bench | serve` and the engine flags derived from EngineConfig."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from harness import experts_checkpoint, pretend_gpus_and_forbid_ranks
from minidsa import cli
from minidsa.config import EngineConfig


@pytest.mark.smoke
def test_bench_on_the_embedded_model_writes_json(tmp_path):
    """The README's main job, as a user runs it: a fresh process, default model, small workload."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "minidsa", "bench", "--num-requests", "6", "--input-len", "40-120",
         "--output-len", "8-24", "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 60
    for label in ("requests/s", "input tokens/s", "output tokens/s", "TTFT", "ITL"):
        assert label in proc.stdout
    # at its default log level (WARNING) it still says what it does while the engine starts, phase by phase
    startup = [line for line in proc.stderr.splitlines() if "minidsa.exec.startup" in line]
    assert "start-up: minidsa-tiny on cpu" in startup[0], proc.stderr
    assert any("start-up: weights" in line for line in startup) and "start-up " in startup[-1], proc.stderr
    result = json.loads(out.read_text())
    r = result["results"]
    assert result["model"] == "minidsa-tiny" and result["workload"]["num_requests"] == 6
    assert r["num_requests"] == 6 and 6 * 8 <= r["output_tokens"] <= 6 * 24
    assert 6 * 40 <= r["input_tokens"] <= 6 * 120
    assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
    for key in ("ttft_s", "itl_s"):
        s = r[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    on_gpu = torch.cuda.is_available()
    assert result["engine_config"]["device"] == ("cuda" if on_gpu else "cpu")
    assert result["engine_config"]["page_size"] == (64 if on_gpu else 1)


def test_bench_same_workload_for_same_seed(tiny_llm):
    from minidsa.bench.offline import Workload

    a = Workload.synthetic(5, (10, 50), (3, 9), 0, tiny_llm.engine.vocab_size, tiny_llm.engine.max_model_len)
    b = Workload.synthetic(5, (10, 50), (3, 9), 0, tiny_llm.engine.vocab_size, tiny_llm.engine.max_model_len)
    c = Workload.synthetic(5, (10, 50), (3, 9), 1, tiny_llm.engine.vocab_size, tiny_llm.engine.max_model_len)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens and a.prompts != c.prompts
    assert all(10 <= len(p) <= 50 for p in a.prompts) and all(3 <= n <= 9 for n in a.output_lens)


@pytest.mark.smoke
def test_generate_command(capsys):
    rc = cli.main(["generate", "--prompt", "Hello", "--prompt", "The sky is", "--max-tokens", "5",
                   "--device", "cpu", "--max-total-tokens", "4096"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("output:") == 2 and "[length, 5 tokens]" in out


def test_generate_stream_with_sampling(capsys):
    rc = cli.main(["generate", "--prompt", "Hi", "--stream", "--temperature", "0.8", "--sampling-seed", "1",
                   "--max-tokens", "4", "--device", "cpu", "--max-total-tokens", "4096"])
    assert rc == 0
    assert "[length, 4 tokens]" in capsys.readouterr().out


def test_engine_flags_follow_engine_config():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--max-total-tokens", "1000", "--page-size", "4", "--disable-cuda-graph",
                              "--disable-deep-gemm", "--trust-remote-code", "--chunked-prefill-size", "64",
                              "--index-share-for-mtp-iteration", "false", "--kv-cache-mem-fraction", "0.5",
                              "--max-mixed-prefill-tokens", "256"])
    cfg = cli.engine_config_from_args(args)
    assert cfg.max_total_tokens == 1000 and cfg.page_size == 4 and cfg.chunked_prefill_size == 64
    assert cfg.enable_cuda_graph is False and cfg.use_deep_gemm is False and cfg.trust_remote_code is True
    assert cfg.enable_compile is True and cfg.index_share_for_mtp_iteration is False
    assert cfg.kv_cache_mem_fraction == 0.5 and cfg.max_mixed_prefill_tokens == 256
    defaults = cli.engine_config_from_args(parser.parse_args(["generate"]))
    assert defaults == EngineConfig()


@pytest.mark.smoke
def test_bad_flag_values_give_clear_errors(capsys):
    assert cli.main(["generate", "--page-size", "3"]) == 2
    assert "page_size" in capsys.readouterr().err
    assert cli.main(["generate", "--device", "cpu", "--max-total-tokens", "4096", "--max-tokens", "-1"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_serve_hands_the_engine_config_to_the_server(monkeypatch):
    import pytest

    app = pytest.importorskip("minidsa.server.app")  # the server needs aiohttp and msgspec

    seen = {}

    def fake_serve(engine_config, host, port, api_key=None, **kw):
        seen.update(config=engine_config, host=host, port=port, api_key=api_key)

    monkeypatch.setattr(app, "serve", fake_serve)
    monkeypatch.delattr(app, "main", raising=False)
    assert cli.main(["serve", "--port", "8123", "--api-key", "k", "--max-running-requests", "8"]) == 0
    assert seen["port"] == 8123 and seen["api_key"] == "k" and seen["host"] == "127.0.0.1"
    assert isinstance(seen["config"], EngineConfig) and seen["config"].max_running_requests == 8


def test_precompile_starts_the_engine_once_and_says_where_the_cache_is(capsys):
    assert cli.main(["precompile", "--device", "cpu", "--max-total-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "minidsa precompile: minidsa-tiny: start-up" in out and "weights" in out
    assert "compile cache: not used on cpu" in out  # nothing compiles on CPU
    assert cli.main(["precompile", "--device", "cpu", "--max-total-tokens", "4096", "--compile-cache-dir", "none"]) == 0
    assert "compile cache: off" in capsys.readouterr().out


BAD_PARALLEL = {  # bad input -> (arguments, what the one line names)
    "heads": (["--tp", "3", "--device", "cpu"], "3 does not divide the model's num_attention_heads (4)"),
    "experts": (["--tp", "2", "--enable-expert-parallel", "--device", "cpu"],
                "2 does not divide the model's n_routed_experts (5)"),
    "gpus": (["--tp", "2", "--device", "cuda"], "2 needs 2 GPUs, 1 visible (CUDA_VISIBLE_DEVICES)"),
}


@pytest.mark.parametrize("bad", list(BAD_PARALLEL))
@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_bad_parallel_input_is_one_line_and_exit_2_before_any_rank_starts(command, bad, monkeypatch, tmp_path,
                                                                          capsys):
    pretend_gpus_and_forbid_ranks(monkeypatch, 1)  # one GPU visible, as far as minidsa can tell
    args, names = BAD_PARALLEL[bad]
    model = ["--model", experts_checkpoint(tmp_path / "ckpt")] if bad == "experts" else []
    port = ["--port", "0"] if command == "serve" else []
    assert cli.main([command, *model, *port, *args]) == 2
    err = capsys.readouterr().err
    assert err == f"minidsa {command}: error: config field 'tensor_parallel_size': {names}\n"


def test_bad_parallel_input_in_a_fresh_process_prints_one_line(tmp_path):
    """As a user runs it: nothing on stderr but the one line, exit code 2, no rank process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for argv in (["serve", "--port", "0", "--tp", "3"],
                 ["generate", "--model", experts_checkpoint(tmp_path / "ckpt"), "--tp", "2",
                  "--enable-expert-parallel"]):
        proc = subprocess.run([sys.executable, "-m", "minidsa", *argv], capture_output=True, text=True, timeout=120,
                              env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert len(proc.stderr.splitlines()) == 1 and "config field 'tensor_parallel_size'" in proc.stderr, proc.stderr
