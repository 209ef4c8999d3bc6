"""GPU: the tensor-parallel path with CUDA graphs and torch.compile (NCCL collectives inside the graphs).

- One GPU: tensor_parallel_size 1 through the distributed path (an NCCL group of one, all-reduces and the
  vocab all-gather in every captured graph, rank 0's TensorParallelWorker) gives the plain engine's tokens
  on the bench preset, with MTP speculation and with overlapped scheduling.
- Two or more GPUs: TP=2 gives one GPU's tokens: MTP speculation on a tiny checkpoint (read in slices), and
  expert parallelism on the bench preset in FP8 (real shapes: 128x128 blocks cut at rank boundaries; random
  presets are drawn whole and sharded, so they are the same model at every size).

Skipped without CUDA (CPU CI); run by `scripts/gpu_check.sh tp`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from minidsa.common.plan import StepKind

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = dict(max_tokens=12, ignore_eos=True, detokenize=False)


def _run(model, prompts, **kw):
    """(tokens, graph replays per step kind, the engine's worker class name, whether it overlapped steps)."""
    from harness import count_replays
    from minidsa import LLM, SamplingParams

    llm = LLM(model=model, progress=False, max_running_requests=8, **{"cuda_graph_max_bs": 8, **kw})
    try:
        graphs = llm.engine.runner.graphs
        replays = count_replays(graphs) if graphs is not None else {}
        outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(**PARAMS))]
        llm.engine.check_no_leaks()
        worker = type(llm.engine.worker).__name__
        overlap = llm.engine.overlap
    finally:
        llm.close()
    del llm
    # Dynamo's cache holds the compiled layers and, through their guards, the closed engine's model: without
    # a reset the next engine of this process runs out of memory on the fp32 bench preset.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return outs, dict(replays), worker, overlap


def _prompts(n, length, vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (length + 7 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("spec", [True, False], ids=["mtp", "overlap"])
def test_single_rank_distributed_path_equals_plain_engine_on_bench_preset(spec):
    """fp32, full-precision indexer, graphs: uni (one process) and mp (NCCL group of one); with MTP speculation
    (verify / draft-extend graphs, uncompiled: four compiled engines outlast a section's time), and without it
    (overlapped scheduling, compiled decode graphs)."""
    prompts = _prompts(3, 300, 120000)
    exact = dict(dtype="float32", indexer_cache_dtype="model", max_total_tokens=16384, max_model_len=2048,
                 speculative_num_steps=2 if spec else 0, enable_compile=not spec, cuda_graph_max_bs=4)
    plain, _, _, _ = _run("bench-dsv32:4", prompts, **exact)
    dist, replays, worker, overlap = _run("bench-dsv32:4", prompts, distributed_executor_backend="mp", **exact)
    assert worker == "TensorParallelWorker"
    if spec:
        assert replays.get(StepKind.VERIFY, 0) > 0 and replays.get(StepKind.DRAFT_EXTEND, 0) > 0, replays
    else:
        assert overlap and replays.get(StepKind.DECODE, 0) > 0, replays
    same = sum(a == b for a, b in zip(plain, dist))
    assert same == len(prompts), f"{same}/{len(prompts)} prompts token-identical; plain {plain}\nmp {dist}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_equal_one_with_speculation(tmp_path):
    from test_tensor_parallel import checkpoint_with_mtp

    path = checkpoint_with_mtp("deepseek_v32", str(tmp_path / "ckpt"))
    prompts = _prompts(4, 40, 320)
    exact = dict(dtype="float32", indexer_cache_dtype="model", max_total_tokens=4096, speculative_num_steps=2)
    one, _, _, _ = _run(path, prompts, **exact)
    two, replays, worker, _ = _run(path, prompts, tensor_parallel_size=2, **exact)
    assert worker == "TensorParallelWorker" and replays.get(StepKind.VERIFY, 0) > 0, replays
    assert two == one


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_equal_one_with_expert_parallelism_on_the_fp8_bench_preset():
    prompts = _prompts(3, 300, 120000)
    exact = dict(dtype="float32", indexer_cache_dtype="model", max_total_tokens=16384, max_model_len=2048)
    one, _, _, _ = _run("bench-dsv32:4", prompts, **exact)
    two, replays, _, overlap = _run("bench-dsv32:4", prompts, tensor_parallel_size=2, enable_expert_parallel=True,
                                    **exact)
    assert overlap and replays.get(StepKind.DECODE, 0) > 0, replays
    same = sum(a == b for a, b in zip(one, two))
    assert same == len(prompts), f"{same}/{len(prompts)} prompts token-identical; TP=1 {one}\nTP=2 {two}"
