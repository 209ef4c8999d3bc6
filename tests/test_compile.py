"""torch.compile of the decoder layers: no graph breaks, DSA kernels opaque, one graph per layer kind.

On a GPU the runner compiles the captured steps with inductor (tests/gpu/test_graphs_gpu.py checks
compiled graphs against eager, token for token). Here the same `ModelRunner.compile_layer` / `step_functions` run
with a recording backend on top of `aot_eager` (Dynamo + fake tensors + functionalisation, no
code generation), with the Triton kernels under Triton's interpreter, so the custom ops' fake
implementations and the symbolic batch / context sizes are exercised as they are on the GPU.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager

from harness import CPU_WARMUP_TOKENS, PagedDriver, count_replays, static_fast_paths
from minidsa import LLM, SamplingParams
from minidsa.common.batch import ForwardBatch
from minidsa.config import ModelConfig
from minidsa.attention.select import triton_usable
from minidsa.models.loader import build_model
from minidsa.common.presets import preset_config
from minidsa.common.plan import StepKind

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)


def test_decode_and_verify_forward_have_no_graph_breaks():
    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw["vocab_size"] = 512
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=0, init_std=0.1)
    d = PagedDriver(model, cfg, page_size=1, max_len=128)
    for n in (40, 50):
        d.add(list(range(3, 3 + n)), reserve=4)
    d.prefill([0, 1])
    rows, seq = [d.reqs[i]["row"] for i in range(2)], [40, 50]
    r2t = d.table.req_to_token
    decode = ForwardBatch.build(StepKind.DECODE, [5, 6], rows, seq, [1, 1],
                                torch.stack([r2t[r, n].long() for r, n in zip(rows, seq)]), "cpu")
    mask = torch.tril(torch.ones(3, 3, dtype=torch.bool)).repeat(2, 1)
    verify = ForwardBatch.build(StepKind.VERIFY, list(range(10, 16)), rows, seq, [3, 3],
                                torch.cat([r2t[r, n:n + 3].long() for r, n in zip(rows, seq)]), "cpu", logits="all",
                                positions=torch.tensor([n + j for n in seq for j in range(3)]),
                                kv_lens=torch.tensor([n for n in seq for _ in range(3)]), tree_mask=mask,
                                max_kv_len=max(seq) + 3)
    with torch.no_grad():
        for batch in (decode, verify):
            ex = torch._dynamo.explain(model.forward)(batch, d.attn)
            assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
            assert ex.graph_count == 1
            hidden = torch.zeros(batch.num_tokens, cfg.hidden_size)
            ex = torch._dynamo.explain(model.forward_mtp)(batch, d.attn, hidden, None)
            assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
    d.release_all()


class RecordingBackend:
    """aot_eager, keeping every graph Dynamo hands over (one per compilation)."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def custom_ops(self, gm) -> set[str]:
        return {str(n.target) for n in gm.graph.nodes if "minidsa" in str(n.target)}


def _prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randint(2, vocab - 1) for _ in range(rng.randint(20, 70))] for _ in range(n)]


def _llm(**kw) -> LLM:
    return LLM(model=None, device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=4,
               cuda_graph_max_bs=4, progress=False, **kw)


@pytest.mark.skipif(not triton_usable(torch.device("cpu"))[0], reason="needs Triton's interpreter on CPU")
def test_compiled_steps_equal_eager_with_one_graph_per_kind(monkeypatch):
    """Speculative decoding (decode, target verify, draft extend) through compiled static-buffer steps
    gives the eager tokens; batch buckets 1..4 and two context buckets reuse a step kind's graph."""
    reference_llm = _llm(kernel_backend="triton")
    prompts = _prompts(reference_llm.engine.model_config.vocab_size, 3)
    reference = [o.token_ids for o in reference_llm.generate(prompts, GREEDY)]

    backend = RecordingBackend()
    llm = _llm(kernel_backend="triton", speculative_num_steps=1)
    runner = llm.engine.runner
    monkeypatch.setattr("minidsa.exec.runner.CTX_BUCKETS", [64])  # two context buckets on short prompts
    static_fast_paths(runner, llm.engine.speculator.layout, backend)
    assert runner.compiled and len(runner.graphs.ctx_buckets) == 2
    replays = count_replays(runner.graphs)
    # One request, then three together (batch buckets 1 and 4, both context buckets).
    outs = [llm.generate(prompts[:1], GREEDY)[0].token_ids]
    outs += [o.token_ids for o in llm.generate(prompts[1:], GREEDY)]
    assert outs == reference
    assert all(replays[k] > 0 for k in (StepKind.VERIFY, StepKind.DRAFT_EXTEND))

    # Regional compilation: a fixed set of graphs per decoder-layer kind, whatever the depth, the step kind, the
    # batch / context buckets and one-token batches (size-oblivious sizes: no 0/1 specialisation). Dense and MoE
    # layers: one each (a chain's verify is causal like a prefill, so it adds no tree-mask graph); the MTP layer:
    # handed the top-k (after a prefill, warmed up at start-up) and computing its own (the draft-extend graph).
    graphs = [g for g in backend.graphs if len(g.graph.nodes) > 0]  # Dynamo also hands over empty frames
    assert len(graphs) == 2 + 2, [len(g.graph.nodes) for g in backend.graphs]
    own_topk = 0
    for gm in graphs:  # the DSA kernels stay opaque custom ops inside the traced graph
        ops = backend.custom_ops(gm)
        assert any("sparse_mla" in o for o in ops), ops
        own_topk += any("index_logits" in o for o in ops)
    assert own_topk == len(graphs) - 1  # all but the MTP layer's handed-top-k graph run the indexer


@pytest.mark.skipif(not triton_usable(torch.device("cpu"))[0], reason="needs Triton's interpreter on CPU")
def test_activation_profile_traces_the_layer_the_engine_serves_with():
    """The GPU start-up order: the activation profile runs the compiled layer first, on its one-page scratch cache
    and one-row req_to_token (beside DeepGEMM's pool); the capture, the warm-up and serving then run it on the
    engine's cache and table (other page count, rows and width) and compile only the draft extend's graph (the
    MTP layer computing its own top-k), which the profile never runs. Tokens equal eager."""
    kw = dict(kernel_backend="triton", speculative_num_steps=1, max_prefill_tokens=48, chunked_prefill_size=48)
    reference_llm = _llm(**kw)
    prompts = _prompts(reference_llm.engine.model_config.vocab_size, 2)  # 79 tokens: over a 48-token prefill step
    reference = [o.token_ids for o in reference_llm.generate(prompts, GREEDY)]

    llm = _llm(**kw)
    runner = llm.engine.runner
    backend = RecordingBackend()
    layer = runner.compile_layer(backend)
    context, steps = runner.profile_steps(300 * runner.kv_bytes_per_token, layer)
    assert context != runner.table_width and runner.attn.req_to_token.shape[0] > 1
    for run in steps.values():
        run()
    traced = [g for g in backend.graphs if len(g.graph.nodes) > 0]
    assert len(traced) == 3  # dense, MoE, the MTP layer handed the top-k (its catch-up after a prefill)
    # The caches are written by opaque ops: inductor would pick 32-bit indexing for a cache it indexes itself at
    # the scratch cache's size and guard on it (on an H100: `576*caches.mla.size()[0] <= 2147483647`).
    targets = [{str(n.target) for n in gm.graph.nodes} for gm in traced]
    assert all("minidsa.norm_rope_store_mla" in t for t in targets[:2])
    assert any("minidsa.norm_rope_store_index_k" in t for t in targets)
    assert not [t for ts in targets for t in ts if "index_copy" in t or "index_put" in t or "setitem" in t], targets
    run_main, run_mtp = runner.step_functions(layer)
    runner.use_graphs(runner.build_graphs(llm.engine.speculator.layout, run_main, run_mtp),
                      warm_up_tokens=CPU_WARMUP_TOKENS)
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs == reference
    traced = [g for g in backend.graphs if len(g.graph.nodes) > 0]
    assert len(traced) == 4, [len(g.graph.nodes) for g in traced]


@pytest.mark.skipif(not triton_usable(torch.device("cpu"))[0], reason="needs Triton's interpreter on CPU")
def test_capture_order_compiles_one_graph_for_every_bucket(monkeypatch):
    """The GPU start-up sequence (buckets largest first, one warm-up call each, then the capture's) compiles the
    decode step once for buckets 8, 4, 2 and 1, in a fresh process: no guard on a host-side cache
    filled during the first trace (the SM count behind the top-k choice), and no duck-sizing equality
    between the batch and a persistent buffer of the same size (req_to_token has 8 rows here)."""
    import minidsa.kernels

    monkeypatch.setattr(minidsa.kernels, "_NUM_SMS", {})
    monkeypatch.setattr(minidsa.kernels, "_LOGGED_MESSAGES", set())
    backend = RecordingBackend()
    llm = LLM(model=None, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=8,
              cuda_graph_max_bs=8, progress=False, kernel_backend="triton")
    runner = llm.engine.runner
    assert runner.attn.req_to_token.shape[0] == 8
    static_fast_paths(runner, None, backend)
    graphs = runner.graphs
    assert graphs.buckets == [1, 2, 4, 8]
    shape, ctx = graphs.shapes[StepKind.DECODE], graphs.ctx_buckets[0]
    with torch.no_grad():
        for bs in (8, 4, 2, 1):
            for _ in range(2):
                graphs._run(shape, graphs.static[(StepKind.DECODE, bs, ctx)])
    sizes = [len(g.graph.nodes) for g in backend.graphs if len(g.graph.nodes) > 0]
    assert len(sizes) == 2, sizes  # one per layer kind (dense, MoE): bucket one compiles nothing more


def test_logging_a_kernel_fallback_adds_no_guard(monkeypatch):
    """A fallback logged once per process must not make compiled steps guard on the set of logged messages."""
    import logging

    from torch._dynamo.testing import CompileCounter

    import minidsa.kernels

    monkeypatch.setattr(minidsa.kernels, "_LOGGED_MESSAGES", set())
    counter = CompileCounter()
    log = logging.getLogger("minidsa.test")

    def step(x):
        minidsa.kernels.log_once(log, logging.WARNING, "DSA sparse MLA: torch reference (test)")
        return x + 1

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    compiled(torch.zeros(3))
    step(torch.zeros(3))  # the eager path logs it: the set grows
    compiled(torch.zeros(3))
    assert minidsa.kernels._LOGGED_MESSAGES == {"DSA sparse MLA: torch reference (test)"}
    assert counter.frame_count == 1


def test_compiled_layers_do_not_grow_with_depth():
    """Start-up does not grow with depth: a 6-layer model compiles exactly as many layer graphs as a
    2-layer one (one per layer kind), because layers read their caches as inputs, never their index."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from minidsa.models.deepseek_v32 import call_layer

    frames = []
    for layers in (2, 6):
        torch._dynamo.reset()
        raw = preset_config("tiny")
        raw.pop("initializer_range")
        raw.update(vocab_size=256, num_hidden_layers=layers)
        cfg = ModelConfig.from_dict(raw)
        model = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=0, init_std=0.1)
        d = PagedDriver(model, cfg, page_size=1, max_len=64)
        d.add(list(range(3, 43)), reserve=2)
        counter = CompileCounterWithBackend("aot_eager")
        layer = torch.compile(call_layer, dynamic=True, fullgraph=True, backend=counter)
        row = d.reqs[0]["row"]
        r2t = d.table.req_to_token
        prefill = ForwardBatch.build(StepKind.EXTEND, list(range(3, 43)), [row], [0], [40],
                                     r2t[row, :40].long(), "cpu")
        with torch.no_grad():
            eager = model(prefill, d.attn).logits
            compiled = model(prefill, d.attn, layer).logits
        torch.testing.assert_close(compiled, eager)
        frames.append(counter.frame_count)
        d.release_all()
    assert frames[0] == frames[1] <= 4, frames  # a few per layer kind (dense, MoE), not one per layer


COMPILED_ENGINE = dict(model=None, device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=4,
                       cuda_graph_max_bs=2, progress=False, kernel_backend="triton", chunked_prefill_size=8,
                       max_prefill_tokens=12, enable_mixed_chunk=True)


@pytest.fixture(scope="module")
def compiled_llm():
    """An engine whose runner compiled its layers (aot_eager, counted) at start-up, with the KV caches and the
    req->token table filled with known values before start-up: (llm, counter, [buffers before, after])."""
    from torch._dynamo.testing import CompileCounterWithBackend

    llm = LLM(**COMPILED_ENGINE)
    runner = llm.engine.runner
    kv = runner.kv_cache
    buffers = (kv.mla_buffer, kv.index_buffer, runner.req_to_token)
    g = torch.Generator().manual_seed(0)
    for buf in buffers:
        buf.copy_(torch.randint(0, 100, buf.shape, generator=g).to(buf.dtype))
    before = [b.clone() for b in buffers]
    counter = CompileCounterWithBackend("aot_eager")
    static_fast_paths(runner, None, counter)
    return llm, counter, [before, [b.clone() for b in buffers]]


@pytest.mark.skipif(not triton_usable(torch.device("cpu"))[0], reason="needs Triton's interpreter on CPU")
def test_serving_after_start_up_compiles_nothing_and_matches_eager(compiled_llm, monkeypatch):
    """With compile on, start-up warms up the uncaptured path; then prompts of several lengths, chunked, mixed
    into decode steps, and decode batches past the largest graph bucket all run the compiled layer (never the
    plain modules) with zero new compilations, giving the eager engine's greedy tokens. The warm-up writes only
    the reserved dummy slot: every other cache row and the req->token table are untouched."""
    llm, counter, (before, after) = compiled_llm
    assert counter.frame_count > 0  # the warm-up compiled the layer kinds
    for old, new in zip(before, after):  # caches: slot 0 is the dummy slot; req_to_token: every row
        assert torch.equal(new[:, 1:], old[:, 1:]) if new.dim() == 3 else torch.equal(new, old)

    params = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)
    reference_llm = LLM(**COMPILED_ENGINE)  # not compiled on CPU (no backend named): the plain modules
    rng = random.Random(5)
    vocab = reference_llm.engine.model_config.vocab_size
    # Two one-token prompts alone first (a prefill whose logits width is 1), then lengths from 2 to 34 (more
    # than index_topk 32: sparse attention) with more requests than the largest graph bucket.
    waves = [[[rng.randint(2, vocab - 1)] for _ in range(2)],
             [[rng.randint(2, vocab - 1) for _ in range(n)] for n in (9, 34, 11, 2, 5)]]
    want = [o.token_ids for wave in waves for o in reference_llm.generate(wave, params)]

    runner = llm.engine.runner
    compiled_at_start_up = counter.frame_count
    model_forward = runner.model.forward

    def compiled_only(batch, attn, run_layer=None, layers=None, overlap=None):
        assert run_layer is not None, "a batch ran the plain modules"
        assert layers is None, "a served batch ran only some layers"
        return model_forward(batch, attn, run_layer, overlap=overlap)

    monkeypatch.setattr(runner.model, "forward", compiled_only)
    plans = []
    launch = llm.engine.worker.launch
    monkeypatch.setattr(llm.engine.worker, "launch", lambda plan: plans.append(plan) or launch(plan))
    got = [o.token_ids for wave in waves for o in llm.generate(wave, params)]
    assert got == want
    assert counter.frame_count == compiled_at_start_up, "serving compiled again"
    assert any(p.kind == StepKind.EXTEND and p.has_decode_rows for p in plans)
    assert any(p.kind == StepKind.DECODE and p.batch_size > runner.graphs.buckets[-1] for p in plans)


@pytest.mark.skipif(not triton_usable(torch.device("cpu"))[0], reason="needs Triton's interpreter on CPU")
def test_compiled_prefill_and_mixed_batches_equal_forward_eager(compiled_llm):
    """A two-request prefill and a mixed batch (one request's decode token beside the other's next chunk) through
    the runner's compiled path give forward_eager's logits (fp32) at every token, without compiling again."""
    llm, counter, _ = compiled_llm
    runner = llm.engine.runner
    compiled_at_start_up = counter.frame_count
    table, pages_free, rows_free = runner.req_to_token_table, llm.engine.page_allocator, llm.engine.row_allocator
    lens = (34, 6)  # 34 > index_topk 32: sparse attention
    rows = [rows_free.alloc() for _ in lens]
    pages = [pages_free.alloc(n + 9) for n in lens]  # page_size 1 on CPU: one page per position
    for row, p in zip(rows, pages):
        table.write_pages(row, 0, p, runner.page_size)
    rng = random.Random(7)

    def batch(prefix, extend):
        ids = [rng.randint(2, 5000) for _ in range(sum(extend))]
        loc = torch.cat([runner.req_to_token[r, s:s + n].long() for r, s, n in zip(rows, prefix, extend)])
        return ForwardBatch.build(StepKind.EXTEND, ids, rows, prefix, extend, loc, "cpu", logits="all")

    try:
        for b in (batch([0, 0], list(lens)), batch(list(lens), [1, 4])):
            # Compiled first: eager then rewrites the same slots, so both read the same cached prefix next time.
            compiled = runner.forward(b)
            eager = runner.forward_eager(b)
            torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled.hidden, eager.hidden, rtol=1e-5, atol=1e-5)
            assert torch.equal(compiled.topk, eager.topk)
    finally:
        for row, p in zip(rows, pages):
            rows_free.free(row)
            pages_free.free(p)
    assert counter.frame_count == compiled_at_start_up


def test_start_up_warm_up_reaches_every_kernel_tile_class():
    """The warm-up's single-request ladder runs every fused-MoE tile class (V3.2 routing, FP8 experts) and every
    FP8-GEMM BLOCK_M class that a step of up to max_prefill_tokens meets, each with an odd token count and a
    multiple of 16 (Triton compiles another kernel for integers divisible by 16): no first-use JIT mid-serving."""
    from minidsa.kernels import fp8
    from minidsa.kernels.fp8_gemm import pick_tiles
    from minidsa.kernels.fused_moe import tile_config
    from minidsa.exec.runner import warm_up_shapes

    tokens = 8192
    shapes = warm_up_shapes(tokens, page_size=64, max_model_len=163840, table_width=2560)
    assert shapes[0][0] == [8187, 2, 2]  # the general trace comes first (see _warm_up_uncaptured)
    warmed = {sum(lens) for lens, _ in shapes}
    classes = {
        "fused_moe": lambda t: tile_config(t, 8, 256, fp8.FP8_DTYPE, torch.bfloat16),
        "fp8_gemm BLOCK_M": lambda t: pick_tiles(t, 7168, 2048, 132).block_m,
    }
    for name, cls in classes.items():
        for c in {cls(t) for t in range(1, tokens + 1)}:
            members = [t for t in warmed if cls(t) == c]
            assert any(t % 2 for t in members), (name, c, sorted(warmed))
            if any(cls(t) == c for t in range(16, tokens + 1, 16)):
                assert any(t % 16 == 0 for t in members), (name, c, sorted(warmed))


def test_compiled_batches_get_key_widths_aligned_like_the_context_buckets():
    """Batches through the compiled layer get an indexer-logits width that is a multiple of KEY_ALIGN, as the
    decode graphs' context buckets are (an unaligned or one-page width would compile the layer again), never
    wider than the req->token table, whose width is a multiple of it too."""
    from minidsa.exec.runner import KEY_ALIGN, _aligned_keys

    llm = LLM(model=None, device="cpu", dtype="float32", max_total_tokens=4096, max_model_len=1000,
              max_running_requests=4, progress=False)
    width = llm.engine.runner.table_width
    assert width % KEY_ALIGN == 0 and width >= 1000
    batch = ForwardBatch.build(StepKind.EXTEND, [5, 6, 7], [0], [0], [3], torch.zeros(3, dtype=torch.int64), "cpu")
    assert batch.max_kv_len == 3
    assert _aligned_keys(batch, width).max_kv_len == KEY_ALIGN
    wide = dataclasses.replace(batch, max_kv_len=KEY_ALIGN + 1)
    assert _aligned_keys(wide, width).max_kv_len == 2 * KEY_ALIGN
    assert _aligned_keys(dataclasses.replace(batch, max_kv_len=width - 1), width).max_kv_len == width
    assert _aligned_keys(dataclasses.replace(batch, max_kv_len=2 * KEY_ALIGN), width).max_kv_len == 2 * KEY_ALIGN


def test_one_layer_per_kind_meets_every_layer_graph():
    """The start-up warm-up runs `one_layer_per_kind` (the first layer of each dense / MoE, own / shared top-k
    kind, in order): on an 8-layer model with two dense layers and a shared top-k schedule those layers trace every
    graph the whole forward traces, so serving after such a warm-up compiles nothing new. Two dense layers: the
    first layer is called as the later layers of its kind are (the residual it is handed to add included), not in
    a graph of its own that the warm-up would miss."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from minidsa.models.deepseek_v32 import call_layer

    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw.update(vocab_size=256, num_hidden_layers=8, first_k_dense_replace=2, index_topk_pattern="FFFSFSSF")
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=0, init_std=0.1)
    assert model.one_layer_per_kind() == [0, 2, 3]  # dense + own top-k, MoE + own, MoE + shared
    torch._dynamo.reset()
    d = PagedDriver(model, cfg, page_size=1, max_len=64)
    d.add(list(range(3, 43)), reserve=2)
    counter = CompileCounterWithBackend("aot_eager")
    layer = torch.compile(call_layer, dynamic=True, fullgraph=True, backend=counter)
    row = d.reqs[0]["row"]
    prefill = ForwardBatch.build(StepKind.EXTEND, list(range(3, 43)), [row], [0], [40],
                                 d.table.req_to_token[row, :40].long(), "cpu")
    calls = []

    def counted(lay, *args):
        calls.append(lay)
        return layer(lay, *args)

    with torch.no_grad():
        model(prefill, d.attn, counted, model.one_layer_per_kind())
        assert calls == [model.main_layers[i] for i in (0, 2, 3)]
        warmed = counter.frame_count
        model(prefill, d.attn, layer)  # every layer
    assert warmed > 0 and counter.frame_count == warmed  # the whole forward compiled nothing more
    d.release_all()
