"""Issue 48's section `multi_gpu` (scripts/gpu_check.sh) on the CPU: benchmarks/scripts/serve_check.py drives a
2-rank gloo server through the guides' recipe (MTP 3/1/4) and checks it end to end; benchmarks/scripts/multi_gpu_page.py
gathers the parts' outputs and writes the page for benchmarks/multi_gpu/NOTES.md from a synthetic summary (the
figures here are made up; only the arithmetic and the layout are checked). What only runs on GPUs (NCCL, CUDA
graphs, nvidia-smi's process list) is left to the section itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
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


def test_serve_check_on_cpu(tmp_path):
    """Two gloo ranks serving the recipe (MTP 3/1/4) on the tiny preset: every check passes, nothing is left."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "serve_check.py"), "--out", str(tmp_path),
                           "--model", "tiny", "--tp", "2", "--requests", "4", "--concurrency", "2",
                           "--bench-args=--input-len 16-32 --output-len 4-8", "--",
                           "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048",
                           "--speculative-num-steps", "3", "--speculative-topk", "1",
                           "--speculative-num-draft-tokens", "4"], env=env, capture_output=True, text=True,
                          timeout=240)
    with open(tmp_path / "serve_check.json") as f:
        r = json.load(f)
    assert proc.returncode == 0 and r["ok"], (r.get("checks"), r.get("error"), proc.stdout[-2000:])
    assert r["bench"]["completed"] == 4 and r["bench"]["failed"] == 0
    assert r["after"]["kv_cache_used_tokens"] == 0 and r["kv_total_tokens"] > 0
    assert len(r["rank_pids"]) == 1 and r["exit_s"] <= 10 and r["gpu_compute_processes"] is None


@pytest.mark.parametrize("script", ["profile_tp.py", "serve_check.py", "multi_gpu_page.py"])
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
