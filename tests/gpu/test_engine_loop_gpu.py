"""GPU: the engine loop (issue 16). Overlapped scheduling gives the tokens of the plain loop, a decode step is
launched without a host sync, and the mixed step runs beside CUDA graphs without leaking KV.

Skipped without CUDA (CPU CI); run by scripts/gpu_check.sh (section engine_loop) on the GPU machine.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = dict(max_tokens=24, ignore_eos=True, detokenize=False)


def _prompts(n: int, length: int, vocab: int = 120000) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1000, vocab - 1, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def _llm(**kw):
    from minidsa import LLM

    return LLM(progress=False, max_running_requests=8, cuda_graph_max_bs=8, **kw)


def _free(llm) -> None:
    llm.engine.check_no_leaks()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mixed", [False, True])
def test_overlap_gives_the_tokens_of_the_plain_loop(mixed):
    from minidsa import SamplingParams

    prompts = _prompts(6, 300)
    outs = {}
    for overlap in (False, True):
        llm = _llm(overlap_schedule=overlap, enable_mixed_chunk=mixed, chunked_prefill_size=256)
        assert llm.engine.overlap == overlap and llm.engine.runner.graphs is not None
        # Staggered: two requests first, the rest join while they decode (mixed steps when enabled).
        first = llm.generate(prompts[:2], SamplingParams(**PARAMS))
        rest = llm.generate(prompts, SamplingParams(**PARAMS))
        outs[overlap] = [o.token_ids for o in first + rest]
        _free(llm)
    assert outs[True] == outs[False]


def test_decode_step_is_launched_without_a_host_sync():
    """Planning and launching a pure decode step (graph replay, sampling, the copy of the ids to the host,
    the event) never waits for the device: the one sync is when the tokens are taken."""
    from minidsa import SamplingParams
    from minidsa.common.plan import StepKind

    llm = _llm()
    engine = llm.engine
    launch = engine.worker.launch
    checked = []

    def strict(plan):
        if plan.kind != StepKind.DECODE:
            return launch(plan)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(plan.batch_size)

    llm.generate(_prompts(4, 200), SamplingParams(**PARAMS))  # warm-up: first-call costs are not the hot path
    engine.worker.launch = strict
    outs = llm.generate(_prompts(4, 200), SamplingParams(**PARAMS))
    del engine.worker.launch
    assert checked and all(len(o.token_ids) == PARAMS["max_tokens"] for o in outs)
    _free(llm)
