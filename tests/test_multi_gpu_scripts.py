"""Issue 48's section `multi_gpu` and issue 49's `dp_attention` (scripts/gpu_check.sh) on the CPU.

multi_gpu: benchmarks/scripts/serve_check.py drives a 2-rank gloo server through the guides' recipe (MTP 3/1/4) and
checks it end to end; benchmarks/scripts/multi_gpu_page.py gathers the parts' outputs and writes the page for
benchmarks/multi_gpu/NOTES.md from a synthetic summary (the figures here are made up; only the arithmetic and the
layout are checked).

dp_attention: benchmarks/scripts/bench_moe_exchange.py's three exchanges over 2 gloo ranks give the reference bit for
bit; benchmarks/scripts/dp_attention_page.py's ratios and pass / fail from made-up sides; the section itself on a CPU
(DP_CPU_SMOKE: a DP-attention side of the tiny model and the exchange; a budget that fits nothing skips and fails).

What only runs on GPUs (NCCL, CUDA graphs, nvidia-smi's process list, the timings) is left to the sections.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "benchmarks", "scripts")


def _module(name: str):
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _profile(preset: str, tp: int, steps: dict[int, float], collectives_us: float) -> dict:
    names = _module("profile_tp").CATEGORY_NAMES
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
    page = _module("multi_gpu_page")
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
    page = _module("multi_gpu_page")
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
    sc = _module("serve_check")
    text = ('# HELP minidsa_kv_cache_used_tokens KV\nminidsa_kv_cache_used_tokens{model_name="m"} 0\n'
            'minidsa_kv_cache_usage_ratio{model_name="m"} 0.25\n'
            'minidsa_request_finish_total{model_name="m",reason="stop"} 3\n'
            'minidsa_time_to_first_token_seconds_bucket{model_name="m",le="0.1"} 2\n')
    assert sc.parse_metrics(text) == {"minidsa_kv_cache_used_tokens": 0.0, "minidsa_kv_cache_usage_ratio": 0.25}


@pytest.mark.parametrize("dp", [False, True], ids=["tp", "dp-attention"])
def test_serve_check_on_cpu(tmp_path, dp):
    """Two gloo ranks serving the recipe (MTP 3/1/4) on the tiny preset, under tensor parallelism or DP attention:
    every check passes, nothing is left."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "serve_check.py"), "--out", str(tmp_path),
                           "--model", "tiny", "--tp", "2", "--requests", "4", "--concurrency", "2",
                           "--bench-args=--input-len 16-32 --output-len 4-8", "--",
                           "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048",
                           "--speculative-num-steps", "3", "--speculative-topk", "1",
                           "--speculative-num-draft-tokens", "4", *(["--enable-dp-attention"] if dp else [])],
                          env=env, capture_output=True, text=True, timeout=240)
    with open(tmp_path / "serve_check.json") as f:
        r = json.load(f)
    assert proc.returncode == 0 and r["ok"], (r.get("checks"), r.get("error"), proc.stdout[-2000:])
    assert r["bench"]["completed"] == 4 and r["bench"]["failed"] == 0
    assert r["after"]["kv_cache_used_tokens"] == 0 and r["kv_total_tokens"] > 0
    assert len(r["rank_pids"]) == 1 and r["exit_s"] <= 10 and r["gpu_compute_processes"] is None


@pytest.mark.parametrize("script", ["profile_tp.py", "serve_check.py", "multi_gpu_page.py", "bench_dp_attention.py",
                                    "bench_moe_exchange.py", "dp_attention_page.py"])
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
    ex = _module("bench_moe_exchange")
    shares = ex.expert_shares(world=4, rows=16, experts=256, top_k=8, seed=3)
    assert shares.shape == (64, 4) and int(shares.sum(1).min()) >= 8 and int(shares.sum(1).max()) <= 16
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.rand(64, 256, generator=g).topk(8, dim=1).indices
    held = torch.zeros(64, 4, dtype=torch.bool).scatter_(1, ids // 64, True)
    assert torch.equal(shares != 0, held)
    assert torch.equal(ex.check_weights(shares)[:, 3], 4 * shares[:, 3])


def _side(label: str, gpus: int, dp: bool, kv: int, tok_s: float, itl_p99_ms: float, startup: float) -> dict:
    bs = 64 * gpus
    return {"label": label, "side": _module("bench_dp_attention").side_name(gpus, dp), "gpus": gpus,
            "dp_attention": dp, "attention_ranks": gpus if dp else 1, "preset": "bench-dsv32:10",
            "device": "NVIDIA H200", "date": "2026-12-02 10:00 UTC", "commit": "abc1234",
            "command": f"python3 benchmarks/scripts/bench_dp_attention.py --label {label} --tp {gpus}",
            "max_running_requests": 64, "startup_s": startup, "kv_total_tokens": kv,
            "bench": {"workload": {"num_requests": 256 * gpus}, "workload_scale": gpus,
                      "results": {"output_tokens_per_s": tok_s, "itl_s": {"p50": itl_p99_ms / 2e3,
                                                                          "p99": itl_p99_ms / 1e3},
                                  "ttft_s": {"p50": 1.0, "p99": 2.0}, "timeline": [[0.1, 5, 0]] * 100}},
            "decode": [{"batch": 1, "batch_asked": "1", "step_ms": 10.0, "tok_per_s": 100.0},
                       {"batch": bs, "batch_asked": "64/gpu", "step_ms": 20.0, "tok_per_s": bs * 50.0}]}


def test_dp_attention_page_ratios_and_targets(tmp_path):
    """The sides' ratios and the issue's targets: KV 4.0x passes 3.5x, tok/s 3.0x fails 3.2x but beats TP (1.2x),
    ITL p99 1.625x of TP's fails 1.5x; a side not measured leaves its targets 'not measured'."""
    page = _module("dp_attention_page")
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
           "DP_SIDE_ARGS": "--num-requests 2 --input-len 16-32 --output-len 4-8 --prompt-len 16 --decode-tokens 4",
           "DP_EXCHANGE_ROWS": "1", "DP_EXCHANGE_ARGS": "--hidden 64 --replays 2 --top-k 2", **env}
    return subprocess.run(["bash", str(tree / "scripts" / "gpu_check.sh"), "dp_attention"], env=env,
                          capture_output=True, text=True, timeout=240)


def test_dp_attention_section_on_cpu(tmp_path):
    """The section's DP-attention side and exchange parts on a CPU: the summary holds the side (KV capacity = both
    ranks' caches), the exchange's equal outputs and the parts' exit status; the raw outputs are tarred."""
    proc = _section(tmp_path, DP_PARTS="dp exchange")
    out = tmp_path / "out"
    log = (out / "dp_attention.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    with open(out / "dp_attention.json") as f:
        s = json.load(f)
    dp = s["sides"]["dp"]
    assert dp["dp_attention"] and dp["gpus"] == 2 and dp["kv_total_tokens"] == 2 * 2048
    assert dp["bench"]["workload"]["num_requests"] == 4 and dp["bench"]["results"]["output_tokens"] > 0
    assert [(d["batch_asked"], d["batch"]) for d in dp["decode"]] == [("1", 1), ("2/gpu", 4)]
    assert all(all(x["equal"].values()) for x in s["exchange"]["results"])
    assert s["parts"]["dp"]["rc"] == 0 and s["parts"]["exchange"]["rc"] == 0
    assert s["meta"]["model"] == "tiny" and s["meta"]["commit"] == "test"
    text = (out / "dp_attention.md").read_text()
    assert "| KV capacity, tokens | 4096 |" in text and "## The MoE exchange" in text
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
