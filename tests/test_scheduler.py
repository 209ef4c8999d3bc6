"""Scheduler policy without a model: chunking, budgets, admission, preemption, abort, KV bookkeeping."""

from __future__ import annotations

import pytest
import torch

from minidsa.common.plan import StepKind
from minidsa.common.kv_cache import ReqToTokenTable
from minidsa.sched.pages import PageAllocator, RowAllocator
from minidsa.common.request import Request, RequestStatus, SamplingParams
from minidsa.sched.scheduler import Scheduler


def make(num_pages=64, page_size=4, max_reqs=8, width=256, **kw) -> Scheduler:
    args = dict(max_running_requests=max_reqs, max_prefill_tokens=64, chunked_prefill_size=32, decode_reserve=1)
    args.update(kw)
    s = Scheduler(PageAllocator(num_pages, page_size), RowAllocator(max_reqs), **args)
    s.table = ReqToTokenTable(max_reqs, width, "cpu")  # the worker's req_to_token, written by run_step
    return s


def is_mixed(sched) -> bool:
    """Prefill chunks riding along with decode rows: an EXTEND step with decode rows."""
    return sched.kind == StepKind.EXTEND and sched.num_decode > 0


def req(i: int, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(request_id=f"r{i}", prompt_ids=list(range(1, prompt_len + 1)), params=SamplingParams(max_tokens=max_tokens))


def check_rows(s: Scheduler) -> None:
    """Every running request's req_to_token row maps its positions onto its own pages' slots."""
    ps = s.page_size
    for r in s.running:
        n = len(r.pages) * ps
        want = torch.tensor([r.pages[p // ps] * ps + p % ps for p in range(n)], dtype=torch.int32)
        assert torch.equal(s.table.req_to_token[r.row, :n], want)
        assert r.seq_len <= n


def run_step(s: Scheduler) -> tuple:
    """Plan a step and play the engine's and the worker's part: write the page table, cache the tokens,
    append one to requests that completed."""
    sched = s.schedule()
    if sched is None:
        return None
    for w in s.take_table_writes():
        s.table.write_pages(w.row, w.first_page, w.pages, s.page_size)
    check_rows(s)
    s.check_consistent()
    for b, (r, n) in enumerate(zip(sched.reqs, sched.extend_lens)):
        assert r.status == RequestStatus.RUNNING and r.row >= 0
        if b >= sched.num_decode:
            assert len(r.pages) * s.page_size >= r.seq_len + n
            r.seq_len += n
        else:
            assert r.seq_len == r.num_tokens - 1
            assert len(r.pages) * s.page_size >= r.seq_len + s.decode_reserve
            r.seq_len += 1
        if not r.in_prefill:
            r.output_ids.append(7)
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r)
    return sched


def drain(s: Scheduler, limit: int = 10_000) -> list:
    log = []
    while s.waiting or s.running:
        sched = run_step(s)
        assert sched is not None, "scheduler stalled"
        log.append(sched)
        assert len(log) < limit
    s.check_consistent()
    s.allocator.check_all_free()
    s.rows.check_all_free()
    return log


@pytest.mark.smoke
def test_long_prompt_is_chunked_and_budget_respected():
    s = make(chunked_prefill_size=16, max_prefill_tokens=40)
    reqs = [req(0, 50), req(1, 10), req(2, 30)]
    for r in reqs:
        s.add(r)
    first = run_step(s)
    assert first.kind == StepKind.EXTEND and first.extend_lens == [16]  # r0 chunk ends the batch
    second = run_step(s)
    assert second.reqs[0] is reqs[0] and second.extend_lens[0] == 16
    log = [first, second] + drain(s)
    for sched in log:
        if sched.kind == StepKind.EXTEND:
            assert sum(sched.extend_lens) <= 40 and max(sched.extend_lens) <= 16
            partial = [r for r, n in zip(sched.reqs, sched.extend_lens) if r.prefill_len > 0 and r.in_prefill]
            assert len(partial) <= 1
    assert all(len(r.output_ids) == 8 for r in reqs)


def test_prefill_first_then_decode_all_running():
    s = make()
    for i in range(3):
        s.add(req(i, 5))
    a = run_step(s)
    assert a.kind == StepKind.EXTEND and len(a.reqs) == 3
    b = run_step(s)
    assert b.kind == StepKind.DECODE and len(b.reqs) == 3
    s.add(req(3, 5))
    c = run_step(s)
    assert c.kind == StepKind.EXTEND and [r.request_id for r in c.reqs] == ["r3"]
    drain(s)


def test_max_running_requests():
    s = make(max_reqs=2)
    for i in range(5):
        s.add(req(i, 4, max_tokens=3))
    seen = 0
    while s.waiting or s.running:
        run_step(s)
        assert len(s.running) <= 2
        seen += 1
    assert seen > 3
    s.allocator.check_all_free()


@pytest.mark.smoke
def test_preemption_of_most_recent_and_recompute():
    # 15 usable pages of 4 = 60 tokens; 3 requests of 12 + 12 outputs = 72 tokens do not fit at once.
    s = make(num_pages=16, page_size=4)
    reqs = [req(i, 12, max_tokens=12) for i in range(3)]
    for r in reqs:
        s.add(r)
    log = drain(s)
    preempted = [r for sched in log for r in sched.preempted]
    assert preempted and s.num_preemptions == len(preempted)
    # The victim is always the most recently admitted: the first request is never preempted.
    assert reqs[0].num_preemptions == 0
    assert reqs[2].num_preemptions >= 1
    # A re-admitted request prefills prompt + the tokens it had generated.
    recompute = [n for sched in log if sched.kind == StepKind.EXTEND
                 for r, n in zip(sched.reqs, sched.extend_lens) if r is reqs[2]]
    assert max(recompute) > 12
    assert all(len(r.output_ids) == 12 for r in reqs)


def test_admission_keeps_headroom_for_decoders():
    # Admitting must not force the running decoders into an immediate preemption.
    s = make(num_pages=9, page_size=1, decode_reserve=1)  # 8 slots
    a = req(0, 6, max_tokens=2)
    s.add(a)
    run_step(s)  # a holds 7 slots (6 + 1 reserve)
    s.add(req(1, 1, max_tokens=1))
    sched = run_step(s)  # b needs 2 slots but only 1 is free beyond a's next step: decode runs instead
    assert sched.kind == StepKind.DECODE and sched.preempted == []
    drain(s)


@pytest.mark.smoke
def test_abort_frees_everything_at_any_stage():
    s = make(chunked_prefill_size=8)
    running, partial, waiting = req(0, 4), req(1, 20), req(2, 4)
    s.add(running)
    run_step(s)
    s.add(partial)
    run_step(s)  # partial chunk of 8
    assert partial.in_prefill and partial.pages
    s.add(waiting)
    s.abort(partial)
    s.abort(waiting)
    assert partial.status == waiting.status == RequestStatus.FINISHED
    assert not partial.pages and partial.row == -1
    s.check_consistent()
    drain(s)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_reserve_for_multi_token_steps(page_size):
    s = make(num_pages=128 // page_size + 1, page_size=page_size, decode_reserve=4)
    for i in range(4):
        s.add(req(i, 9, max_tokens=10))
    drain(s)


def test_mixed_steps_run_every_decoder_beside_prefill_chunks_under_the_budget():
    s = make(chunked_prefill_size=16, max_prefill_tokens=24, mixed=True)
    a = req(0, 10, max_tokens=20)
    s.add(a)
    sched = run_step(s)
    assert sched.kind == StepKind.EXTEND and sched.num_decode == 0  # nothing decodes yet: a plain prefill
    b = req(1, 50)
    s.add(b)
    chunks = []
    while b.seq_len < 50:
        sched = run_step(s)
        assert is_mixed(sched) and sched.num_decode == 1 and sched.reqs[0] is a  # decode rows first
        assert sum(sched.extend_lens) <= 24  # one token budget for decode rows and chunks
        chunks.append(sched.extend_lens[1])
    assert chunks == [16, 16, 16, 2]
    assert run_step(s).kind == StepKind.DECODE  # both decode: a pure decode step (CUDA graphs)
    drain(s)


def test_mixed_prefill_budget_caps_chunks_beside_decoders_not_prefill_alone():
    s = make(chunked_prefill_size=16, max_prefill_tokens=40, mixed=True, max_mixed_prefill_tokens=5)
    a = req(0, 10, max_tokens=4)
    s.add(a)
    first = run_step(s)
    assert first.kind == StepKind.EXTEND and first.extend_lens == [10]  # no decoders: the whole budget
    b = req(1, 50, max_tokens=2)
    s.add(b)
    chunks = []
    while not b.output_ids:  # its prefill
        sched = run_step(s)
        if is_mixed(sched):
            assert sched.num_decode == 1 and sum(sched.extend_lens[1:]) <= 5
        else:  # a finished: b alone has max_prefill_tokens again, chunked by chunked_prefill_size
            assert sched.kind == StepKind.EXTEND and sched.num_decode == 0 and a.status == RequestStatus.FINISHED
        chunks.append((is_mixed(sched), sched.extend_lens[sched.num_decode:]))
    assert chunks == [(True, [5])] * 3 + [(False, [16]), (False, [16]), (False, [3])]
    drain(s)


@pytest.mark.parametrize("page_size,budget", [(1, 1), (4, 1), (4, 3), (4, 6)])
def test_a_mixed_budget_below_a_page_or_chunk_still_prefills_long_prompts(page_size, budget):
    """Decoders keep running while long prompts creep in `budget` tokens per step: no stall, no livelock, the
    KV bookkeeping stays exact (drain checks it every step) and every request completes."""
    s = make(num_pages=256 // page_size + 1, page_size=page_size, chunked_prefill_size=8, max_prefill_tokens=32,
             mixed=True, max_mixed_prefill_tokens=budget)
    decoders = [req(i, 5, max_tokens=60) for i in range(2)]
    for r in decoders:
        s.add(r)
    run_step(s)
    long = [req(2, 23, max_tokens=3), req(3, 9, max_tokens=3)]
    for r in long:
        s.add(r)
    log = []
    while any(r.status != RequestStatus.FINISHED for r in long):
        log.append(run_step(s))
        assert len(log) < 60, "the long prompts made no progress beside the decoders"
    assert all(r.status == RequestStatus.RUNNING for r in decoders)  # prefilled beside them, not after
    mixed = [sched for sched in log if is_mixed(sched)]
    assert mixed and all(0 < sum(sched.extend_lens[sched.num_decode:]) <= budget for sched in mixed)
    drain(s)
    assert all(len(r.output_ids) == r.params.max_tokens for r in decoders + long)
