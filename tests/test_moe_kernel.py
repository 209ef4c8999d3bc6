"""The earlier decode-only expert kernels (minidsa.kernels.moe) against the fused MoE's torch reference, on CPU.

minidsa.kernels.moe is no longer wired into the model (the fused MoE serves every token count); it stays
as the decode baseline of benchmarks/bench_moe.py until that GPU measurement decides whether it goes.

Runs through Triton's interpreter (see tests/test_kernels.py for how it is
switched on, and the child-process fallback). Tiny sizes, fresh random
inputs per case, outputs poisoned (every torch.empty comes back NaN), so a
pair row or output row the kernels forget shows. The interpreter's tl.dot
gets bf16 wrong (triton 3.9), so the cases run fp16 and fp32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: benchmarks/bench_moe.py runs the compiled kernels", allow_module_level=True)

from triton_interp import import_kernels_interpreted  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import moe  # noqa: E402
from minidsa.kernels.fused_moe import fused_moe_reference  # noqa: E402
from minidsa.models.deepseek_v32 import Experts  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_moe_kernels_in_child_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


_real_empty = torch.empty


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _real_empty(*a, **k).fill_(float("nan")))


def make_experts(n_experts: int, hidden: int, inter: int, dtype: torch.dtype, g: torch.Generator) -> Experts:
    experts = Experts(SimpleNamespace(n_routed_experts=n_experts, hidden_size=hidden, moe_intermediate_size=inter))
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(n_experts, 2 * inter, hidden, generator=g) * hidden**-0.5)
        experts.down_proj.copy_(torch.randn(n_experts, hidden, inter, generator=g) * inter**-0.5)
    return experts.to(dtype)


def routing(num_tokens: int, n_experts: int, top_k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (what the router's top-k gives) and positive weights."""
    ids = torch.rand(num_tokens, n_experts, generator=g).topk(top_k, dim=-1).indices
    return ids, torch.rand(num_tokens, top_k, generator=g) * 2


def reference(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The fused MoE's torch reference in fp32."""
    with torch.no_grad():
        return fused_moe_reference(x.float(), ids, weights, experts.gate_up_proj.float(), experts.down_proj.float())


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


CASES = [
    # tokens, experts, top-k, hidden, intermediate, tiles
    (1, 8, 2, 64, 32, moe.MoETiles(16, 32, 16, 16, 2, 4)),
    (3, 8, 3, 96, 48, moe.MoETiles(32, 64, 64, 32, 2, 4)),  # uneven reduction and row tails in both kernels
    (5, 4, 4, 32, 16, moe.MoETiles()),  # every expert chosen by several tokens; default tiles
    (70, 6, 2, 32, 16, moe.MoETiles(16, 16, 16, 16, 2, 4)),  # past MAX_BLOCK_T: two token tiles
]


@in_this_process
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_moe_experts_match_reference(case, dtype):
    num_tokens, n_experts, top_k, hidden, inter, tiles = CASES[case]
    g = torch.Generator().manual_seed(case * 10 + (dtype == torch.float32))
    experts = make_experts(n_experts, hidden, inter, dtype, g)
    x = torch.randn(num_tokens, hidden + 8, generator=g).to(dtype)[:, :hidden]  # rows with a stride
    ids, weights = routing(num_tokens, n_experts, top_k, g)
    got = moe.moe_experts(x, ids, weights, experts.gate_up_proj.data, experts.down_proj.data, tiles)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert rel_err(got, reference(experts, x, ids, weights)) < (2e-3 if dtype == torch.float16 else 1e-5)
    # deterministic: no atomics, the k partials summed by torch
    again = moe.moe_experts(x, ids, weights, experts.gate_up_proj.data, experts.down_proj.data, tiles)
    assert torch.equal(got, again)


@in_this_process
def test_bad_input_is_named():
    g = torch.Generator().manual_seed(8)
    experts = make_experts(4, 32, 16, torch.float16, g)
    gu, dn = experts.gate_up_proj.data, experts.down_proj.data
    x = torch.randn(2, 32, generator=g).half()
    ids, weights = routing(2, 4, 2, g)
    with pytest.raises(ValueError, match="ids and weights"):
        moe.moe_experts(x, ids, weights[:, :1], gu, dn)
    with pytest.raises(ValueError, match="down_proj"):
        moe.moe_experts(x, ids, weights, gu, dn[:, :, :8])
    with pytest.raises(ValueError, match="share a dtype"):
        moe.moe_experts(x.float(), ids, weights, gu, dn)
    with pytest.raises(ValueError, match="int32 or int64"):
        moe.moe_experts(x, ids.float(), weights, gu, dn)
