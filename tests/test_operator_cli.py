"""What an operator meets on the command line: one-line errors with exit code 2, --help, --version, -m."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_tiny import build_hf, save_hf
from minidsa import __version__, cli
from minidsa.config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minidsa", *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def _one_line_error(err: str, *needles: str) -> None:
    # a progress bar erased on the terminal still shows in captured stderr
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "error:" in lines[0], err
    for n in needles:
        assert n in lines[0], (n, err)


def test_taken_port_is_one_line_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a checkpoint directory that does not exist would fail only when loading: the port is checked first
        proc = _run(["serve", "--port", str(port), "--model", "tiny"], timeout=60)
    assert proc.returncode == 2
    _one_line_error(proc.stderr, f"127.0.0.1:{port}", "in use")
    assert "serving" not in proc.stdout


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_port_out_of_range_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--port", port])
    assert e.value.code == 2
    _one_line_error(capsys.readouterr().err, "--port", "0-65535")


def test_unknown_host_is_one_line(capsys):
    assert cli.main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 2
    _one_line_error(capsys.readouterr().err, "no-such-host.invalid")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, kw = build_hf("deepseek_v32", seed=1)
    return save_hf(hf, kw, str(tmp_path_factory.mktemp("ckpt")))


def _sharded_copy(src: str, dst: str, drop: str | None = None) -> str:
    """Two shards + an index; `drop` is listed in the index but removed from its shard."""
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(config)
    names = sorted(tensors)
    weight_map = {}
    for s in range(2):
        fname = f"model-{s + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in names[s::2] if n != drop}, os.path.join(dst, fname))
        weight_map.update({n: fname for n in names[s::2]})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def test_tensor_missing_from_its_shard_names_file_and_tensor(checkpoint, tmp_path, capsys):
    victim = "model.layers.1.self_attn.kv_b_proj.weight"
    path = _sharded_copy(checkpoint, str(tmp_path / "dropped"), drop=victim)
    rc = cli.main(["generate", "--model", path, "--max-tokens", "1", "--device", "cpu"])
    assert rc == 2
    err = capsys.readouterr().err
    _one_line_error(err, victim)
    assert "model-0000" in err


def test_truncated_shard_is_one_line_and_debug_adds_the_traceback(checkpoint, tmp_path, capsys):
    path = _sharded_copy(checkpoint, str(tmp_path / "truncated"))
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    assert cli.main(["generate", "--model", path, "--max-tokens", "1", "--device", "cpu"]) == 2
    _one_line_error(capsys.readouterr().err, "model-00002-of-00002.safetensors")
    assert cli.main(["generate", "--model", path, "--max-tokens", "1", "--device", "cpu",
                     "--log-level", "DEBUG"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_unreadable_config_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["generate", "--model", str(tmp_path)]) == 2
    _one_line_error(capsys.readouterr().err, "config.json")


def test_log_level_before_or_after_the_subcommand():
    parser = cli.build_parser()
    assert parser.parse_args(["--log-level", "debug", "generate"]).log_level == "DEBUG"
    assert parser.parse_args(["generate", "--log-level", "error"]).log_level == "ERROR"
    assert parser.parse_args(["serve"]).log_level is None  # the subcommand's default applies
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--log-level", "LOUD"])


def test_version_and_python_dash_m():
    proc = _run(["--version"], timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"minidsa {__version__}"


def test_every_engine_flag_is_described_with_its_choices(capsys):
    for f in dataclasses.fields(EngineConfig):  # the help lives with the field (config.py), flags or not
        assert cli.engine_flag_help(f), f"EngineConfig.{f.name} has no help: give its field metadata a 'help'"
    assert {f.name for f in cli.engine_fields()} == {f.name for f in dataclasses.fields(EngineConfig)} - {"extra"}
    for sub in ("generate", "bench", "serve"):
        with pytest.raises(SystemExit):
            cli.main([sub, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--kernel-backend {auto,torch,triton}" in text and "--indexer-cache-dtype {auto,fp8,model}" in text
        assert "--dtype {auto,float32," in text
        for flag in ("--page-size", "--max-total-tokens", "--max-model-len", "--speculative-num-draft-tokens"):
            described = text.split(flag + " N ", 1)[1][:200]
            assert "0 = auto" in described, (flag, described)  # zero-means-auto flags say so
    with pytest.raises(SystemExit):  # the decode suite is a subcommand with its own flags (bench/decode_suite.py)
        cli.main(["bench-decode", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: minidsa bench-decode") and "--skip [{verify,dense,spec,hf} ...]" in text
    assert "--kv-tokens" in text and "--log-level" in text and "transformers" in text
    with pytest.raises(SystemExit) as e:  # no longer a mode of `bench`
        cli.main(["bench", "--suite", "decode"])
    assert e.value.code == 2 and "unrecognized arguments: --suite decode" in capsys.readouterr().err
    if not torch.cuda.is_available():  # the subcommand runs the suite, which measures nothing without a GPU
        assert cli.main(["bench-decode", "--batches", "1"]) == 2 and "needs a CUDA GPU" in capsys.readouterr().out


def test_shared_prefix_bench_reports_with_and_without_the_cache(capsys, tmp_path):
    out_json = tmp_path / "prefix.json"
    rc = cli.main(["bench", "--workload", "shared-prefix", "--num-requests", "4", "--shared-prefix-len", "300",
                   "--input-len", "8-16", "--output-len", "2-3", "--no-warmup", "--no-progress", "--device", "cpu",
                   "--max-total-tokens", "4096", "--page-size", "4", "--json", str(out_json)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "hit rate" in out and "TTFT ms (mean" in out and "TTFT ms without the cache" in out
    r = json.loads(out_json.read_text())["results"]
    assert r["prefix_cache"]["hit_rate"] > 0.5
    # 3 of 4 requests skip the 300-token prefill with the cache; without it every one computes it
    assert r["ttft_s"]["mean"] < r["without_prefix_cache"]["ttft_s"]["mean"]
