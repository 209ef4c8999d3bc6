"""The indexer's chain on a side stream (kernels/side_stream.py): when the engine chooses it, and where the model
places the fork, the leave and the join.

What runs concurrently on a GPU is checked there (tests/gpu/test_graphs_gpu.py: the same tokens and logits with the
chain inline and beside). Here: the choice's rule, and the traced layer's order, which is what keeps the two
streams apart: the fork after everything the chain reads is made and before its first op, only the chain between
fork and leave, the join before the sparse attention reads the top-k; and that off CUDA the steps change nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_graphs_gpu.py runs the side stream", allow_module_level=True)

from triton_interp import import_kernels_interpreted, run_file_interpreted  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from harness import PagedDriver  # noqa: E402
from minidsa.attention import select  # noqa: E402
from minidsa.attention.select import IndexerShape, KernelChoice, Overrides  # noqa: E402
from minidsa.config import ModelConfig  # noqa: E402
from minidsa.exec.batch import ForwardBatch  # noqa: E402
from minidsa.kernels import side_stream  # noqa: E402
from minidsa.models.deepseek_v32 import MLAttention, set_side_stream  # noqa: E402
from minidsa.models.loader import build_model  # noqa: E402
from minidsa.models.presets import preset_config  # noqa: E402
from minidsa.sched.plan import StepKind  # noqa: E402

CUDA = torch.device("cuda", 0)
FP8_INDEXER = IndexerShape(num_heads=64, head_dim=128, page_size=64, fp8_cache=True)
# What select_kernels picks on an H100 with DeepGEMM and FlashMLA (no CUDA call is made by the rule).
GPU_CHOICE = KernelChoice(store_index_k="triton", index_logits="deepgemm", topk="triton", sparse_mla="flashmla",
                          kv_move="triton", store_mla="triton", quant_index_q="triton", sample="triton",
                          fp8_gemm="deepgemm", moe_gemm="deepgemm", router="triton", norm_quant="triton",
                          mla_absorb="triton", fp32_gemv="triton")


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_side_stream_in_child_process():
    run_file_interpreted(__file__)


def test_the_side_stream_is_chosen_only_where_every_op_on_it_is_opaque():
    assert select.side_stream_inline_why(CUDA, GPU_CHOICE, FP8_INDEXER) is None
    assert select._side_stream(CUDA, GPU_CHOICE, FP8_INDEXER, Overrides()) == ("side",
                                                                                  "every op of the chain is opaque")
    bf16_cache = dataclasses.replace(FP8_INDEXER, fp8_cache=False)
    assert "query rope is a torch op" in select.side_stream_inline_why(CUDA, GPU_CHOICE, bf16_cache)
    assert "query rope is a torch op" in select.side_stream_inline_why(CUDA, GPU_CHOICE, None)
    for field, impl in (("topk", "torch"), ("fp32_gemv", "torch"), ("store_index_k", "torch"),
                        ("quant_index_q", "torch"), ("index_logits", "torch"), ("fp8_gemm", "torch")):
        why = select.side_stream_inline_why(CUDA, dataclasses.replace(GPU_CHOICE, **{field: impl}), FP8_INDEXER)
        assert why is not None and "torch" in why, (field, why)
    # one stream off CUDA; the override can keep it inline, never force the side stream where it is unsafe
    assert select.side_stream_inline_why(torch.device("cpu"), GPU_CHOICE, FP8_INDEXER) == "one stream on cpu"
    assert select._side_stream(CUDA, GPU_CHOICE, FP8_INDEXER, Overrides(side_stream="inline"))[0] == "inline"
    with pytest.raises(ValueError, match="MINIDSA_SIDE_STREAM=side: .*one stream on cpu"):
        select._side_stream(torch.device("cpu"), GPU_CHOICE, FP8_INDEXER, Overrides(side_stream="side"))
    assert select.select_kernels("cpu").side_stream == "inline"
    with pytest.raises(ValueError, match="KernelChoice.side_stream"):
        KernelChoice(side_stream="beside")


def test_the_override_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("MINIDSA_SIDE_STREAM", "inline")
    assert Overrides.from_environment().side_stream == "inline"
    monkeypatch.setenv("MINIDSA_SIDE_STREAM", "sideways")
    with pytest.raises(ValueError, match="MINIDSA_SIDE_STREAM must be 'inline' or 'side'"):
        Overrides.from_environment()


# The DSA ops as the GPU runs them (opaque custom ops, here interpreted), over an fp8 indexer cache.
CPU_KERNELS = KernelChoice(store_index_k="triton", index_logits="triton", topk="triton", sparse_mla="triton",
                           kv_move="triton", store_mla="triton", quant_index_q="triton")


def _model_and_batches():
    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw["vocab_size"] = 512
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=0, init_std=0.1, mla_absorb="triton",
                        fp32_gemv="triton", router="triton")
    d = PagedDriver(model, cfg, page_size=1, max_len=128, indexer_fp8=True, kernels=CPU_KERNELS)
    for n in (40, 50):
        d.add(list(range(3, 3 + n)), reserve=4)
    d.prefill([0, 1])
    rows, seq = [d.reqs[i]["row"] for i in range(2)], [40, 50]
    r2t = d.table.req_to_token
    decode = ForwardBatch.build(StepKind.DECODE, [5, 6], rows, seq, [1, 1],
                                torch.stack([r2t[r, n].long() for r, n in zip(rows, seq)]), "cpu")
    return model, d, decode


def _call_order(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's calls in program order, by name (`minidsa::x` ops as `x`, torch functions by their name)."""
    names = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            t = str(n.target)
            names.append(t.split(".")[1] if t.startswith("minidsa.") else getattr(n.target, "__name__", t))
    return names


@in_this_process
def test_each_layer_forks_after_the_branchs_inputs_and_joins_before_its_results_are_read():
    model, d, decode = _model_and_batches()
    with torch.no_grad():
        inline = model.forward(decode, d.attn).logits
        set_side_stream(model, "side")
        assert {m.side_stream for m in model.modules() if isinstance(m, MLAttention)} == {True}
        ex = torch._dynamo.explain(model.forward)(decode, d.attn)
        beside = model.forward(decode, d.attn).logits
    assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
    assert torch.equal(inline, beside)  # off CUDA the three steps do nothing
    calls = [c for gm in ex.graphs for c in _call_order(gm)]
    main = model.main_layers
    indexers = sum(1 for layer in main if layer.self_attn.computes_topk)
    assert indexers >= 1
    for step in ("fork_side_stream", "leave_side_stream", "join_side_stream"):
        assert calls.count(step) == indexers, (step, calls)
    start = 0
    for _ in range(indexers):
        fork = calls.index("fork_side_stream", start)
        leave = calls.index("leave_side_stream", fork)
        join = calls.index("join_side_stream", leave)
        chain = [c for c in calls[fork + 1:leave] if c not in ("getitem", "view")]
        between = calls[leave + 1:join]
        # the indexer's whole chain, from its query projection and key store to its top-k, and only opaque ops (an
        # F.linear here: the tiny model's weights are not FP8); the query's path between leave and join; the sparse
        # attention (the top-k's first reader) after
        assert chain == ["linear", "norm_rope_store_index_k", "fp32_gemv", "quant_index_q", "index_logits",
                         "topk_slots"], chain
        assert "norm_rope_store_mla" in between and "absorb_q" in between, between
        assert calls.index("sparse_mla", join) > join and "sparse_mla" not in calls[fork:join]
        start = join + 1
    d.release_all()


def test_a_layer_that_raises_after_the_fork_leaves_the_main_stream_current(monkeypatch):
    """Off CUDA the steps are no-ops, so this checks the bookkeeping: an error between fork and leave leaves no fork
    open (the next step's fork would refuse to nest)."""
    events = []

    class FakeSide:
        main = None

        def leave(self):
            events.append("leave")
            self.main = None

    side = FakeSide()
    monkeypatch.setattr(side_stream, "_side", {0: side})
    side.main = "main stream"
    with pytest.raises(RuntimeError, match="boom"):
        with side_stream.main_stream_after_errors(CUDA):
            raise RuntimeError("boom")
    assert events == ["leave"] and side.main is None
    with side_stream.main_stream_after_errors(CUDA):
        pass
    assert events == ["leave"]


@in_this_process
def test_inductor_keeps_the_main_path_between_leave_and_join():
    """The order that matters is the one inductor's wrapper launches in (its scheduler may move a node as early as
    its inputs allow: a join with nothing of the query's path among its inputs went up right after the leave, and
    q_b and W_UK waited for the side branch). Compiled here with inductor for the CPU, the same scheduler: the
    indexer's chain between fork and leave, the query's q_b, key store and W_UK between leave and join; no inductor
    kernel between a fork and its leave."""
    import shutil

    from torch._inductor.utils import run_and_get_code

    from minidsa.models.deepseek_v32 import call_layer

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor's CPU backend needs a C++ compiler")
    model, d, decode = _model_and_batches()
    set_side_stream(model, "side")
    torch._dynamo.reset()
    layer = torch.compile(call_layer, dynamic=True, fullgraph=True, backend="inductor")
    with torch.no_grad():
        _, codes = run_and_get_code(lambda: model.forward(decode, d.attn, layer))
    torch._dynamo.reset()
    checked = 0
    for code in codes:
        calls = [line.strip() for line in code.splitlines()
                 if "torch.ops.minidsa." in line or "extern_kernels." in line or line.strip().startswith("cpp_fused")]

        def at(name, after):
            return next(i for i, c in enumerate(calls) if name in c and i > after)

        fork = -1
        while any("fork_side_stream" in c for c in calls[fork + 1:]):
            fork = at("fork_side_stream", fork)
            leave, join = at("leave_side_stream", fork), at("join_side_stream", fork)
            assert fork < leave < join, calls
            # nothing inductor generated between fork and leave: its kernels launch on the main stream
            assert not any(c.startswith("cpp_fused") for c in calls[fork:leave]), calls[fork:leave]
            assert "topk_slots" in "".join(calls[fork:leave]), calls[fork:leave]
            q_b = at("extern_kernels.mm", leave)
            assert max(at("norm_rope_store_mla", leave), q_b, at("absorb_q", leave)) < join, calls
            assert join < at("sparse_mla", fork), calls
            checked += 1
    assert checked >= 1
    d.release_all()
