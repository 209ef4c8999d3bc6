"""GPU: CUDA-graph replay (and torch.compile) give the eager results, for every captured step kind.

Skipped without CUDA (CPU CI); run by scripts/gpu_check.sh on the GPU machine.
"""

from __future__ import annotations

import gc

import pytest
import torch

from harness import count_replays
from minidsa.common.plan import StepKind

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = dict(max_tokens=16, ignore_eos=True, detokenize=False)


def _run(model, prompts, extra=None, **kw):
    """Generate with a fresh engine -> (token ids per prompt, replay counts, RequestOutputs); `extra`: more
    sampling params."""
    from torch._dynamo.utils import counters

    from minidsa import LLM, SamplingParams

    compiled_before = counters["stats"]["unique_graphs"]
    llm = LLM(model=model, progress=False, max_running_requests=8, cuda_graph_max_bs=8, **kw)
    graphs = llm.engine.runner.graphs
    counted = count_replays(graphs) if graphs is not None else {}
    outputs = llm.generate(prompts, SamplingParams(**PARAMS, **(extra or {})))
    outs = [o.token_ids for o in outputs]
    replays = dict(counted)
    # Graphs torch.compile produced for this engine, and how many step kinds it captured (a speculative
    # engine also captures plain decode, its fallback).
    replays["compiled_graphs"] = counters["stats"]["unique_graphs"] - compiled_before
    replays["captured_kinds"] = len(graphs.shapes) if graphs is not None else 0
    llm.engine.check_no_leaks()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs, replays, outputs


def _prompts(n, length, vocab=120000):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (length + 7 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("spec", [
    {},
    {"speculative_num_steps": 3},
    {"speculative_num_steps": 3, "speculative_topk": 2, "speculative_num_draft_tokens": 6, "page_size": 1},
])
def test_tiny_graphs_equal_eager_in_every_mode(spec):
    """fp32 + full-precision indexer: graphs + compile reproduce eager tokens; padded buckets (3 and 5 requests)."""
    exact = dict(dtype="float32", indexer_cache_dtype="model", **spec)
    for n in ((3, 5) if not spec else (5,)):  # padded buckets: 3 -> 4, 5 -> 8
        prompts = _prompts(n, 80)
        eager, _, _ = _run("tiny", prompts, enable_cuda_graph=False, enable_compile=False, **exact)
        fast, replays, _ = _run("tiny", prompts, enable_cuda_graph=True, enable_compile=True, **exact)
        assert fast == eager
        wanted = [StepKind.VERIFY, StepKind.DRAFT_EXTEND, StepKind.DRAFT] if spec else [StepKind.DECODE]
        assert all(replays.get(k, 0) > 0 for k in wanted), replays
        # Regional compilation: graphs per decoder-layer kind (dense, MoE, MTP) x what a step hands a layer
        # (a tree mask or none, a previous top-k or none) x size-1 batches or not: bounded by those (24), not
        # by the batch or context buckets nor the depth (fewer when an earlier engine's graphs are reused).
        assert replays["compiled_graphs"] <= 3 * 2 * 2 * 2, replays


@pytest.mark.parametrize("n", [3, 5])
def test_captured_graphs_equal_their_static_path_run_uncaptured(monkeypatch, n):
    """The step graphs' static, padded buffers captured, and the same buffers run eagerly (`capture=False`, as on a
    CPU): the same kernels on the same rows, so the same tokens, bit for bit, prefill (EXTEND) and decode.

    Against eager, a padded bucket runs its GEMMs on more rows, which cuBLAS may sum in another order
    (benchmarks/archive/TAIL.md section 10: 261 prefill tokens in the 384-token bucket). This comparison leaves only
    what capturing itself changes: the shared memory pool and launches frozen at capture."""
    from minidsa.exec import graphs as graphs_mod

    exact = dict(dtype="float32", indexer_cache_dtype="model")
    prompts = _prompts(n, 80)
    captured, replays, _ = _run("tiny", prompts, enable_cuda_graph=True, enable_compile=False, **exact)
    init = graphs_mod.StepGraphs.__init__

    def uncaptured(self, *args, **kwargs):
        kwargs["capture"] = False
        init(self, *args, **kwargs)

    monkeypatch.setattr(graphs_mod.StepGraphs, "__init__", uncaptured)
    static, static_replays, _ = _run("tiny", prompts, enable_cuda_graph=True, enable_compile=False, **exact)
    assert replays[StepKind.EXTEND] > 0 and replays[StepKind.DECODE] > 0, replays
    assert static_replays == replays
    assert captured == static


def test_spec_lossless_with_graphs_tiny_bf16_fp8():
    """Default GPU settings (bf16, fp8 indexer): speculation with graphs equals plain decoding with graphs."""
    prompts = _prompts(4, 100)
    plain, _, _ = _run("tiny", prompts, enable_cuda_graph=True)
    spec, replays, _ = _run("tiny", prompts, enable_cuda_graph=True, speculative_num_steps=2)
    agree = sum(a == b for a, b in zip(plain, spec))
    assert agree == len(prompts), f"{agree}/{len(prompts)} prompts identical"


def test_bench_preset_graphs_and_compile_equal_eager():
    """Bench shapes (FP8 weights, fp32 activations, full-precision indexer): graphs + compile follow eager.

    The preset's weights are FP8, so activations are quantised to e4m3 before each linear: a difference in
    the last fp32 bit (compile fuses and reorders) can move a value across an e4m3 rounding boundary, and
    random weights put many next tokens within such a margin. So the exact claim is: the paths agree on every
    token until a step where eager's two likeliest tokens were a near-tie, and the logprobs on the shared
    prefix agree closely. (In bf16, greedy paths diverge the same way, see benchmarks/archive/RESULTS.md.)
    """
    prompts = _prompts(4, 300)
    exact = dict(dtype="float32", indexer_cache_dtype="model", max_total_tokens=16384, max_model_len=2048)
    params = dict(logprobs=True, top_logprobs=2)
    _, _, eager_out = _run("bench-dsv32", prompts, params, enable_cuda_graph=False, enable_compile=False, **exact)
    _, replays, fast_out = _run("bench-dsv32", prompts, params, enable_cuda_graph=True, enable_compile=True,
                                **exact)
    assert replays[StepKind.DECODE] > 0
    # Bounds from the H100 (commit 911dbc4): logprobs of shared tokens differed by up to 0.19 nats. A path that
    # reads a stale or wrong buffer differs by whole nats and from the first decoded token.
    for e, f in zip(eager_out, fast_out):
        shared = next((i for i, (a, b) in enumerate(zip(e.token_ids, f.token_ids)) if a != b), len(e.token_ids))
        assert shared >= 2, f"diverged at token {shared}: eager {e.token_ids}, fast {f.token_ids}"
        gaps = torch.tensor(e.logprobs[:shared]) - torch.tensor(f.logprobs[:shared])
        assert gaps.abs().max() < 0.5, gaps
        if shared < len(e.token_ids):
            top2 = list(e.top_logprobs[shared].values())
            assert top2[0] - top2[1] < 1.0, f"diverged at token {shared} without a near-tie: {e.top_logprobs[shared]}"


@pytest.mark.parametrize("settings,exact", [
    (dict(dtype="float32", indexer_cache_dtype="model"), True),
    (dict(dtype="float32", indexer_cache_dtype="model", speculative_num_steps=2), True),
    ({}, False),  # GPU defaults: bf16, fp8 indexer (DeepGEMM when built): no recompiles; tokens may near-tie
], ids=["fp32", "fp32_spec", "defaults"])
def test_tiny_compiled_prefill_and_mixed_steps_equal_eager_without_recompiles(settings, exact):
    """Prefill chunks, mixed steps (decode rows + a chunk), one-token prompts and decode batches past the largest
    graph bucket run the compiled decoder layer (captured in extend graphs up to their buckets), never the plain
    modules: nothing compiles after start-up
    (Dynamo's counters), and in fp32 the tokens are the eager engine's, token for token."""
    from torch._dynamo.utils import counters

    from minidsa import LLM, SamplingParams

    kw = dict(model="tiny", progress=False, max_running_requests=8, cuda_graph_max_bs=4, chunked_prefill_size=64,
              max_prefill_tokens=96, **settings)
    params = SamplingParams(**PARAMS)
    g = torch.Generator().manual_seed(1)
    # Two one-token prompts alone (a logits width of 1), then 8 prompts of 20..300 tokens: chunked, mixed
    # into decode steps (without speculation), up to 8 decoders against graph buckets of at most 4.
    waves = [[[5], [7]], [torch.randint(2, 120000, (20 + 40 * i,), generator=g).tolist() for i in range(8)]]
    want = None
    if exact:
        eager = LLM(enable_cuda_graph=False, enable_compile=False, **kw)
        want = [o.token_ids for wave in waves for o in eager.generate(wave, params)]
        del eager
        gc.collect()
        torch.cuda.empty_cache()
    llm = LLM(**kw)
    runner = llm.engine.runner
    assert runner.compiled
    model_forward, mtp_forward = runner.model.forward, runner.model.forward_mtp

    def compiled_only(batch, attn, run_layer=None, layers=None, overlap=None):
        assert run_layer is not None, "a batch ran the plain modules"
        assert layers is None, "a served batch ran only some layers"
        return model_forward(batch, attn, run_layer, overlap=overlap)

    def compiled_mtp_only(batch, attn, hidden_prev, prev_topk=None, run_layer=None):
        assert run_layer is not None, "an MTP batch ran the plain modules"
        return mtp_forward(batch, attn, hidden_prev, prev_topk, run_layer)

    runner.model.forward, runner.model.forward_mtp = compiled_only, compiled_mtp_only
    replays = count_replays(runner.graphs)
    plans = []
    launch = llm.engine.worker.launch
    llm.engine.worker.launch = lambda plan: plans.append(plan) or launch(plan)
    graphs_before, frames_before = counters["stats"]["unique_graphs"], dict(counters["frames"])
    got = [o.token_ids for wave in waves for o in llm.generate(wave, params)]
    assert counters["stats"]["unique_graphs"] == graphs_before, "compiled after start-up"
    assert dict(counters["frames"]) == frames_before, (frames_before, dict(counters["frames"]))
    if "speculative_num_steps" not in settings:
        assert any(p.kind == StepKind.EXTEND and p.has_decode_rows for p in plans), {p.kind for p in plans}
        assert any(p.kind == StepKind.DECODE and p.batch_size > runner.graphs.buckets[-1] for p in plans)
    # Chunks and mixed steps of up to 64 tokens replay the extend graphs; the larger ones run uncaptured.
    assert replays[StepKind.EXTEND] > 0, replays
    if exact:
        assert got == want
    llm.engine.check_no_leaks()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
