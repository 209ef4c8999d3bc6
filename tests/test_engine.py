"""Engine and LLM on the embedded tiny preset (fp32, CPU).

Prompts are longer than the preset's index_topk, so attention is really sparse.
"""

from __future__ import annotations

import math
import random

import pytest

from minidsa import LLM, SamplingParams
from minidsa.config import ConfigError
from engine_tracking import track_engines
from minidsa.engine import Engine
from minidsa.common.request import InvalidRequest, QueueFull, Request

MAX_TOKENS = 12


def cpu_engine(**kw) -> Engine:
    return Engine(device="cpu", dtype="float32", progress=False, **kw)


def run_all(engine: Engine, prompts, params) -> list:
    """add every prompt, step to completion; final outputs in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


@pytest.fixture(scope="module")
def alone(tiny_llm, long_prompts) -> list[list[int]]:
    """Greedy outputs of each long prompt run by itself."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outs = [tiny_llm.generate([p], params)[0].token_ids for p in long_prompts]
    assert all(len(set(o)) > 2 for o in outs), "random model repeats one token: the tests would prove little"
    return outs


# -- 1. batching invariance ------------------------------------------------------------------------------
@pytest.mark.smoke
def test_batching_invariance(tiny_llm, long_prompts, alone):
    together = tiny_llm.generate(long_prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in together] == alone
    assert all(o.finish_reason == "length" for o in together)


def test_batching_invariance_with_chunked_prefill_pages_and_staggered_arrivals(long_prompts, alone):
    engine = cpu_engine(page_size=4, chunked_prefill_size=24, max_prefill_tokens=48, max_queued_requests=4)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    ids = [engine.add_request(p, params) for p in long_prompts[:2]]
    final = {}
    for _ in range(4):  # the first two are mid-prefill / decoding when the others arrive
        for out in engine.step():
            final[out.request_id] = out
    ids += [engine.add_request(p, params) for p in long_prompts[2:]]
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out
    assert [final[i].token_ids for i in ids] == alone
    # Queue limit: a 5th waiting request is refused, nothing else changes.
    waiting = [engine.add_request(p, params) for p in long_prompts]
    with pytest.raises(QueueFull, match="max_queued_requests"):
        engine.add_request(long_prompts[0], params)
    assert engine.num_waiting() == 4
    for rid in waiting:
        assert engine.abort(rid)


# -- 2. KV pressure ---------------------------------------------------------------------------------------
def test_kv_pressure_preempts_and_outputs_match(tiny_llm):
    topk = tiny_llm.engine.model_config.index_topk
    rng = random.Random(7)
    prompts = [[rng.randint(1000, 100000) for _ in range(n)] for n in (topk + 9, topk + 18, topk + 13, 2 * topk)]
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=30),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5), SamplingParams(max_tokens=30)]
    ample = [tiny_llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    # All four need ~330 KV slots; 160 holds about two.
    engine = cpu_engine(max_total_tokens=160)
    tight = run_all(engine, prompts, params)
    assert engine.metrics().preemptions_total > 0
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]  # greedy and seeded alike
    assert [o.text for o in tight] == [o.text for o in ample]
    assert engine.metrics().kv_used_tokens == 0


# -- 3. leak check ----------------------------------------------------------------------------------------
def test_leak_check_detects_leaks(tiny_llm):
    engine = tiny_llm.engine
    engine.check_no_leaks()
    pages = engine.page_allocator.alloc(2)
    with pytest.raises(AssertionError, match="leak"):
        engine.check_no_leaks()
    engine.page_allocator.free(pages)
    row = engine.row_allocator.alloc()
    with pytest.raises(AssertionError, match="leak"):
        engine.check_no_leaks()
    engine.row_allocator.free(row)
    engine.check_no_leaks()


def test_tracking_keeps_the_bookkeeping_not_the_engine():
    """An engine a test drops is freed at once (a GPU test builds a second full-size engine after the first), and
    the end-of-test check still sees what it leaked."""
    import gc
    import weakref

    with track_engines() as tracked:
        engine = Engine(device="cpu", progress=False, max_total_tokens=64)
        pages = engine.page_allocator.alloc(1)
        alive = weakref.ref(engine)
        del engine
        gc.collect()
    assert alive() is None
    with pytest.raises(AssertionError, match="leak"):
        tracked[0].check_no_leaks()
    tracked[0].page_allocator.free(pages)
    tracked[0].check_no_leaks()


def test_autouse_leak_check_fails_the_leaking_test(pytester):
    """The suite's autouse fixture turns a leak into an error of the test that leaked, and only that one."""
    with open(__file__.replace("test_engine.py", "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(test_inner="""
        from minidsa.engine import Engine

        def make():
            return Engine(device="cpu", progress=False, max_total_tokens=64)

        def test_leaks_a_page():
            make().page_allocator.alloc(1)  # a page no request owns; the engine is dropped right away

        def test_clean():
            engine = make()
            engine.add_request([5] * 40, None)
            while engine.has_unfinished():
                engine.step()
    """)
    with track_engines() as inner:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_a_page*", "*KV slot leak*"])
    for engine in inner:  # this test's own leak check sees the inner engines too: give the page back
        alloc = engine.page_allocator
        alloc.free([p for p in range(1, alloc.num_pages) if alloc._used[p]])


# -- 4. seeded sampling -----------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_in_any_batch(tiny_llm, long_prompts):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=123)
    a = tiny_llm.generate([long_prompts[0]], p)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0), p, SamplingParams(max_tokens=5)]
    b = tiny_llm.generate([long_prompts[1], long_prompts[0], long_prompts[2]], others)[1].token_ids
    assert a == b
    c = tiny_llm.generate([long_prompts[0]], SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=124))
    assert c[0].token_ids != a
    greedy = tiny_llm.generate([long_prompts[0]], SamplingParams(max_tokens=16))[0].token_ids
    assert a != greedy


def test_top_k_one_is_greedy(tiny_llm, long_prompts, alone):
    out = tiny_llm.generate([long_prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_k=1,
                                                               seed=3))
    assert out[0].token_ids == alone[0]


# -- 5. invalid requests ----------------------------------------------------------------------------------
@pytest.mark.smoke
def test_invalid_requests_leave_running_requests_alone(tiny_llm, long_prompts, alone):
    engine = tiny_llm.engine
    good = SamplingParams(max_tokens=MAX_TOKENS)
    ids = [engine.add_request(p, good) for p in long_prompts[:2]]
    outs = {}
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id] = o

    def state():
        m = engine.metrics()
        return (engine.num_running(), engine.num_waiting(), m.kv_used_tokens, m.prompt_tokens_total,
                m.generation_tokens_total, sorted(engine.requests))

    before = state()
    n = engine.max_model_len
    vocab = engine.vocab_size
    cases = [
        (long_prompts[2], SamplingParams(temperature=math.nan), "temperature"),
        (long_prompts[2], SamplingParams(top_p=0.0), "top_p"),
        (long_prompts[2], SamplingParams(max_tokens=-1), "max_tokens"),
        (long_prompts[2], SamplingParams(min_p=2.0), "min_p"),
        (long_prompts[2], SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
        ([5] * n, good, "too long"),
        ([5] * (n - 4), SamplingParams(max_tokens=10), "max_model_len"),
        ([], good, "empty"),
        ("", good, "empty"),
        ([1, 2, vocab], good, "vocabulary"),
        (3.5, good, "prompt must be"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            engine.add_request(prompt, params)
        assert state() == before
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request(long_prompts[2], good, request_id=ids[0])
    assert state() == before
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert [outs[i].token_ids for i in ids] == alone[:2]


def test_bad_engine_arguments():
    with pytest.raises(ConfigError, match="max_totl_tokens"):
        LLM(max_totl_tokens=5)
    with pytest.raises(ConfigError, match="model"):
        Engine(model="no-such-preset-or-dir", progress=False)
    with pytest.raises(ConfigError, match="page_size"):
        Engine(page_size=3, progress=False)


# -- stops, aborts, streaming ------------------------------------------------------------------------------
def test_stop_token_ids_and_eos(tiny_llm, long_prompts, alone, monkeypatch):
    ref = alone[1]
    stop = ref[5]
    cut = ref.index(stop) + 1
    out = tiny_llm.generate([long_prompts[1]], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop"
    monkeypatch.setattr(tiny_llm.engine.outputs, "eos_token_ids", frozenset({stop}))
    out = tiny_llm.generate([long_prompts[1]], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop"
    out = tiny_llm.generate([long_prompts[1]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_stop_string_cuts_text_and_streams_consistently(tiny_llm, long_prompts):
    params = SamplingParams(max_tokens=24)
    full = tiny_llm.generate([long_prompts[2]], params)[0]
    text = full.text
    assert len(text) > 12
    stop = text[len(text) // 2: len(text) // 2 + 3]
    idx = text.find(stop)
    stopped = SamplingParams(max_tokens=24, stop=[stop, "\x00never"])
    out = tiny_llm.generate([long_prompts[2]], stopped)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:idx]
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    assert stop in tiny_llm.tokenizer.decode(out.token_ids)  # the token completing the stop string is kept
    chunks = list(tiny_llm.stream(long_prompts[2], stopped))
    assert "".join(c.new_text for c in chunks) == out.text
    assert [t for c in chunks for t in c.new_token_ids] == out.token_ids
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    # Streamed text never shows the start of the stop string before the request finishes.
    assert all(stop not in c.text for c in chunks)


def test_append_tokens_checks_every_token(tiny_llm):
    """The one entry for new tokens: several per step (speculation), truncated after a stop."""
    engine = tiny_llm.engine
    r = Request(request_id="x", prompt_ids=[5, 6], params=SamplingParams(max_tokens=10, stop_token_ids=[99]))
    kept, _ = engine.outputs.append_tokens(r, [10, 11, 99, 12, 13])
    assert kept == [10, 11, 99] and r.output_ids == kept and r.finish_reason == "stop"
    r = Request(request_id="y", prompt_ids=[5], params=SamplingParams(max_tokens=4))
    engine.outputs.append_tokens(r, [1000, 1001, 1002])
    assert r.finish_reason is None
    kept, _ = engine.outputs.append_tokens(r, [1003, 1004, 1005])
    assert kept == [1003] and r.finish_reason == "length"
    ids = tiny_llm.tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    r = Request(request_id="z", prompt_ids=[5], params=SamplingParams(max_tokens=50, stop=["gam"]).validate())
    kept, new_text = engine.outputs.append_tokens(r, ids + ids)
    assert r.finish_reason == "stop" and r.text == "alpha beta " and new_text == "alpha beta "
    assert "gam" in tiny_llm.tokenizer.decode(kept) and len(kept) <= len(ids)


def test_abort_any_time(tiny_llm, long_prompts, alone):
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS)
    a = engine.add_request(long_prompts[0], params)
    b = engine.add_request(long_prompts[1], params)
    engine.step()
    engine.step()
    c = engine.add_request(long_prompts[2], params)  # still waiting
    assert engine.abort(b) and engine.abort(c)
    assert not engine.abort(b) and not engine.abort("no-such-request")
    engine.check_no_leaks()
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    assert final[a].token_ids == alone[0]
    assert final[b].finish_reason == final[c].finish_reason == "abort"


def test_stream_and_early_close(tiny_llm, long_prompts, alone):
    chunks = list(tiny_llm.stream(long_prompts[3], SamplingParams(max_tokens=MAX_TOKENS)))
    assert [t for c in chunks for t in c.new_token_ids] == alone[3] == chunks[-1].token_ids
    assert chunks[0].ttft_s is not None and chunks[0].ttft_s > 0
    gen = tiny_llm.stream(long_prompts[3], SamplingParams(max_tokens=MAX_TOKENS))
    next(gen)
    gen.close()  # aborts the request
    assert not tiny_llm.engine.has_unfinished()


def test_text_prompts_chat_logprobs_and_metrics(tiny_llm):
    engine = tiny_llm.engine
    before = engine.metrics()
    outs = tiny_llm.generate(["Hello, my name is", "The capital of France is"],
                             SamplingParams(max_tokens=6, logprobs=True))
    assert all(isinstance(o.text, str) and len(o.token_ids) == 6 for o in outs)
    assert all(len(o.logprobs) == 6 and all(lp <= 0 for lp in o.logprobs) for o in outs)
    assert outs[0].prompt == "Hello, my name is"
    chat = tiny_llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3))
    assert chat.prompt_token_ids[0] == tiny_llm.tokenizer.bos_token_id and len(chat.token_ids) == 3
    m = engine.metrics()
    assert m.generation_tokens_total - before.generation_tokens_total == 15
    assert m.requests_finished_total - before.requests_finished_total == 3
    assert m.kv_used_tokens == 0 and m.num_running == 0 and 0 <= m.kv_usage <= 1
    assert engine.model_name == "minidsa-tiny" and engine.max_model_len > 1000


# -- the speculator seam ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [dict(speculative_num_steps=2),
                                  dict(speculative_num_steps=2, speculative_topk=2, speculative_num_draft_tokens=4)])
def test_speculative_decoding_through_the_engine_is_lossless_under_preemption(long_prompts, alone, spec):
    engine = cpu_engine(max_total_tokens=260, chunked_prefill_size=40, **spec)
    assert engine.speculator is not None and engine.decode_reserve >= engine.speculator.reserved_tokens
    outs = run_all(engine, long_prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == alone
    m = engine.metrics()
    assert m.spec_verify_steps_total > 0 and m.preemptions_total > 0
