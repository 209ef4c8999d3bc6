"""The engine loop: the plan / result interface, overlapped scheduling and mixed prefill + decode steps.

Prompts are longer than the preset's index_topk, so attention is really sparse. Plans are observed by
wrapping the worker's `launch` (a test-side collaborator; the engine has no recording hook).
"""

from __future__ import annotations

import pickle
import random

import pytest

from minidsa import SamplingParams
from minidsa.engine import Engine
from minidsa.common.plan import StepKind, StepPlan

MAX_TOKENS = 12


def cpu_engine(**kw) -> Engine:
    return Engine(device="cpu", dtype="float32", progress=False, **kw)


def record_plans(engine: Engine) -> list[StepPlan]:
    """Every plan the engine hands its worker from now on, in launch order."""
    plans: list[StepPlan] = []
    launch = engine.worker.launch

    def recording(plan: StepPlan):
        plans.append(plan)
        return launch(plan)

    engine.worker.launch = recording
    return plans


def run_all(engine: Engine, prompts, params) -> tuple[list, dict[str, list]]:
    """Final outputs in prompt order, and every output each request got (in order)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    seen: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    return [seen[i][-1] for i in ids], seen


@pytest.fixture(scope="module")
def reference(tiny_llm, long_prompts) -> list[list[int]]:
    """Greedy outputs of each long prompt alone (the shared engine: overlap and mixed steps at defaults)."""
    return [tiny_llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
            for p in long_prompts]


def test_plan_is_plain_data_that_survives_a_round_trip(long_prompts):
    """What a tensor-parallel rank would receive: a pickled plan equal to the original, with no tensors."""
    engine = cpu_engine()
    plans = record_plans(engine)
    run_all(engine, long_prompts[:2], SamplingParams(max_tokens=3, ignore_eos=True))
    assert {p.kind for p in plans} >= {StepKind.EXTEND, StepKind.DECODE}
    for plan in plans:
        assert pickle.loads(pickle.dumps(plan)) == plan
        stack = [vars(plan)]
        while stack:
            for v in stack.pop().values():
                assert not hasattr(v, "device"), f"a tensor in the plan: {type(v).__name__}"
                if isinstance(v, (list, tuple)):
                    stack.append(dict(enumerate(v)))
        assert len(plan.rows) == len(plan.prefix_lens) == len(plan.extend_lens) == len(plan.sample)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mixed,mixed_budget,page_size", [
    (True, None, 1), (False, None, 1),
    (True, 3, 1), (True, 3, 4),  # a mixed prefill budget below a chunk, and below a page
])
def test_overlap_and_mixed_steps_and_mixed_budgets_give_the_same_tokens(long_prompts, reference, overlap, mixed,
                                                                        mixed_budget, page_size):
    budget = {} if mixed_budget is None else {"max_mixed_prefill_tokens": mixed_budget}
    engine = cpu_engine(overlap_schedule=overlap, enable_mixed_chunk=mixed, chunked_prefill_size=32,
                        max_prefill_tokens=48, page_size=page_size, **budget)
    plans = record_plans(engine)
    finals, _ = run_all(engine, long_prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in finals] == reference
    mixed_steps = [p for p in plans if p.kind == StepKind.EXTEND and p.has_decode_rows]
    assert bool(mixed_steps) == mixed, {p.kind for p in plans}  # chunks rode along with decode rows, or never
    cap = min(48, mixed_budget or 48)
    for plan in plans:
        prefill_tokens = sum(n for n, decoding in zip(plan.extend_lens, plan.from_device) if not decoding)
        if plan.kind == StepKind.EXTEND and plan.has_decode_rows:
            assert 0 < prefill_tokens <= cap
    if mixed_budget is not None:  # an idle engine still prefills with the whole max_prefill_tokens
        assert max(p.num_tokens for p in plans if p.kind == StepKind.EXTEND) > mixed_budget


def test_mixed_steps_keep_decoders_running_while_a_long_prompt_prefills(long_prompts, reference):
    """Greedy output identical to unmixed, and a decoder gets a token in every step of the other's prefill."""
    engine = cpu_engine(chunked_prefill_size=16, max_prefill_tokens=24)
    plans = record_plans(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    first = engine.add_request(long_prompts[0], params)
    outs: dict[str, list[int]] = {first: []}
    while not engine.requests[first].output_ids:
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    second = engine.add_request(long_prompts[3], params)  # prefilled in chunks of 16 over several steps
    outs[second] = []
    steps_with_chunks = 0
    while engine.has_unfinished():
        n = len(plans)
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        for plan in plans[n:]:
            if plan.kind == StepKind.EXTEND and plan.has_decode_rows:
                steps_with_chunks += 1
                assert plan.from_device[0] and plan.request_ids[0] == first  # decode rows first
                assert sum(plan.extend_lens) <= 24  # the step's token budget
    assert steps_with_chunks >= 3
    assert outs[first] == reference[0] and outs[second] == reference[3]


def test_a_stop_in_step_n_emits_nothing_from_step_n_plus_1(tiny_llm, long_prompts, reference):
    """Under overlap the step after the stop is planned before the stop is seen: its token is dropped, the
    request's KV is freed once, and the other requests are not disturbed."""
    engine = tiny_llm.engine
    assert engine.overlap
    plans = record_plans(engine)
    try:
        stop = reference[1][4]
        cut = reference[1].index(stop) + 1
        params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                  SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop])]
        finals, seen = run_all(engine, long_prompts[:2], params)
    finally:
        del engine.worker.launch
    assert finals[1].token_ids == reference[1][:cut] and finals[1].finish_reason == "stop"
    assert finals[0].token_ids == reference[0]
    stream = [t for o in seen[finals[1].request_id] for t in o.new_token_ids]
    assert stream == reference[1][:cut]  # nothing after the stop, not even in a later output
    assert sum(o.finished for o in seen[finals[1].request_id]) == 1
    # The scenario happened: the request was planned for a token after the one that stopped it.
    planned = sum(p.sample[p.request_ids.index(finals[1].request_id)] for p in plans
                  if finals[1].request_id in p.request_ids)
    assert planned == cut + 1
    engine.check_no_leaks()


def test_abort_between_plan_and_result(long_prompts, reference):
    engine = cpu_engine()
    plans = record_plans(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    keep = engine.add_request(long_prompts[0], params)
    gone = engine.add_request(long_prompts[1], params)
    got: dict[str, list] = {keep: [], gone: []}
    while len(got[gone]) < 3:
        for o in engine.step():
            got[o.request_id].append(o)
    assert gone in plans[-1].request_ids  # launched, its token not delivered yet
    assert engine.abort(gone)
    engine.check_no_leaks()  # freed at once: later steps may take its pages
    after = engine.add_request(long_prompts[2], params)  # reuses the freed row and pages at once
    got[after] = []
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].append(o)
    aborted = got[gone][3:]
    assert [o.finish_reason for o in aborted] == ["abort"] and aborted[0].new_token_ids == []
    assert all(not o.finished for o in got[gone][:3])
    assert got[keep][-1].token_ids == reference[0] and got[after][-1].token_ids == reference[2]


def test_preemption_under_overlap_and_mixed_steps_matches_ample_memory(tiny_llm):
    """KV pressure while a step is always in flight: preempted requests (some with a token in flight)
    are recomputed and produce what they produce with ample memory, greedy and seeded alike."""
    topk = tiny_llm.engine.model_config.index_topk
    rng = random.Random(11)
    prompts = [[rng.randint(1000, 100000) for _ in range(n)] for n in (topk + 9, topk + 18, topk + 13, 2 * topk)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[7])]
    ample = [tiny_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    for overlap in (True, False):
        engine = cpu_engine(max_total_tokens=160, overlap_schedule=overlap)
        finals, seen = run_all(engine, prompts, params)
        assert engine.metrics().preemptions_total > 0
        assert [o.token_ids for o in finals] == ample, overlap
        for rid, outs in seen.items():  # each token delivered once, in order, whatever was recomputed
            assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
        assert engine.metrics().kv_used_tokens == 0


def test_penalised_requests_run_without_overlap_and_match(tiny_llm, long_prompts):
    """Penalties need every output id when a step is planned: those steps wait for the previous tokens."""
    params = SamplingParams(max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5)
    want = [tiny_llm.generate([p], params)[0].token_ids for p in long_prompts[:2]]
    for overlap in (True, False):
        engine = cpu_engine(overlap_schedule=overlap)
        finals, _ = run_all(engine, long_prompts[:2], params)
        assert [o.token_ids for o in finals] == want


def test_a_second_worker_fed_the_same_plans_produces_the_same_results(long_prompts):
    """The tensor-parallel contract: plans are all a worker needs. Another engine's worker, fed only the
    (pickled) plans of the first, returns the same tokens and logprobs, greedy, seeded and unseeded alike."""
    first = cpu_engine(chunked_prefill_size=32, max_prefill_tokens=48)
    steps = []
    launch = first.worker.launch

    def recording(plan):
        pending = launch(plan)
        steps.append((pickle.dumps(plan), pending))
        return pending

    first.worker.launch = recording
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=3),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, prompt_logprobs=1)]
    run_all(first, long_prompts[:3], params)
    second = cpu_engine(chunked_prefill_size=32, max_prefill_tokens=48)
    assert any(plan.kind == StepKind.EXTEND and plan.has_decode_rows for plan in (pickle.loads(p) for p, _ in steps))
    for blob, pending in steps:
        assert second.worker.execute(pickle.loads(blob)) == pending.result()
