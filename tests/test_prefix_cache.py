"""Prefix caching: the page tree, the allocator's reference counts, the scheduler's sharing, the engine.

- The tree and the allocator on their own: matching whole pages, the lookahead token of MTP keys, LRU
  eviction leaf first, and reference-count errors.
- The scheduler driven by a fake engine that "computes" every KV slot as a hash of the tokens it
  depends on and checks, at every step, that each running request reads exactly the KV of its own
  tokens: a page freed while still referenced, reused and overwritten, or a wrong cache hit, fails it.
  Random shared prefixes, duplicates, aborts and preemption under tight memory.
- The engine on the tiny preset: greedy outputs with the cache equal outputs without it, token for
  token (page sizes 1, 4, 64, MTP speculation), under eviction and preemption; the bench workload.
  The autouse leak check (conftest.py) checks every engine's reference counts after each test.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from minidsa.common.plan import StepKind
from minidsa.engine import Engine
from minidsa.common.kv_cache import ReqToTokenTable
from minidsa.sched.pages import OutOfPages, PageAllocator, RowAllocator
from minidsa.sched.prefix_cache import PrefixCache
from minidsa.common.request import Request, RequestStatus, SamplingParams
from minidsa.sched.scheduler import Scheduler

MAX_TOKENS = 10


# -- the tree and the allocator ---------------------------------------------------------------------------
@pytest.mark.smoke
def test_match_insert_share_and_lru_leaf_eviction():
    alloc = PageAllocator(9, 2)  # 8 usable pages of 2 tokens
    cache = PrefixCache(alloc)
    a_tok = [1, 2, 3, 4, 5, 6, 7, 8]
    a = alloc.alloc(4)
    _, tree = cache.insert(None, a_tok, a)
    assert tree == a and cache.num_pages == 4 and alloc.num_evictable_pages == 0
    assert [n.page for n in cache.match(a_tok + [9], 8)] == a
    assert len(cache.match(a_tok, 7)) == 3  # whole pages within the limit only
    assert len(cache.match([1, 2, 3, 5, 5, 6], 6)) == 1
    alloc.free(a)  # A is done: its pages stay, evictable
    assert alloc.num_free_pages == 4 and alloc.num_evictable_pages == 4 and alloc.num_available_pages == 8
    alloc.check_all_free()  # held by the cache only: not a leak

    b_tok = [1, 2, 3, 4, 50, 51]  # shares A's first two pages
    hit = cache.match(b_tok, len(b_tok) - 1)
    assert cache.num_evictable(hit) == 2
    b = cache.lock(hit) + alloc.alloc(1)
    node, tree = cache.insert(hit[-1], b_tok[4:], b[2:])
    assert tree == b[2:] and alloc.num_evictable_pages == 2
    alloc.check_refs({p: 1 for p in b})
    cache.check()

    c = alloc.alloc(5)  # 3 free + 2 evicted: A's unshared tail, the leaf first, never B's held pages
    assert {a[2], a[3]} <= set(c) and cache.num_evicted_pages == 2
    assert len(cache.match(a_tok + [9], 8)) == 2
    with pytest.raises(OutOfPages):
        alloc.alloc(1)
    alloc.free(c)
    alloc.free(b)
    assert alloc.num_evictable_pages == 3
    cache.check()
    alloc.check_all_free()
    assert cache.evict_all() == 3 and alloc.num_free_pages == 8 and cache.num_pages == 0


def test_eviction_is_least_recently_used_first():
    alloc = PageAllocator(5, 1)  # 4 usable pages of 1 token
    cache = PrefixCache(alloc)
    x, y = alloc.alloc(2), alloc.alloc(2)
    cache.insert(None, [1, 2], x)
    cache.insert(None, [7, 8], y)
    alloc.free(x)
    alloc.free(y)
    alloc.free(cache.lock(cache.match([1, 2, 3], 2)))  # x used again: y is now the older one
    got = alloc.alloc(2)
    assert sorted(got) == sorted(y) and len(cache.match([1, 2, 3], 2)) == 2 and not cache.match([7, 8, 9], 2)
    alloc.free(got)
    cache.check()
    alloc.check_all_free()


def test_lookahead_key_holds_the_token_after_the_page():
    """With MTP a page's last MTP slot depends on the next token: the key includes it."""
    alloc = PageAllocator(9, 2)
    cache = PrefixCache(alloc, lookahead=1)
    pages = alloc.alloc(2)
    cache.insert(None, [1, 2, 3, 4, 5], pages)  # keys (1, 2, 3), (3, 4, 5)
    assert len(cache.match([1, 2, 3, 4, 9, 9], 5)) == 1
    assert len(cache.match([1, 2, 3, 4, 5, 6], 5)) == 2
    assert len(cache.match([1, 2, 3, 4], 3)) == 1  # the second page's next token is unknown
    alloc.free(pages)
    cache.check()


def test_reference_count_errors_are_loud():
    alloc = PageAllocator(6, 1)
    cache = PrefixCache(alloc)
    p = alloc.alloc(2)
    cache.insert(None, [1, 2], p)
    with pytest.raises(RuntimeError, match="evicted while 1 requests hold it"):
        alloc.cache_evict(p[0])
    with pytest.raises(RuntimeError, match="already in the prefix cache"):
        alloc.cache_add(p[0])
    with pytest.raises(RuntimeError, match="is free"):
        alloc.share([5])
    free = alloc.alloc(1)
    alloc.free(free)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(free)
    with pytest.raises(RuntimeError, match="held by no request"):
        alloc.cache_add(free[0])
    with pytest.raises(AssertionError, match="leak"):
        alloc.check_refs({})  # p is held but no holder is declared
    alloc.free(p)
    alloc.check_all_free()


# -- the scheduler, driven by a fake engine that checks every KV read -------------------------------------
class FakeEngine:
    """Plays the engine for a Scheduler. Each KV slot of the main layers holds a hash of the tokens up to its
    position, each slot of the 'MTP' cache a hash up to the next position (the MTP pairing); every step
    checks that each running request reads exactly the KV of its own tokens at positions [0, seq_len)."""

    def __init__(self, sched: Scheduler, rng: random.Random, vocab: int):
        self.s, self.rng, self.vocab = sched, rng, vocab
        self.table = ReqToTokenTable(sched.rows.max_reqs, 256, "cpu")  # the worker's req_to_token
        self.kv: dict[int, int] = {}
        self.mtp: dict[int, int] = {}
        self.steps = 0

    @staticmethod
    def hashes(tokens: list[int]) -> list[int]:
        out, h = [], 0
        for t in tokens:
            h = hash((h, t))
            out.append(h)
        return out

    def slot(self, req: Request, pos: int) -> int:
        return int(self.table.req_to_token[req.row, pos])

    def check_reads(self) -> None:
        ps = self.s.page_size
        for r in self.s.running:
            n = len(r.pages) * ps
            want = torch.tensor([r.pages[p // ps] * ps + p % ps for p in range(n)], dtype=torch.int32)
            assert torch.equal(self.table.req_to_token[r.row, :n], want), "row does not map the pages"
            h = self.hashes(r.token_slice(0, r.num_tokens))
            for pos in range(r.seq_len):
                assert self.kv.get(self.slot(r, pos)) == h[pos], f"{r.request_id} reads wrong KV at {pos}"
                if self.s.prefix_cache.lookahead:  # keys without lookahead are for engines without MTP
                    assert self.mtp.get(self.slot(r, pos)) == h[pos + 1], f"{r.request_id}: wrong MTP KV at {pos}"

    def write(self, req: Request, start: int, tokens: list[int]) -> None:
        """KV of row positions [start, len(tokens) - 1) for a request whose tokens (so far) are `tokens`."""
        h = self.hashes(tokens)
        for pos in range(start, len(tokens) - 1):
            self.kv[self.slot(req, pos)] = h[pos]
            self.mtp[self.slot(req, pos)] = h[pos + 1]

    def next_token(self, tokens: list[int]) -> int:  # deterministic, like greedy decoding
        return 1 + self.hashes(tokens)[-1] % self.vocab

    def step(self) -> bool:
        s = self.s
        sched = s.schedule()
        if sched is None:
            return False
        self.steps += 1
        for w in s.take_table_writes():  # the worker's part: the page table
            self.table.write_pages(w.row, w.first_page, w.pages, s.page_size)
        s.check_consistent()
        self.check_reads()
        for r, n in zip(sched.reqs, sched.extend_lens):
            if sched.kind == StepKind.EXTEND:
                start = r.seq_len
                r.seq_len += n
                toks = r.token_slice(0, r.num_tokens)
                if r.in_prefill:
                    self.write(r, start, toks[:r.seq_len + 1])
                    continue
                new = [self.next_token(toks)]
            else:  # a speculative step: scratch over all reserved positions, then 1..reserve accepted
                for pos in range(r.seq_len, r.seq_len + s.decode_reserve):
                    self.kv[self.slot(r, pos)] = self.mtp[self.slot(r, pos)] = self.rng.random()
                start = r.seq_len
                toks = r.token_slice(0, r.num_tokens)
                new = []
                for _ in range(self.rng.randint(1, s.decode_reserve)):
                    new.append(self.next_token(toks + new))
                r.seq_len += len(new)
            self.write(r, start, toks + new)  # the accepted ones, before a stop cuts them (as in the engine)
            room = r.params.max_tokens - len(r.output_ids)
            r.output_ids.extend(new[:room])
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r)
        return True


@pytest.mark.parametrize("page_size,reserve,lookahead", [(1, 1, 0), (4, 1, 0), (4, 3, 1), (2, 3, 1)])
def test_scheduler_shares_pages_and_every_read_is_right(page_size, reserve, lookahead):
    rng = random.Random(page_size * 10 + reserve)
    vocab = 5  # small: generated tails and questions collide, so decode pages are shared too
    alloc = PageAllocator(160 // page_size + 1, page_size)
    cache = PrefixCache(alloc, lookahead)
    s = Scheduler(alloc, RowAllocator(6), max_running_requests=6, max_prefill_tokens=48,
                  chunked_prefill_size=24, decode_reserve=reserve, prefix_cache=cache)
    fake = FakeEngine(s, rng, vocab)
    systems = [[rng.randint(1, vocab) for _ in range(n)] for n in (40, 13, 70)]
    prompts: list[list[int]] = []
    reqs: list[Request] = []
    aborted = set()
    for i in range(40):
        finished = [r for r in reqs if r.status == RequestStatus.FINISHED and r.request_id not in aborted]
        if prompts and rng.random() < 0.2:
            prompt = list(rng.choice(prompts))  # an exact repeat: cached up to its last token
        elif finished and rng.random() < 0.25:  # the next turn: an earlier prompt + its output + more
            turn = rng.choice(finished)
            prompt = turn.prompt_ids + turn.output_ids + [rng.randint(1, vocab) for _ in range(rng.randint(1, 6))]
        else:
            sys_prompt = rng.choice(systems)
            prompt = sys_prompt[:rng.randint(len(sys_prompt) // 2, len(sys_prompt))] + \
                [rng.randint(1, vocab) for _ in range(rng.randint(1, 12))]
        prompts.append(prompt)
        r = Request(request_id=f"r{i}", prompt_ids=prompt, params=SamplingParams(max_tokens=rng.randint(1, 14)))
        reqs.append(r)
        s.add(r)
        for _ in range(rng.randint(0, 3)):
            fake.step()
        alive = [r for r in reqs if r.status != RequestStatus.FINISHED]
        if alive and rng.random() < 0.1:  # abort someone: waiting, mid-prefill or decoding
            victim = rng.choice(alive)
            s.abort(victim)
            aborted.add(victim.request_id)
            s.check_consistent()
    while s.waiting or s.running:
        assert fake.step(), "scheduler stalled"
        assert fake.steps < 5000
    s.check_consistent()
    alloc.check_all_free()
    s.rows.check_all_free()
    done = [r for r in reqs if r.request_id not in aborted]
    assert all(r.status == RequestStatus.FINISHED and len(r.output_ids) == r.params.max_tokens for r in done)
    assert s.cache_hit_tokens > s.cache_query_tokens // 4
    assert s.num_preemptions > 0 and cache.num_evicted_pages > 0


@pytest.mark.parametrize("page_size,reserve,lookahead", [(1, 1, 0), (2, 3, 1)])
def test_next_turn_reuses_generated_tokens_but_never_the_uncached_last_one(page_size, reserve, lookahead):
    alloc = PageAllocator(65, page_size)
    s = Scheduler(alloc, RowAllocator(2), max_running_requests=2, max_prefill_tokens=64,
                  chunked_prefill_size=64, decode_reserve=reserve, prefix_cache=PrefixCache(alloc, lookahead))
    fake = FakeEngine(s, random.Random(1), 50)
    for turn in range(3):
        a = Request(request_id=f"a{turn}", prompt_ids=[turn + 1] + list(range(2, 12)),
                    params=SamplingParams(max_tokens=9))
        s.add(a)
        while s.running or s.waiting:
            fake.step()
        b = Request(request_id=f"b{turn}", prompt_ids=a.prompt_ids + a.output_ids + [3],
                    params=SamplingParams(max_tokens=2))
        s.add(b)
        before = s.cache_hit_tokens
        fake.step()  # b's reads are checked at the next step
        hit, last = s.cache_hit_tokens - before, a.num_tokens - 1
        # all of a's whole pages up to its last token, which was never cached (nor speculative scratch past it)
        assert last - lookahead - page_size < hit <= last
        while s.running or s.waiting:
            fake.step()
    alloc.check_all_free()


def test_requests_arriving_together_share_the_prefix_computed_first():
    """A batch does not compute a long common prefix twice: the later request waits a step, then hits it."""
    alloc = PageAllocator(65, 4)
    s = Scheduler(alloc, RowAllocator(4), max_running_requests=4, max_prefill_tokens=200,
                  chunked_prefill_size=100, prefix_cache=PrefixCache(alloc))
    system = list(range(100, 160))
    a = Request(request_id="a", prompt_ids=system + [1, 2], params=SamplingParams(max_tokens=2))
    b = Request(request_id="b", prompt_ids=system + [3], params=SamplingParams(max_tokens=2))
    c = Request(request_id="c", prompt_ids=[7] * 20, params=SamplingParams(max_tokens=2))  # unrelated
    for r in (a, b, c):
        s.add(r)
    fake = FakeEngine(s, random.Random(0), 50)
    first = s.schedule()
    assert first.reqs == [a, c] and list(s.waiting) == [b]
    for r, n in zip(first.reqs, first.extend_lens):  # play the step's writes
        r.seq_len += n
        fake.write(r, 0, r.token_slice(0, r.num_tokens) + [fake.next_token(r.token_slice(0, r.num_tokens))])
        r.output_ids.append(fake.next_token(r.token_slice(0, r.num_tokens)))
    second = s.schedule()
    assert second.reqs == [b] and b.seq_len == 60 and second.extend_lens == [1] and s.cache_hit_tokens == 60
    for r in (a, b, c):
        s.abort(r)
    s.check_consistent()
    alloc.check_all_free()


# -- the engine on the tiny preset ------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)


def cpu_engine(**kw) -> Engine:
    return Engine(device="cpu", dtype="float32", progress=False, **kw)


def run(engine: Engine, prompts: list[list[int]], params=GREEDY, check_every_step: bool = False) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        if check_every_step:
            engine.check_no_leaks()
    return [final[i] for i in ids]


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1000, 100000) for _ in range(n)]


@pytest.fixture(scope="module")
def scenario():
    """Prompts sharing prefixes of many lengths, all longer than index_topk (32) but one, and the greedy
    outputs of each without any cache (one request at a time, page size 1)."""
    rng = random.Random(99)
    system = toks(rng, 100)
    p1 = system + toks(rng, 12)
    ref_engine = cpu_engine(enable_prefix_caching=False)
    out1 = run(ref_engine, [p1])[0]
    sequential = [
        system + toks(rng, 7),  # fills the cache
        p1,  # hits the 100 shared tokens (down to a page boundary)
        system[:45] + toks(rng, 30),  # shares 45, not page-aligned
        list(p1),  # entirely cached: only its last token is computed
        p1 + out1 + toks(rng, 5),  # multi-turn: hits pages that hold generated tokens
        system[:10] + toks(rng, 3),  # short (< index_topk)
    ]
    together = [system + toks(rng, 20) for _ in range(3)] + [sequential[2] + toks(rng, 4), list(p1)]
    ref = [run(ref_engine, [p])[0] for p in sequential + together]
    assert ref[1] == out1
    assert all(len(set(o)) > 2 for o in ref), "random model repeats one token: the test would prove little"
    return sequential, together, ref, len(system)


@pytest.mark.parametrize("engine_args", [dict(page_size=1), dict(page_size=4), dict(page_size=64),
                                         dict(page_size=4, speculative_num_steps=2)],
                         ids=["page1", "page4", "page64", "page4-mtp2"])
def test_greedy_outputs_with_the_cache_equal_outputs_without(scenario, engine_args):
    sequential, together, ref, shared = scenario
    engine = cpu_engine(**engine_args)
    ps, la = engine.config.args.page_size, engine.prefix_cache.lookahead
    outs, hits = [], []
    for p in sequential:  # one at a time: each sees what the previous ones cached
        before = engine.metrics().prefix_cache_hit_tokens_total
        outs += run(engine, [p])
        hits.append(engine.metrics().prefix_cache_hit_tokens_total - before)
    engine.check_no_leaks()
    outs += run(engine, together, check_every_step=True)
    assert outs == ref
    m = engine.metrics()
    assert m.prefix_cache_pages > 0 and m.kv_used_tokens == 0
    assert m.prefix_cache_hit_tokens_total > m.prefix_cache_query_tokens_total // 3
    # what each sequential request found: whole pages, the lookahead token included, never the last token
    assert hits[0] == 0
    assert hits[1] == (shared - la) // ps * ps
    assert hits[2] == (45 - la) // ps * ps
    assert hits[3] == (len(sequential[3]) - 1) // ps * ps
    assert hits[4] >= (len(sequential[1]) + MAX_TOKENS - 1 - la) // ps * ps  # the earlier turn and its output
    if engine.speculator is not None:
        assert m.spec_verify_steps_total > 0
    # nothing is running: every cached page is evictable and goes when asked
    engine.prefix_cache.evict_all()
    assert engine.metrics().prefix_cache_pages == 0
    engine.page_allocator.check_all_free()
    engine.row_allocator.check_all_free()


@pytest.mark.parametrize("engine_args", [dict(page_size=4), dict(page_size=1, speculative_num_steps=2)],
                         ids=["page4", "page1-mtp2"])
def test_memory_pressure_evicts_preempts_and_aborts_without_leaks(engine_args):
    rng = random.Random(5)
    system = toks(rng, 70)
    prompts = [system + toks(rng, rng.randint(5, 20)) for _ in range(6)]
    prompts += [list(prompts[1]), system[:40] + toks(rng, 12)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, detokenize=False) for _ in prompts]
    if "speculative_num_steps" not in engine_args:  # speculation keeps the distribution, not the very samples
        params[3] = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True, detokenize=False)
    reference = cpu_engine(enable_prefix_caching=False)
    want = [run(reference, [p], sp)[0] for p, sp in zip(prompts, params)]

    engine = cpu_engine(max_total_tokens=240, chunked_prefill_size=32, **engine_args)  # holds ~2 requests
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:5], params[:5])]
    doomed = [engine.add_request(system + toks(rng, 30), params[0]), engine.add_request(toks(rng, 50), params[0])]
    final = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_no_leaks()
        step += 1
        if step == 3:
            assert engine.abort(doomed[0])  # holding shared pages, in prefill or decoding
        if step == 6:
            ids += [engine.add_request(p, sp) for p, sp in zip(prompts[5:], params[5:])]
        if step == 9:
            assert engine.abort(doomed[1])
    assert [final[i].token_ids for i in ids] == want
    assert all(final[d].finish_reason == "abort" for d in doomed)
    m = engine.metrics()
    assert m.preemptions_total > 0 and engine.prefix_cache.num_evicted_pages > 0
    assert m.prefix_cache_hit_tokens_total > 0 and m.kv_used_tokens == 0


def test_disabled_prefix_caching_computes_everything():
    engine = cpu_engine(enable_prefix_caching=False, page_size=4)
    p = toks(random.Random(1), 50)
    run(engine, [p, p])
    run(engine, [p])
    m = engine.metrics()
    assert engine.prefix_cache is None and m.prefix_cache_hit_tokens_total == 0 and m.prefix_cache_pages == 0


def test_bench_shared_prefix_ttft_is_lower_with_the_cache(capsys):
    from minidsa.bench.offline import print_summary, run_bench

    results = {}
    for on in (True, False):
        engine = cpu_engine(enable_prefix_caching=on, page_size=4)
        results[on] = run_bench(engine, num_requests=6, input_len=(8, 16), output_len=(2, 4), seed=3,
                                warmup=False, progress=False, workload="shared-prefix", shared_prefix_len=512)
    on, off = results[True]["results"], results[False]["results"]
    assert results[True]["workload"]["shared_prefix_len"] == 512
    assert on["input_tokens"] == off["input_tokens"] and on["output_tokens"] == off["output_tokens"]
    assert on["prefix_cache"]["hit_rate"] > 0.7 and on["prefix_cache"]["hit_tokens"] >= 5 * 512
    assert off["prefix_cache"] == {"enabled": False, "query_tokens": off["prefix_cache"]["query_tokens"],
                                   "hit_tokens": 0, "hit_rate": 0.0, "cached_tokens": 0}
    assert on["ttft_s"]["mean"] < off["ttft_s"]["mean"]
    print_summary(results[True])
    assert "prefix cache" in capsys.readouterr().out


def test_cli_flags_and_metrics_lines():
    from minidsa import cli

    args = cli.build_parser().parse_args(["bench", "--workload", "shared-prefix", "--shared-prefix-len", "300",
                                          "--disable-prefix-caching"])
    assert args.workload == "shared-prefix" and args.shared_prefix_len == 300
    assert cli.engine_config_from_args(args).enable_prefix_caching is False
    app = pytest.importorskip("minidsa.server.app")
    from minidsa.server.async_engine import ServerStats

    engine = cpu_engine(page_size=4)
    p = toks(random.Random(2), 40)
    run(engine, [p, p])
    run(engine, [p])
    m = engine.metrics()
    ae = types.SimpleNamespace(model_name="m", metrics_snapshot=m, stats=ServerStats(),
                               generation_tokens_per_second=lambda: 0.0)
    lines = dict(line.rsplit(" ", 1) for line in app.render_metrics(ae).splitlines() if not line.startswith("#"))
    assert float(lines['minidsa_prefix_cache_hit_tokens_total{model_name="m"}']) == m.prefix_cache_hit_tokens_total > 0
    assert float(lines['minidsa_prefix_cache_query_tokens_total{model_name="m"}']) == 120
    assert 0 < float(lines['minidsa_prefix_cache_hit_ratio{model_name="m"}']) < 1
    assert float(lines['minidsa_prefix_cache_tokens{model_name="m"}']) == m.prefix_cache_tokens > 0
