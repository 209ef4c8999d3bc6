"""The kernels a decode step's CUDA graph runs outside the decoder layers, counted (tests/op_census.py).

The engine is the GPU's as far as the CPU allows: Triton kernels (under the interpreter) with DeepGEMM's indexer
(a stand-in following its contract, tests/test_deepgemm_dispatch.py) on an FP8 indexer cache, FP8 linears, bf16.
Each aten op or Triton launch counted here is one kernel of the step's graph on a GPU. The glue between the layers
was ~48 of them (rope's cos / sin chain, ~30 for DeepGEMM's per-step metadata, the final norm's chain); it is now
the embedding, the rope table's gather, one metadata launch, one norm launch, the head's GEMM and fp32 cast, and
the graph's copies of its outputs into the kind's buffers; and the residual stream's two ends: the first layer's
input norm is handed a pending output to add as every later layer's is (a fill of -0.0: nothing), and the last
layer's output is added outside (the rest are added by the next layer's input norm, in its launch). Inside the
layers no add runs on its own: a MoE layer's shared experts' output is added in the fused MoE's launch.
"""

from __future__ import annotations

import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the step's kernels are profiled on the GPU", allow_module_level=True)

from triton_interp import import_kernels_interpreted, run_file_interpreted  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from op_census import OpCensus  # noqa: E402
from minidsa.common.batch import ForwardBatch  # noqa: E402
from minidsa.kernels import deepgemm, optional_lib  # noqa: E402
from minidsa.models.deepseek_v32 import call_layer  # noqa: E402
from minidsa.common.plan import StepKind  # noqa: E402

# What the graph runs outside the layers, each one kernel: the embedding, the first layer's pending output (-0.0),
# the rope rows' gather, DeepGEMM's per-step inputs (one launch), the last layer's output added to the residual
# stream, the final norm (one launch), the head's GEMM and fp32 cast, the copies of hidden, logits and top-k into
# the kind's output buffers.
OUTSIDE = {"embedding": 1, "full_like": 1, "index": 1, "triton:_step_inputs_kernel": 1, "add": 1,
           "triton:_rmsnorm_rows_kernel": 1, "mm": 1, "_to_copy": 1, "copy_": 3}
# The reference chains this replaced: none may come back outside the layers.
CHAINS = {"cos", "sin", "pow", "mean", "rsqrt", "cumsum", "searchsorted", "arange", "stack", "floor_divide"}


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_step_glue_in_child_process():
    run_file_interpreted(__file__)


@in_this_process
def test_decode_step_runs_few_kernels_outside_the_layers(monkeypatch, fresh_log_once):
    from test_deepgemm_dispatch import make_stand_in

    from minidsa import LLM
    from minidsa.common import presets

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(optional_lib, "cuda_capability", lambda device: (9, 0))  # an H100 for the probes
    monkeypatch.setattr(deepgemm, "DEEPGEMM_PAGED_WINS", ((0, 1 << 30, 0, 1 << 30),))  # DeepGEMM at batch 1
    stand_in = make_stand_in({})
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    raw = presets.preset_config("tiny")
    # DeepGEMM takes 32 indexer heads; FP8 needs 128-wide blocks
    raw.update(index_n_heads=32, vocab_size=512, hidden_size=128, q_lora_rank=128, intermediate_size=256,
               moe_intermediate_size=128)
    monkeypatch.setitem(presets.PRESETS, "tiny-glue", raw)
    llm = LLM(model="tiny-glue", device="cpu", dtype="bfloat16", page_size=64, indexer_cache_dtype="fp8",
              kernel_backend="triton", quantization="fp8", max_total_tokens=1024, max_running_requests=2,
              cuda_graph_max_bs=2, progress=False)
    runner = llm.engine.runner
    assert runner.kernels.index_logits == "deepgemm" and runner.kernels.head_norm == "triton"
    census = OpCensus()
    run_main, run_mtp = runner.step_functions(census.counting_layers(call_layer))
    graphs = runner.build_graphs(None, run_main, run_mtp)  # their static buffers, run eagerly (nothing captured)
    # One decode token at the reserved dummy slot 0 (row 0), as the graphs' padding rows are.
    batch = ForwardBatch.build(StepKind.DECODE, [5], [0], [0], [1], torch.zeros(1, dtype=torch.int64), "cpu")
    for name in ("fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata"):  # DeepGEMM's launches: one each
        monkeypatch.setattr(stand_in, name, census.opaque(getattr(stand_in, name), f"deep_gemm:{name}"))
    replay = graphs.replay

    def counted_run_main(b, *args):  # the graph's part of a replay (not its input refresh)
        census.place = "outside"
        return run_main(b, *args)

    graphs.run_main = counted_run_main
    with census.triton_launches(), census:
        census.place = "replay inputs"
        replay(batch)
    outside = census.kernels("outside")
    assert outside == OUTSIDE, census.describe()
    assert not CHAINS & set(census.ops["outside"]), census.describe()
    layers = [place for place in census.ops if place.startswith("layer")]
    assert len(layers) == runner.model_config.num_hidden_layers
    for place in layers:  # no fill of a fresh tensor per layer (the indexer's tree argument was one)
        assert not {"new_zeros", "zeros", "zero_", "fill_", "full", "full_like"} & set(census.ops[place]), \
            census.describe()
    # No layer runs an add of its own: the residual adds are in the norms' launches, and a MoE layer's shared
    # experts' output is added to the routed experts' in the fused MoE's launch that sums the routed rows
    assert False in runner.model_config.dense_layers  # MoE layers among them
    assert [census.ops[f"layer {i}"]["add"] for i in range(len(layers))] == [0] * len(layers), census.describe()


def test_the_rope_table_covers_every_position_a_start_up_step_uses():
    """The activation profile and the warm-up (GPU start-up) put a step's tokens at positions 0 .. step_tokens - 1;
    a tiny model has fewer positions (4096) than a step can hold, and a position past the table reads out of bounds
    on the GPU (a device-side assert: the speculative engines' start-up at 60ef087)."""
    from minidsa import LLM

    llm = LLM(model="tiny", progress=False, chunked_prefill_size=6000, max_prefill_tokens=6000)
    runner = llm.engine.runner
    assert runner.step_tokens > runner.model_config.max_position_embeddings
    assert runner.model.rotary.table.shape[0] >= max(runner.step_tokens, runner.req_to_token.shape[1])
