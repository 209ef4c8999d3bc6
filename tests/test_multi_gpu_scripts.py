"""Issue 48's section `multi_gpu` and issue 49's `dp_attention` (scripts/gpu_check.sh) on the CPU.

multi_gpu: benchmarks/scripts/serve_check.py drives a 2-rank gloo server through the guides' recipe (MTP 3/1/4) and
checks it end to end; benchmarks/scripts/multi_gpu_page.py gathers the parts' outputs and writes the page for
benchmarks/multi_gpu/NOTES.md from a synthetic summary (the figures here are made up; only the arithmetic and the
layout are checked).

dp_attention: benchmarks/scripts/bench_moe_exchange.py's three exchanges over 2 gloo ranks give the reference bit for
bit; benchmarks/scripts/dp_attention_page.py's ratios and pass / fail from made-up sides; the section itself on a CPU
(DP_CPU_SMOKE: a DP-attention side of the tiny model and the exchange; a budget that fits nothing skips and fails).

eight_gpus (issue 50): the section on a CPU (the tiny model at --tp 2 through `minidsa serve`, MTP at simulated
acceptance and plain, each workload 0 failed, under tensor parallelism and DP attention); eight_gpu_page.py's tables
and published-figure column from made-up servers; serve_check.py's nvidia-smi memory parsing and peak.

two_gpus (issues 48 and 49 on 2 GPUs): each of its test selections still selects GPU tests (collected, not run).

What only runs on GPUs (NCCL, CUDA graphs, nvidia-smi's process list, the timings) is left to the sections.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from bench_scripts import REPO, SCRIPTS, load


def _profile(preset: str, tp: int, steps: dict[int, float], collectives_us: float) -> dict:
    names = load("profile_tp").CATEGORY_NAMES
    batches = []
    for bs, step in steps.items():
        cats = {n: {"count_per_step": 1.0, "us_per_step": 100.0, "share": 0.1, "share_of_step": 0.05, "kernels": 1}
                for n in names}
        cats["collectives"]["us_per_step"] = collectives_us
        kernel_ms = sum(c["us_per_step"] for c in cats.values()) / 1e3
        batches.append({"batch": bs, "steps": 20, "step_ms": step, "itl_ms": step, "tok_per_s": bs * 1e3 / step,
                        "forward_gpu_ms_per_step": {"decode": step * 0.9}, "host_ms_per_step": step * 0.1,
                        "profile": {"what": "CUDA kernels", "steps": 20, "step_ms": step * 1.05,
                                    "kernel_ms": kernel_ms, "busy_ms": kernel_ms, "gap_ms": step * 1.05 - kernel_ms,
                                    "gap_vs_kernel_sum_ms": 0.0, "kernels_per_step": 10.0 * len(names),
                                    "categories": cats,
                                    "top": [{"name": "_w8a8_gemm_kernel", "category": "FP8 GEMM", "per_step": 6.0,
                                             "us_per_step": 300.0, "share": 0.3, "share_of_step": 0.1}]}})
    return {"device": "4 x NVIDIA H200", "date": "2026-12-01 10:00 UTC", "commit": "abc1234", "tp": tp,
            "model": "minidsa-" + preset, "preset": preset, "profiled": "CUDA kernels (rank 0)", "startup_s": 95.0,
            "kv_total_tokens": 1000000, "kernels": None, "batches": batches,
            "command": f"python3 benchmarks/scripts/profile_tp.py --model {preset} --tp {tp}"}


def test_page_from_a_synthetic_summary():
    page = load("multi_gpu_page")
    deep = _profile("bench-dsv32:16", 4, {1: 8.0, 16: 12.0}, 500.0)
    shallow = _profile("bench-dsv32:4", 4, {1: 2.0}, 200.0)
    one4, one6 = _profile("bench-dsv32:4", 1, {1: 2.5}, 0.0), _profile("bench-dsv32:6", 1, {1: 3.3}, 0.0)
    run = lambda bs, L, step: {"batch": bs, "tok_per_s": bs * 1e3 / step, "itl_ms": step, "step_ms": step,  # noqa
                               "accept_len": L, "gpu_ms_per_step": {"decode": step}, "host_ms_per_step": 0.1}
    spec = {"device": "4 x NVIDIA H200", "date": "2026-12-01", "commit": "abc1234", "args": ["--tp", "4"],
            "plain": {"label": "plain", "startup_s": 40.0, "runs": [run(1, None, 8.0), run(16, None, 12.0)]},
            "speculative": {"label": "MTP 3/1/4", "startup_s": 60.0,
                            "runs": [run(1, 3.2, 5.0), run(16, 3.2, 9.0)]}}
    serve = {"command": "minidsa serve --model bench-dsv32:16 --tp 4", "bench_command": "minidsa bench --base-url x",
             "checks": {"ready": True, "zero_failed": True, "kv_in_use_zero": True, "exit_within_limit": True},
             "ok": True, "ready_s": 50.0, "kv_total_tokens": 1000000, "exit_s": 2.5,
             "after": {"kv_cache_used_tokens": 0},
             "bench": {"completed": 128, "failed": 0, "output_tokens_per_s": 5000.0, "ttft_s": {"p50": 1.0, "p99": 2.0},
                       "itl_s": {"p50": 0.02, "p99": 0.05}},
             "minidsa_processes_left": [], "gpu_compute_processes": []}
    summary = {"meta": {"model": "bench-dsv32:16", "tp": "4", "date": "2026-12-01T10:00:00Z", "commit": "abc1234",
                        "engine_args": "--kv-cache-dtype fp8"},
               "parts": {"profile": {"rc": 0, "seconds": 120, "limit": 300}, "shallow": {"skipped": True, "left": 30}},
               "profile": deep, "shallow": shallow, "one_gpu": {"a": one4, "b": one6}, "speculative": spec,
               "serve": serve}
    text = page.page(json.loads(json.dumps(summary)))
    assert text.startswith("# Tensor parallelism at depth: current figures")
    assert text.index("## Decode step") < text.index("## Start-up") < text.index("## Where the step goes")
    assert "4 x NVIDIA H200, 2026-12-01 10:00 UTC, commit abc1234" in text
    assert "`python3 benchmarks/scripts/profile_tp.py --model bench-dsv32:16 --tp 4`" in text
    # per layer: (8.0 - 2.0) / 12 at TP=4, collectives (500 - 200) / 12; one GPU: (3.3 - 2.5) / 2
    assert "| TP=4 | :4 / :16 | 0.500 |" in text and "| 25.0 |" in text
    assert "| one GPU (TP=1) | :4 / :6 | 0.400 |" in text
    assert "| 3.2 | 16 | 1333 | 1778 | 1.33 |" in text  # bench_speculative's own table
    assert "| **all** | passed |" in text and "| requests completed / failed | 128 / 0 |" in text
    assert "| shallow | skipped (30 s of the budget left) | | |" in text
    assert "| collectives | 1.0 / 500.0 / 5.0% |" in text


def test_collect_reads_the_parts(tmp_path):
    page = load("multi_gpu_page")
    raw = tmp_path / "raw"
    (raw / "profile").mkdir(parents=True)
    (raw / "meta.txt").write_text("model=bench-glm5:16 tp=4 engine=--kv-cache-dtype fp8 date=2026-12-01T10:00:00Z "
                                  "commit=abc1234\n")
    (raw / "parts.txt").write_text("profile rc=0 seconds=120 limit=300\nserve rc=1 seconds=80 limit=240\n"
                                   "spec skipped left=40\n")
    prof = _profile("bench-glm5:16", 4, {1: 8.0}, 100.0)
    prof["batches"][0]["profile"]["all"] = [{"name": "x"}] * 500
    (raw / "profile" / "profile_tp.json").write_text(json.dumps(prof))
    s = page.collect(str(raw))
    assert s["meta"]["model"] == "bench-glm5:16" and s["meta"]["engine_args"] == "--kv-cache-dtype fp8"
    assert s["meta"]["device"] == "4 x NVIDIA H200"
    assert s["parts"] == {"profile": {"rc": 0, "seconds": 120, "limit": 300},
                          "serve": {"rc": 1, "seconds": 80, "limit": 240}, "spec": {"skipped": True, "left": 40}}
    assert "all" not in s["profile"]["batches"][0]["profile"] and s["serve"] is None and s["speculative"] is None
    assert "## Decode step" in page.page(s) and "## MTP" not in page.page(s)


def test_metrics_parsing():
    sc = load("serve_check")
    text = ('# HELP minidsa_kv_cache_used_tokens KV\nminidsa_kv_cache_used_tokens{model_name="m"} 0\n'
            'minidsa_kv_cache_usage_ratio{model_name="m"} 0.25\n'
            'minidsa_request_finish_total{model_name="m",reason="stop"} 3\n'
            'minidsa_time_to_first_token_seconds_bucket{model_name="m",le="0.1"} 2\n')
    assert sc.parse_metrics(text) == {"minidsa_kv_cache_used_tokens": 0.0, "minidsa_kv_cache_usage_ratio": 0.25}


@pytest.mark.parametrize("dp", [False, True], ids=["tp", "dp-attention"])
def test_serve_check_on_cpu(tmp_path, dp):
    """Two gloo ranks serving the recipe (MTP 3/1/4) on the tiny preset, under tensor parallelism or DP attention
    (with two-batch overlap from 2 tokens: every prefill and verify of two or more tokens splits): every check
    passes, nothing is left."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "serve_check.py"), "--out", str(tmp_path),
                           "--model", "tiny", "--tp", "2", "--requests", "4", "--concurrency", "2",
                           "--bench-args=--input-len 16-32 --output-len 4-8", "--",
                           "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048",
                           "--speculative-num-steps", "3", "--speculative-topk", "1",
                           "--speculative-num-draft-tokens", "4",
                           *(["--enable-dp-attention", "--enable-two-batch-overlap", "--two-batch-overlap-min-tokens",
                              "2"] if dp else [])],
                          env=env, capture_output=True, text=True, timeout=240)
    with open(tmp_path / "serve_check.json") as f:
        r = json.load(f)
    assert proc.returncode == 0 and r["ok"], (r.get("checks"), r.get("error"), proc.stdout[-2000:])
    assert r["bench"]["completed"] == 4 and r["bench"]["failed"] == 0
    assert r["after"]["kv_cache_used_tokens"] == 0 and r["kv_total_tokens"] > 0
    assert len(r["rank_pids"]) == 1 and r["exit_s"] <= 10 and r["gpu_compute_processes"] is None


@pytest.mark.parametrize("script", ["profile_tp.py", "serve_check.py", "multi_gpu_page.py", "bench_dp_attention.py",
                                    "bench_moe_exchange.py", "dp_attention_page.py",
                                    "eight_gpu_page.py", "bench_result_channel.py"])
def test_help(script):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), "--help"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "usage" in proc.stdout


def test_bench_speculative_under_tp_starts_one_engine_per_accept_len(tmp_path):
    """Every rank draws its own simulated acceptance: under --tp 2 each L gets an engine started with it (rank 0's
    live simulator alone would leave rank 1 accepting differently)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_speculative.py"), "--out", str(tmp_path),
                           "--allow-cpu", "--model", "tiny", "--tp", "2", "--batches", "1", "--accept-lens", "1.0",
                           "3.2", "--prompt-len", "16", "--decode-tokens", "6", "--device", "cpu", "--dtype",
                           "float32", "--max-total-tokens", "2048", "--max-running-requests", "2"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "speculative.json") as f:
        spec = json.load(f)["speculative"]
    assert spec["engine_per_accept_len"] and set(spec["startups_s"]) == {"1.0", "3.2"}
    assert [(r["accept_len"], r["batch"]) for r in spec["runs"]] == [(1.0, 1), (3.2, 1)]
    assert spec["runs"][0]["tokens_per_round_total"] == 1.0 and spec["runs"][1]["tokens_per_round_total"] > 2.5


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "MINIDSA_COMMIT": "test"}


def test_moe_exchange_methods_agree_on_two_gloo_ranks(tmp_path):
    """All-gather + reduce-scatter, the all-to-all and the padded all-to-all each give every rank its rows' exact
    reference; with top-2 routing over 2 ranks some tokens need only one rank, so the all-to-all sends fewer rows."""
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_moe_exchange.py"), "--device", "cpu",
                           "--ranks", "2", "--rows", "1", "3", "8", "--hidden", "64", "--top-k", "2", "--replays", "2",
                           "--out", str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(tmp_path / "moe_exchange.json") as f:
        r = json.load(f)
    assert r["backend"] == "gloo" and not r["cuda_graphs"] and r["commit"] == "test"
    assert [x["rows"] for x in r["results"]] == [1, 3, 8]
    for x in r["results"]:
        assert x["equal"] == {"ag_rs": True, "a2a": True, "a2a_padded": True}
        assert x["gathered_rows"] == 2 * x["rows"] and x["bytes_per_rank"] == x["rows"] * 64 * 2
        assert x["fastest"] in ("ag_rs", "a2a", "a2a_padded") and min(x["ag_rs_us"], x["a2a_us"]) > 0
    assert sum(x["dispatch_rows_mean"] for x in r["results"]) < sum(x["gathered_rows"] for x in r["results"])


def test_moe_exchange_shares_follow_the_routing():
    """Per token, the ranks' shares add up to its experts' weights, and a rank holds a share only where one of the
    token's experts lives on it (experts placed in order, 256 / 4 per rank)."""
    ex = load("bench_moe_exchange")
    shares = ex.expert_shares(world=4, rows=16, experts=256, top_k=8, seed=3)
    assert shares.shape == (64, 4) and int(shares.sum(1).min()) >= 8 and int(shares.sum(1).max()) <= 16
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.rand(64, 256, generator=g).topk(8, dim=1).indices
    held = torch.zeros(64, 4, dtype=torch.bool).scatter_(1, ids // 64, True)
    assert torch.equal(shares != 0, held)
    assert torch.equal(ex.check_weights(shares)[:, 3], 4 * shares[:, 3])


def _side(label: str, gpus: int, dp: bool, kv: int, tok_s: float, itl_p99_ms: float, startup: float,
          two_batch: bool = False, step_ms: float = 20.0) -> dict:
    bs = 64 * gpus
    return {"label": label, "side": load("bench_dp_attention").side_name(gpus, dp, two_batch), "gpus": gpus,
            "dp_attention": dp, "two_batch_overlap": two_batch, "attention_ranks": gpus if dp else 1,
            "preset": "bench-dsv32:10",
            "device": "NVIDIA H200", "date": "2026-12-02 10:00 UTC", "commit": "abc1234",
            "command": f"python3 benchmarks/scripts/bench_dp_attention.py --label {label} --tp {gpus}",
            "max_running_requests": 64, "startup_s": startup, "kv_total_tokens": kv,
            "bench": {"workload": {"num_requests": 256 * gpus}, "workload_scale": gpus,
                      "results": {"output_tokens_per_s": tok_s, "itl_s": {"p50": itl_p99_ms / 2e3,
                                                                          "p99": itl_p99_ms / 1e3},
                                  "ttft_s": {"p50": 1.0, "p99": 2.0}, "timeline": [[0.1, 5, 0]] * 100}},
            "decode": [{"batch": 1, "batch_asked": "1", "step_ms": 10.0, "tok_per_s": 100.0},
                       {"batch": bs, "batch_asked": "64/gpu", "step_ms": step_ms, "tok_per_s": bs * 1e3 / step_ms}]}


def test_dp_attention_page_ratios_and_targets(tmp_path):
    """The sides' ratios and the issue's targets: KV 4.0x passes 3.5x, tok/s 3.0x fails 3.2x but beats TP (1.2x),
    ITL p99 1.625x of TP's fails 1.5x; a side not measured leaves its targets 'not measured'."""
    page = load("dp_attention_page")
    raw = tmp_path / "raw"
    (raw / "sides").mkdir(parents=True)
    (raw / "exchange").mkdir()
    (raw / "meta.txt").write_text("model=bench-dsv32:10 tp=4 engine=--kv-cache-dtype fp8 date=2026-12-02T10:00:00Z "
                                  "commit=abc1234\n")
    (raw / "parts.txt").write_text("dp rc=0 seconds=190 limit=210\ntp rc=0 seconds=200 limit=210\n"
                                   "one rc=0 seconds=100 limit=110\nexchange skipped left=20 reason=budget\n")
    for name, side in (("a", _side("one", 1, False, 100000, 1000.0, 10.0, 80.0)),
                       ("b", _side("tp", 4, False, 120000, 2500.0, 8.0, 120.0)),
                       ("c", _side("dp", 4, True, 400000, 3000.0, 13.0, 110.0))):
        (raw / "sides" / f"{name}.json").write_text(json.dumps(side))
    (raw / "exchange" / "moe_exchange.json").write_text(json.dumps({
        "device": "NVIDIA H200", "ranks": 4, "date": "2026-12-02 10:09 UTC", "commit": "abc1234", "nccl": "2.27.3",
        "torch": "2.13.0", "env": {"NCCL_NVLS_ENABLE": "0"}, "cuda_graphs": True, "per_graph": 20, "hidden": 7168,
        "dtype": "bfloat16", "top_k": 8, "experts": 256, "command": "python3 benchmarks/scripts/bench_moe_exchange.py",
        "results": [{"rows": 64, "bytes_per_rank": 917504, "dispatch_rows_mean": 230.5, "gathered_rows": 256,
                     "ag_rs_us": 40.0, "a2a_us": 50.0, "a2a_padded_us": 60.0, "fastest": "ag_rs",
                     "equal": {"ag_rs": True, "a2a": False, "a2a_padded": True}}]}))
    s = page.collect(str(raw))
    assert set(s["sides"]) == {"one", "tp", "dp"} and "timeline" not in s["sides"]["dp"]["bench"]["results"]
    assert s["parts"]["exchange"] == {"skipped": True, "left": 20, "reason": "budget"}
    text = page.page(json.loads(json.dumps(s)))
    assert "| measure | one GPU | TP=4 | DP attention 4 | DP attention 4 / one GPU | DP attention 4 / TP=4 |" in text
    assert "| KV capacity, tokens | 100000 | 120000 | 400000 | 4.00x | 3.33x |" in text
    assert "| output tok/s | 1000.0 | 2500.0 | 3000.0 | 3.00x | 1.20x |" in text
    assert "| ITL p99 ms | 10.000 | 8.000 | 13.000 | 1.30x | 1.62x |" in text
    assert "| decode batch 64/gpu (64 / 256 / 256): ms per step | 20.000 | 20.000 | 20.000 | 1.00x | 1.00x |" in text
    assert "| decode batch 64/gpu: output tok/s | 3200.0 | 12800.0 | 12800.0 | 4.00x | 1.00x |" in text
    assert "| KV capacity, DP attention / one GPU | >= 3.5x | 4.00x | pass |" in text
    assert "| `minidsa bench` output tok/s, DP attention / one GPU | >= 3.2x | 3.00x | **FAIL** |" in text
    assert "| `minidsa bench` output tok/s, DP attention / TP | > 1x | 1.20x | pass |" in text
    assert "| ITL p99, DP attention / TP | <= 1.5x | 1.62x | **FAIL** |" in text
    assert "DP attention 4: NVIDIA H200 x 4, 2026-12-02 10:00 UTC, commit abc1234: `python3 benchmarks/" in text
    assert "| 64 | 917504 | 230.5 / 256 | 40.00 | 50.00 | 60.00 | 1.25x | AG + RS | **NO**: all-to-all |" in text
    assert "| exchange | skipped (20 s of the budget left) | | |" in text
    del s["sides"]["one"]
    text = page.page(s)
    assert "| KV capacity, DP attention / one GPU | >= 3.5x | - | not measured |" in text
    assert "| ITL p99, DP attention / TP | <= 1.5x | 1.62x | **FAIL** |" in text
    # greedy agreement: DP attention against TP and one GPU, beside each side's batched-against-alone floor
    assert "## Greedy agreement" not in text  # no side recorded greedy tokens
    outputs = {"one": [[1, 2, 3, 4], [5, 6, 7, 8]], "tp": [[1, 2, 3, 4], [5, 6, 9, 9]],
               "dp": [[1, 2, 3, 4], [5, 6, 7, 8]]}
    for k, greedy in outputs.items():
        s["sides"][k] = dict(s["sides"].get(k) or _side(k, 1, False, 1, 1.0, 1.0, 1.0), greedy=greedy,
                             greedy_alone=[[1, 2, 3, 4], [5, 0, 0, 0]])
    text = page.page(s)
    assert "| DP attention 4 vs TP=4 | 1 / 2 | 3.0 | 75.0% |" in text
    assert "| DP attention 4 vs one GPU | 2 / 2 | 4.0 | 100.0% |" in text
    assert "| one GPU: batched vs one at a time (the floor) | 1 / 2 | 2.5 | 62.5% |" in text
    # a second call's two-batch overlap side (DP_PARTS="dp tbo"): its own column, over DP attention without it
    (raw / "sides" / "d.json").write_text(json.dumps(_side("tbo", 4, True, 400000, 3300.0, 12.0, 115.0,
                                                           two_batch=True, step_ms=16.0)))
    text = page.page(page.collect(str(raw)))
    assert ("| decode batch 64/gpu (64 / 256 / 256 / 256): ms per step | 20.000 | 20.000 | 20.000 | 16.000 | 1.00x "
            "| 1.00x | 0.80x |") in text
    head = next(line for line in text.splitlines() if line.startswith("| measure |"))
    assert head.endswith("| DP attention 4 + two-batch overlap | DP attention 4 / one GPU | DP attention 4 / TP=4 | "
                         "DP attention 4 + two-batch overlap / DP attention 4 |"), head


def _section(tmp_path, **env) -> subprocess.CompletedProcess:
    """scripts/gpu_check.sh dp_attention on this CPU: the tiny model at DP_TP=2, tiny workloads and exchange. The
    script and the benchmark scripts run from a copy (minidsa from this tree, on PYTHONPATH): the script's preamble
    unpacks and installs what a checkout's .gpu folder holds, which a test must not do to the checkout."""
    tree = tmp_path / "tree"
    shutil.copytree(SCRIPTS, tree / "benchmarks" / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "scripts").mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "gpu_check.sh"), tree / "scripts")
    env = {**_env(), "OUT": str(tmp_path / "out"), "DP_CPU_SMOKE": "1", "DP_MODEL": "tiny", "DP_TP": "2",
           "DP_ENGINE_ARGS": "--device cpu --dtype float32 --max-total-tokens 2048", "DP_BATCHES": "1 2/gpu",
           "DP_SIDE_ARGS": "--num-requests 2 --input-len 16-32 --output-len 4-8 --prompt-len 16 --decode-tokens 4 "
                           "--agreement 1",
           "DP_EXCHANGE_ROWS": "1", "DP_EXCHANGE_ARGS": "--hidden 64 --replays 2 --top-k 2", **env}
    return subprocess.run(["bash", str(tree / "scripts" / "gpu_check.sh"), "dp_attention"], env=env,
                          capture_output=True, text=True, timeout=240)


def _summary(proc: subprocess.CompletedProcess, out, section: str) -> dict:
    """A section that ran to the end (its log's tail otherwise) and the summary JSON it wrote."""
    assert proc.returncode == 0, (out / f"{section}.log").read_text()[-4000:]
    with open(out / f"{section}.json") as f:
        return json.load(f)


def test_dp_attention_section_on_cpu(tmp_path):
    """The section's DP-attention side and exchange parts on a CPU: the summary holds the side (KV capacity = both
    ranks' caches), the exchange's equal outputs and the parts' exit status; the raw outputs are tarred."""
    proc = _section(tmp_path, DP_PARTS="dp exchange")
    out = tmp_path / "out"
    s = _summary(proc, out, "dp_attention")
    dp = s["sides"]["dp"]
    assert dp["dp_attention"] and dp["gpus"] == 2 and dp["kv_total_tokens"] == 2 * 2048
    assert dp["bench"]["workload"]["num_requests"] == 4 and dp["bench"]["results"]["output_tokens"] > 0
    assert [(d["batch_asked"], d["batch"]) for d in dp["decode"]] == [("1", 1), ("2/gpu", 4)]
    assert len(dp["greedy"]) == len(dp["greedy_alone"]) == 1 and len(dp["greedy"][0]) == 64
    assert dp["greedy"] == dp["greedy_alone"]  # fp32 on a CPU: the batch shape changes nothing
    assert all(all(x["equal"].values()) for x in s["exchange"]["results"])
    assert s["parts"]["dp"]["rc"] == 0 and s["parts"]["exchange"]["rc"] == 0
    assert s["meta"]["model"] == "tiny" and s["meta"]["commit"] == "test"
    text = (out / "dp_attention.md").read_text()
    assert "| KV capacity, tokens | 4096 |" in text and "## The MoE exchange" in text
    assert "| DP attention 2: batched vs one at a time (the floor) | 1 / 1 |" in text
    assert (out / "dp_attention_raw.tgz").exists() and not (out / "dp_attention_raw").exists()


def test_dp_attention_section_skips_what_does_not_fit(tmp_path):
    """A budget smaller than every part's minimum: each part is skipped and recorded, and the section fails."""
    proc = _section(tmp_path, DP_PARTS="dp exchange", DP_BUDGET_S="30")
    out = tmp_path / "out"
    assert proc.returncode != 0
    with open(out / "dp_attention.json") as f:
        s = json.load(f)
    assert s["parts"] == {"dp": {"skipped": True, "left": s["parts"]["dp"]["left"], "reason": "budget"},
                          "exchange": {"skipped": True, "left": s["parts"]["exchange"]["left"], "reason": "budget"}}
    assert s["sides"] == {} and s["exchange"] is None
    assert "dp_attention rc=1" in (out / "summary.txt").read_text()


def _x8_section(tmp_path, **env) -> subprocess.CompletedProcess:
    """scripts/gpu_check.sh eight_gpus on this CPU from a copy of the scripts (see _section): the tiny model at
    X8_TP=2, tiny workloads."""
    tree = tmp_path / "tree"
    shutil.copytree(SCRIPTS, tree / "benchmarks" / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "scripts").mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "gpu_check.sh"), tree / "scripts")
    env = {**_env(), "OUT": str(tmp_path / "out"), "X8_MODEL": "tiny", "X8_TP": "2",
           "X8_ENGINE_ARGS": "--device cpu --dtype float32 --max-total-tokens 2048", "X8_CONCURRENCIES": "1 2",
           "X8_ITL_ARGS": "--input-len 16 --output-len 4",
           "X8_2K_ARGS": "--num-requests 2 --input-len 32 --output-len 4",
           "X8_DEFAULT_ARGS": "--num-requests 2 --input-len 16-32 --output-len 4-8", **env}
    return subprocess.run(["bash", str(tree / "scripts" / "gpu_check.sh"), "eight_gpus"], env=env,
                          capture_output=True, text=True, timeout=240)


def test_eight_gpus_section_mtp_on_cpu(tmp_path):
    """The recipe's part under tensor parallelism: one server, every workload in order with 0 failed, the simulated
    acceptance on the server's command line, KV capacity; the page and the raw tarball come back."""
    proc = _x8_section(tmp_path, X8_MODE="tp", X8_PARTS="mtp")
    out = tmp_path / "out"
    s = _summary(proc, out, "eight_gpus")
    mtp = s["servers"]["mtp"]
    assert mtp["ok"] and list(mtp["series"]) == ["itl_c1", "itl_c2", "2k", "default"]
    assert [mtp["series"][n]["results"]["completed"] for n in mtp["series"]] == [4, 4, 2, 2]
    assert all(x["results"]["failed"] == 0 and "stdout_tail" not in x for x in mtp["series"].values())
    assert "--max-concurrency 2 --input-len 16 --output-len 4" in mtp["series"]["itl_c2"]["command"]
    assert "--speculative-num-draft-tokens 4 --speculative-simulate-accept-len 3.2" in mtp["command"]
    assert "--enable-dp-attention" not in mtp["command"] and mtp["kv_total_tokens"] == 2048
    assert any(re.search(r"start-up [\d.]+ s:", line) for line in mtp["startup_log"])
    assert mtp["gpu_memory_peak_mib"] is None and "bench" not in mtp  # --requests 0: the series only
    assert s["meta"]["mode"] == "tp" and s["parts"]["mtp"]["rc"] == 0 and set(s["servers"]) == {"mtp"}
    text = (out / "eight_gpus.md").read_text()
    assert "| 2 | 4 (0) / - |" in text and "| 2k in / 100 out | MTP 3/1/4 | 2 / 0 |" in text
    assert "X8_MODEL=tiny X8_MODE=tp X8_TP=2 bash scripts/gpu_check.sh eight_gpus" in text
    assert (out / "eight_gpus_raw.tgz").exists() and not (out / "eight_gpus_raw").exists()


def test_eight_gpus_section_plain_under_dp_attention_on_cpu(tmp_path):
    """The plain part under DP attention: no MTP flags, the ITL workloads alone (X8_PLAIN_SERIES), both ranks'
    caches; an unknown mode stops the section before any server starts."""
    proc = _x8_section(tmp_path, X8_MODE="dp", X8_PARTS="plain", X8_PLAIN_SERIES="itl", X8_CONCURRENCIES="2")
    plain = _summary(proc, tmp_path / "out", "eight_gpus")["servers"]["plain"]
    assert plain["ok"] and list(plain["series"]) == ["itl_c2"] and plain["series"]["itl_c2"]["results"]["failed"] == 0
    assert "--enable-dp-attention" in plain["command"] and "--speculative" not in plain["command"]
    assert plain["kv_total_tokens"] == 2 * 2048
    bad = _x8_section(tmp_path / "bad", X8_MODE="ep", X8_PARTS="plain")
    assert bad.returncode != 0 and "X8_MODE: no mode 'ep'" in (tmp_path / "bad" / "out" / "eight_gpus.log").read_text()


def _server(command: str, series: dict[str, tuple[float, float, float]], ready: float, peak: dict) -> dict:
    """A made-up serve_check.json: series NAME -> (output tok/s, total tok/s, TPOT p50 ms)."""
    def results(out_tok, total, tpot):
        return {"num_requests": 8, "completed": 8, "failed": 0, "input_tokens_per_s": total - out_tok,
                "output_tokens_per_s": out_tok, "total_tokens_per_s": total, "duration_s": 10.0,
                "ttft_s": {"p50": 0.5, "p99": 1.0}, "itl_s": {"p50": 3 * tpot / 1e3, "p99": 4 * tpot / 1e3},
                "tpot_s": {"p50": tpot / 1e3}}
    return {"command": command, "ok": True, "ready_s": ready, "kv_total_tokens": 3000000, "exit_s": 2.0,
            "checks": {"ready": True, **{f"{n}_zero_failed": True for n in series}},
            "series": {n: {"command": f"minidsa bench --base-url x --json /o/{n}.json --flags-{n}", "rc": 0,
                           "results": results(*v)} for n, v in series.items()},
            "startup_log": ["INFO start-up: compile cache 0.0 s (no artifacts for this configuration yet)",
                            f"INFO start-up {ready - 5:.1f} s: weights 2.0 s, capture 40.0 s"],
            "gpu_memory_peak_mib": peak, "gpu_memory_total_mib": {k: 143771.0 for k in peak}}


def test_eight_gpu_page_tables_and_published_figures(tmp_path):
    """GLM-5 under TP: ITL rows with MTP / plain ratios and the published 118 tok/s at concurrency 1, the published
    row at 100 marked not measured, cold / warm start-up and the highest GPU's peak; V3.2 under DP attention: the
    2k / 100 total against the published 27.7k; a rehearsal on 4 GPUs says it is not comparable."""
    page = load("eight_gpu_page")
    raw = tmp_path / "raw"
    for part in ("mtp", "warm", "plain"):
        (raw / part).mkdir(parents=True)
    (raw / "meta.txt").write_text("model=bench-glm5:78 tp=8 mode=tp engine=--kv-cache-dtype fp8 "
                                  "date=2026-12-05T10:00:00Z commit=abc1234\n")
    (raw / "gpus.txt").write_text("index, name, memory.used [MiB], memory.total [MiB]\n" +
                                  "".join(f"{i}, NVIDIA H200, 0 MiB, 143771 MiB\n" for i in range(8)))
    (raw / "parts.txt").write_text("mtp rc=0 seconds=300 limit=400\nwarm rc=0 seconds=70 limit=150\n"
                                   "plain skipped left=100 reason=budget\n")
    serve = "minidsa serve --model bench-glm5:78 --tp 8 --speculative-simulate-accept-len 3.2 --kv-cache-dtype fp8"
    mtp = _server(serve, {"itl_c1": (100.0, 120.0, 8.0), "itl_c16": (1200.0, 1500.0, 12.0),
                          "2k": (800.0, 17000.0, 20.0), "default": (5000.0, 9000.0, 25.0)}, 200.0,
                  {"0": 120000.0, "1": 125952.0})
    mtp["series"]["itl_c1"]["stdout_tail"] = "x" * 100
    plain = _server(serve.replace(" --speculative-simulate-accept-len 3.2", ""),
                    {"itl_c1": (50.0, 60.0, 20.0), "itl_c16": (800.0, 1000.0, 20.0)}, 90.0, {"0": 110000.0})
    for part, server in (("mtp", mtp), ("warm", _server(serve, {"warm_c1": (90.0, 100.0, 9.0)}, 60.0, {})),
                         ("plain", plain)):
        (raw / part / "serve_check.json").write_text(json.dumps(server))
    s = page.collect(str(raw))
    assert s["meta"]["device"] == "8 x NVIDIA H200" and s["meta"]["mode"] == "tp"
    assert "stdout_tail" not in s["servers"]["mtp"]["series"]["itl_c1"]
    text = page.page(json.loads(json.dumps(s)))
    assert "| 1 | 8 (0) / 8 (0) | 24.00 / 32.00 | 8.00 | 100.0 | 60.00 / 80.00 | 20.00 | 50.0 | 2.00x | 118 tok/s, " \
           "TPOT 7.5 ms, accept length 3.48 |" in text
    assert "| 16 | 8 (0) / 8 (0) |" in text and "| 1.50x | - |" in text
    assert "| 100 | not measured | | | | | | | | 1215 tok/s, TPOT 38.7 ms |" in text
    assert "| 2k in / 100 out | MTP 3/1/4 | 8 / 0 | 16200.0 | 800.0 | 17000.0 | 10.0 | 0.500 / 1.000 | - | - |" in text
    assert "the flags of its command below" in text and "(3.2 on average here)" in text
    assert "| MTP 3/1/4, first start (cold: an empty compile cache) | 200.0 | 195.0 | no artifacts for this " \
           "configuration yet | 3000000 | max 123.0 GiB (GPU 1) of 140.4; per GPU 0: 117.2, 1: 123.0 |" in text
    assert "| MTP 3/1/4 again (warm: the caches the first start filled) | 60.0 | 55.0 |" in text
    assert "| plain | skipped (100 s of the budget left) | | |" in text
    assert "Published: SGLang, GLM-5-FP8, 8xH200, TP8, MTP 3/1/4" in text
    assert "Published GLM-5 accept length: 3.48" in text
    assert "the published figures are at 1 and 100; here at 1, 16." in text and "Not comparable" not in text
    # DeepSeek-V3.2 under DP attention: the 2k / 100 total against 27.7k
    (raw / "meta.txt").write_text("model=bench-dsv32:61 tp=8 mode=dp engine=--kv-cache-dtype fp8 date=d commit=c\n")
    text = page.page(page.collect(str(raw)))
    assert "| 2k in / 100 out | MTP 3/1/4 | 8 / 0 | 16200.0 | 800.0 | 17000.0 | 10.0 | 0.500 / 1.000 | 27.7k total " \
           "tok/s at 2k in / 100 out | 0.61x |" in text
    assert "| 1 | 8 (0) / 8 (0) |" in text and "| 100 | not measured |" not in text
    assert "`--tp 8 --enable-dp-attention` here; published: TP8 with DP attention" in text
    # the x4 rehearsal: fewer layers on 4 GPUs
    (raw / "meta.txt").write_text("model=bench-dsv32:40 tp=4 mode=tp engine=--kv-cache-dtype fp8 date=d commit=c\n")
    text = page.page(page.collect(str(raw)))
    assert "Not comparable as it stands: 40 layers of 61 on 4 GPUs" in text
    assert "published: TP8 with DP attention" in text


def test_gpu_memory_peak_per_gpu():
    """nvidia-smi's CSV parsed per GPU; the peak keeps each GPU's highest sample; without nvidia-smi nothing."""
    sc = load("serve_check")
    assert sc.parse_gpu_memory("0, 1000, 143771\n1, 2000, 143771\nbad line\n") == {
        "0": (1000.0, 143771.0), "1": (2000.0, 143771.0)}
    peak = sc.GpuMemoryPeak(0)  # interval 0: no thread, no samples
    assert peak.peak_mib is None
    peak.peak_mib = {}
    for text in ("0, 1000, 143771\n1, 5000, 143771", "0, 3000, 143771\n1, 4000, 143771", ""):
        peak.add(sc.parse_gpu_memory(text))
    assert peak.peak_mib == {"0": 3000.0, "1": 5000.0} and peak.samples == 2
    assert sc.parse_series("itl_c16=--max-concurrency 16") == ("itl_c16", "--max-concurrency 16")
    with pytest.raises(Exception):
        sc.parse_series("no flags")


def test_every_test_selection_of_the_two_gpus_section_selects_gpu_tests():
    """Each `-k` of section_two_gpus selects at least one test of the file it names (collected here, skipped without
    GPUs): a renamed GPU test would otherwise drop out of the two-GPU call unnoticed."""
    script = open(os.path.join(REPO, "scripts", "gpu_check.sh")).read()
    section = script[script.index("section_two_gpus() {"):]
    section = section[:section.index("\n}\n")]
    selections = re.findall(r'budget_part (\w+) \d+ \d+ \$tests (\S+)(?: -k "([^"]+)")?', section)
    assert [name for name, _, _ in selections] == ["endings", "dp_attention", "allreduce", "tp_equality"]
    paths = {"$tp": "tests/gpu/test_tensor_parallel_gpu.py"}
    for name, path, expr in selections:
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               os.path.join(REPO, paths.get(path, path))] + (["-k", expr] if expr else [])
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120).stdout
        assert re.search(r"^\d+ tests? collected|^\d+/\d+ tests? collected", out, re.M), (name, out[-800:])
        assert not re.search(r"^0/\d+ tests collected|no tests collected", out, re.M), (name, out[-800:])
