"""The one-pass Triton sampler (minidsa.kernels.sampling) draws exactly the tokens of the torch exponential race.

The kernel runs under Triton's interpreter on CPU tensors (in a child process when this one already imported
compiled Triton). Same keys, same noise bits: every row must pick the same id as `sampling.sample` without the
kernel, for greedy rows, seeded and unseeded rows, several temperatures, bf16 and fp32 logits, and a
vocabulary that is not a multiple of the kernel's block.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_ops_gpu.py runs the compiled sampler", allow_module_level=True)

from triton_interp import import_kernels_interpreted  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.request import SamplingParams  # noqa: E402
from minidsa.sampling import Sampler, SamplingBatch, sample  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_sampling_kernel_in_child_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def _rows(n: int) -> list[SamplingParams]:
    kinds = [dict(temperature=0.0), dict(temperature=1.0, seed=7), dict(temperature=0.6), dict(temperature=1.3,
                                                                                             seed=123456789)]
    return [SamplingParams(**kinds[i % len(kinds)]).validate() for i in range(n)]


@in_this_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sampler_picks_the_torch_race_tokens(dtype):
    vocab, n = 5000, 24  # 5000: two full blocks of 2048 and a partial one
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    params = _rows(n)
    positions = list(range(3, 3 + n))
    sb = SamplingBatch.build(params, positions, random.Random(5), vocab, "cpu")
    want, _ = sample(logits, sb)
    got, _ = sample(logits, sb, fused=True)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    # greedy rows are the raw argmax; the others really sample (not all the argmax)
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(got[greedy], logits.float().argmax(-1)[greedy])
    assert (got[~greedy] != logits.float().argmax(-1)[~greedy]).any()


@in_this_process
def test_sampler_uses_the_kernel_only_without_filters():
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.8, seed=s).validate() for s in range(4)]
    fused, plain = Sampler(vocab, "cpu", fused=True), Sampler(vocab, "cpu", fused=False)
    assert torch.equal(fused(logits, params, [0] * 4).ids, plain(logits, params, [0] * 4).ids)
    # a top-p row takes the torch path (sort), and still agrees
    params[1] = SamplingParams(temperature=0.8, top_p=0.5, seed=1).validate()
    assert torch.equal(fused(logits, params, [0] * 4).ids, plain(logits, params, [0] * 4).ids)
    assert not Sampler(vocab, "cpu").fused  # chosen once: only a CUDA device takes the kernel by default
