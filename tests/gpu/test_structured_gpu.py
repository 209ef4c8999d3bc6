"""GPU: structured outputs. The one-pass mask kernel equals the torch reference at DeepSeek's vocabulary; the
embedded model on the GPU (CUDA graphs, overlapped scheduling) answers every bounded schema of the CPU tests with
valid JSON, the same tokens with overlap on and off, unconstrained requests unchanged beside constrained ones;
the two halves of a constrained decode step (forward, then mask copy + sampling) launch without a host sync.

Skipped without CUDA (CPU CI); run by scripts/gpu_check.sh (section structured). Needs xgrammar on the machine.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 129280


def _random_mask(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (rows, (VOCAB + 31) // 32), generator=g, device="cuda",
                          dtype=torch.int64)
    return words.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_kernel_equals_the_reference(dtype):
    from minidsa.kernels.sampling import apply_token_mask as fast
    from minidsa.common.sampling import TokenMask, apply_token_mask

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(96, VOCAB, device="cuda", generator=g) * 4).to(dtype)
    rows = torch.randperm(96, device="cuda", generator=g)[:64]
    mask = TokenMask(_random_mask(64, 1), rows)
    ref = apply_token_mask(logits.clone(), mask)
    assert torch.equal(fast(logits.clone(), mask), ref)
    assert (ref[rows] == float("-inf")).float().mean().item() == pytest.approx(0.5, abs=0.01)


def test_masked_rows_never_sample_a_disallowed_token():
    """The Triton race on masked logits (the noise floor included: 4096 seeded rows hit it ~30 times)."""
    from minidsa.common.request import SamplingParams
    from minidsa.common.sampling import Sampler, TokenMask, race_for, token_mask_for, unpack_bitmask

    n = 4096
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(n, VOCAB, device="cuda", generator=g).bfloat16()
    bitmask = _random_mask(n, 3) & _random_mask(n, 4) & _random_mask(n, 5)  # an eighth allowed
    sampler = Sampler(VOCAB, "cuda", race=race_for("triton"), mask=token_mask_for("triton"))
    params = [SamplingParams(temperature=1.0, seed=s).validate() for s in range(n)]
    ids = sampler(logits, params, [0] * n, mask=TokenMask(bitmask, torch.arange(n, device="cuda"))).ids
    assert unpack_bitmask(bitmask, VOCAB)[torch.arange(n, device="cuda"), ids].all()


def _llm(**kw):
    from minidsa import LLM

    return LLM(progress=False, max_running_requests=16, cuda_graph_max_bs=16, **kw)


def _free(llm) -> None:
    llm.engine.check_no_leaks()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_answers_follow_their_schemas_with_overlap_on_and_off():
    from json_check import check_against
    from test_structured_outputs import PROMPTS, _requests

    from minidsa import SamplingParams

    reqs = _requests()
    plain = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, temperature=1.0, seed=4)]
    tokens = {}
    for overlap in (True, False):
        llm = _llm(overlap_schedule=overlap, dtype="float32")  # bf16 near-ties may flip with the batch's shape
        assert llm.engine.overlap == overlap and llm.engine.runner.graphs is not None
        alone = llm.generate(PROMPTS, plain)
        outs = llm.generate([p for p, _ in reqs] + PROMPTS, [sp for _, sp in reqs] + plain)
        for (_, params), out in zip(reqs, outs):
            assert out.finish_reason == "stop", (out.finish_reason, out.text)
            check_against(json.loads(out.text), params.response_format["json_schema"]["schema"])
        assert [o.token_ids for o in outs[len(reqs):]] == [o.token_ids for o in alone]
        tokens[overlap] = [o.token_ids for o in outs]
        _free(llm)
    assert tokens[True] == tokens[False]


def test_constrained_decode_steps_launch_without_a_host_sync():
    from test_structured_outputs import PERSON, PROMPTS, json_schema

    from minidsa import SamplingParams
    from minidsa.common.plan import StepKind

    llm = _llm()
    worker = llm.engine.worker
    launch, launch_sampling = worker.launch, worker.launch_sampling
    checked = []

    def strict(fn, plan, *args):
        if plan.kind != StepKind.DECODE:
            return fn(*args)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(fn.__name__)

    params = SamplingParams(max_tokens=96, temperature=1.0, seed=1, response_format=json_schema(PERSON))
    llm.generate(PROMPTS * 2, params)  # warm-up: first-call costs are not the hot path
    worker.launch = lambda plan: strict(launch, plan, plan)
    worker.launch_sampling = lambda pending, bitmask: strict(launch_sampling, pending.plan, pending, bitmask)
    outs = llm.generate(PROMPTS * 4, params)
    del worker.launch, worker.launch_sampling
    assert "launch_sampling" in checked and all(o.finish_reason == "stop" for o in outs)
    _free(llm)
