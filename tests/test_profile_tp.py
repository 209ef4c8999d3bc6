"""benchmarks/scripts/profile_tp.py (issue 48) on the CPU: a tensor-parallel engine (2 gloo ranks, tiny preset)
put into steady decode and profiled; the tables have every category, the collectives of the forward are in them,
and the rows add up to no more than the profiled step. On the CPU the rows are CPU ops (self time of the engine's
thread), not kernels: what runs on the GPU (CUDA kernels, NCCL, CUDA graphs) is checked only by running it there
(scripts/gpu_check.sh multi_gpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_scripts import REPO, load, script_path

SCRIPT = script_path("profile_tp")
ARGS = ["--allow-cpu", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--tp", "2", "--batches", "1", "3",
        "--steps", "3", "--prompt-len", "16", "--max-total-tokens", "2048", "--max-running-requests", "4"]


def _run(tmp_path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MINIDSA_COMMIT": "test"}
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), *ARGS, *extra], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "profile_tp.json") as f:
        result = json.load(f)
    assert (tmp_path / "profile_tp.md").read_text().count("| collectives |") >= 2
    return result


def _check_profile(p: dict, names: list[str]) -> None:
    assert list(p["categories"]) == names
    total = sum(c["us_per_step"] for c in p["categories"].values())
    assert total == pytest.approx(1e3 * p["kernel_ms"], rel=1e-6)
    assert 0 < p["kernel_ms"] <= p["step_ms"] * 1.001  # one thread's self times fit in the window
    assert p["busy_ms"] <= p["step_ms"] * 1.001 and p["gap_ms"] >= -0.001 * p["step_ms"]
    coll = p["categories"]["collectives"]
    assert coll["count_per_step"] > 0 and coll["us_per_step"] > 0  # gloo all-reduce / all-gather of the forward
    assert any(c["us_per_step"] > 0 for name, c in p["categories"].items() if name in ("GEMM", "MoE"))
    assert 0 < len(p["top"]) <= 20
    assert sorted((k["us_per_step"] for k in p["top"]), reverse=True) == [k["us_per_step"] for k in p["top"]]


def test_profile_tp_rank0_on_cpu(tmp_path):
    mod = load("profile_tp")
    r = _run(tmp_path)
    assert r["tp"] == 2 and r["device"] == "cpu" and r["commit"] == "test" and "--tp 2" in r["command"]
    assert r["kv_total_tokens"] > 0 and r["startup_s"] > 0
    assert [b["batch"] for b in r["batches"]] == [1, 3]
    for b in r["batches"]:
        assert b["steps"] == 3 and b["step_ms"] > 0 and b["tok_per_s"] > 0 and b["itl_ms"] > 0
        assert sum(b["forward_gpu_ms_per_step"].values()) > 0
        _check_profile(b["profile"], mod.CATEGORY_NAMES)
        assert any("c10d" in k["name"] or "all_reduce" in k["name"] for k in b["profile"]["all"]
                   if k["category"] == "collectives")


def test_profile_tp_all_ranks_on_cpu(tmp_path):
    """--all-ranks: one process per rank (the engine's torchrun launch), rank 1's tables merged into rank 0's."""
    mod = load("profile_tp")
    r = _run(tmp_path, "--all-ranks")
    assert set(r["ranks"]) == {"1"} and set(r["ranks"]["1"]) == {"1", "3"}
    for per in r["ranks"]["1"].values():
        assert per["plans_in_window"] >= per["steps"] == 3
        _check_profile(per, mod.CATEGORY_NAMES)
    assert not list(tmp_path.glob("profile_tp_rank*.json"))
    assert "rank 1" in (tmp_path / "profile_tp.md").read_text()


@pytest.mark.parametrize("name, want", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("_one_shot_all_reduce_kernel", "collectives"),
    ("_expert_gemm_kernel", "MoE"),
    ("_count_kernel", "MoE"),
    ("_route_kernel", "MoE"),
    ("void deep_gemm::sm90_m_grouped_fp8_gemm_masked_1d2d_impl<...>", "MoE"),
    ("_split_count_kernel", "indexer"),
    ("_register_topk_kernel", "indexer"),
    ("_paged_logits_kernel", "indexer"),
    ("void deep_gemm::sm90_fp8_paged_mqa_logits<...>", "indexer"),
    ("_sparse_mla_kernel", "attention"),
    ("void flash::flash_fwd_splitkv_mla_kernel<...>", "attention"),
    ("_w8a8_gemm_kernel", "FP8 GEMM"),
    ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<...>", "FP8 GEMM"),
    ("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", "GEMM"),
    ("_gemv_kernel", "GEMM"),
    ("_rmsnorm_quant_kernel", "norms / rope / quant"),
    ("_swiglu_quant_kernel", "norms / rope / quant"),
    ("_race_kernel", "sampling"),
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, ...>", "memcpy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>", "other"),
])
def test_kernel_categories(name, want):
    assert load("profile_tp").category(name) == want


def test_kernel_table_from_device_events():
    """The GPU branch on made-up kernel events: per-step counts and times, busy time as the union of overlapping
    kernels (a side stream), the gap, CPU events left out."""
    import torch
    from torch.autograd.profiler_util import Interval

    class Ev:
        def __init__(self, name, start, end, device=torch.autograd.DeviceType.CUDA):
            self.name, self.time_range, self.device_type = name, Interval(start, end), device

    events = [Ev("_w8a8_gemm_kernel", 0, 100), Ev("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 100, 150),
              Ev("_race_kernel", 140, 160),  # overlaps the all-reduce by 10 us
              Ev("_w8a8_gemm_kernel", 1000, 1100), Ev("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 1100, 1150),
              Ev("_race_kernel", 1140, 1160), Ev("aten::mm", 0, 5000, torch.autograd.DeviceType.CPU)]
    p = load("profile_tp").summarise(events, steps=2, wall_ms=1.0, on_cuda=True)
    assert p["kernels_per_step"] == 3 and p["kernel_ms"] == pytest.approx(0.17)
    assert p["busy_ms"] == pytest.approx(0.16) and p["gap_ms"] == pytest.approx(0.84)
    c = p["categories"]
    assert c["FP8 GEMM"]["us_per_step"] == 100 and c["collectives"]["count_per_step"] == 1
    assert c["sampling"]["share_of_step"] == pytest.approx(0.02) and c["GEMM"]["count_per_step"] == 0
    assert [k["name"] for k in p["top"]][0] == "_w8a8_gemm_kernel"
