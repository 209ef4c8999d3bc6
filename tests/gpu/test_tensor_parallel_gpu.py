"""GPU: the tensor-parallel path with CUDA graphs and torch.compile (NCCL collectives inside the graphs).

- One GPU: tensor_parallel_size 1 through the distributed path (an NCCL group of one, all-reduces and the
  vocab all-gather in every captured graph, rank 0's TensorParallelWorker) gives the plain engine's tokens
  on the bench preset, with MTP speculation and with overlapped scheduling.
- Two or more GPUs: TP=2 gives one GPU's tokens: MTP speculation on a tiny checkpoint (read in slices), and
  expert parallelism on the bench preset in FP8 (real shapes: 128x128 blocks cut at rank boundaries; random
  presets are drawn whole and sharded, so they are the same model at every size). DP attention over two GPUs
  with CUDA graphs (every rank replaying the DECODE graph of one bucket) gives one GPU's tokens on the bench preset.
- Two GPUs, every way a run ends, over NCCL (issue 48: NCCL's graceful teardown hung rank 0): leaving
  `with LLM(...)`, `LLM.close()`, an error inside a step, a rank killed mid-request, and `minidsa serve --tp 2`
  stopped by SIGTERM (drained) or a second SIGINT, or losing a rank, or failing a step. Each ends within its
  bound, rank 1 exits, and both GPUs' memory is given back.

Skipped without CUDA (CPU CI); run by `scripts/gpu_check.sh tp`. A shutdown regression hangs rather than fails:
the two-GPU tests carry a timeout (pytest-timeout's thread method, which ends the run with every thread's stack;
the signal method cannot interrupt a call blocked in NCCL).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from minidsa.common.plan import StepKind

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
EXIT_S = 10.0  # every way a run ends: the process (or LLM.close()) is done within this

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


@pytest.mark.timeout(300, method="thread")
def test_single_rank_group_with_graphs_leaves_at_once_and_another_engine_starts():
    """An NCCL group of one whose collectives are captured in the decode graphs: close() destroys the graphs
    before aborting the group (NCCL aborts a communicator only once they are gone), so the abort returns at once,
    not after TEARDOWN_S, the group is unregistered, and a second engine starts in this process."""
    import torch.distributed as dist

    from minidsa import LLM, SamplingParams
    from minidsa.parallel.launch import TEARDOWN_S

    params = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    one = dict(TINY_TP2, tensor_parallel_size=1, distributed_executor_backend="mp")
    for _ in range(2):
        llm = LLM(**one)
        assert llm.engine.runner.graphs.captured, "no CUDA graph captured: nothing holds the communicator"
        assert len(llm.generate([[5, 6, 7, 8]], params)[0].token_ids) == 8
        took = _close_within(llm)
        assert took < TEARDOWN_S / 2, took
        assert not dist.is_initialized()
        del llm
        gc.collect()


@pytest.mark.timeout(300, method="thread")
def test_two_batch_layer_loop_inside_a_cuda_graph_over_nccl():
    """Two-batch overlap's layer loop (`two_batch.run_layers`: three MoE layers, real experts, a stand-in attention
    stage) captured in a CUDA graph over an NCCL group of one: the all-gathers and reduce-scatters are issued on
    NCCL's stream inside the capture and waited for later; replayed on new inputs, it gives what each micro-batch
    gets through the MoE layer's own exchange, eagerly."""
    from two_batch_check import experts_in_group, inputs, overlapped, reference

    from minidsa.parallel.launch import single_rank_group

    group = single_rank_group("cuda", expert_parallel=True)
    try:
        moes = experts_in_group(group.tp, 3, "cuda")
        hidden = moes[0].gate.weight.shape[1]
        static = inputs(8, hidden, "cuda", 0)
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                overlapped(moes, *static, 4)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = overlapped(moes, *static, 4)
            for seed in (1, 2):
                fresh = inputs(8, hidden, "cuda", seed)
                for buf, value in zip(static, fresh):
                    buf.copy_(value)
                graph.replay()
                for got, want in zip(outs, reference(moes, *fresh, 4)):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        graph.reset()  # before the group is aborted (NCCL waits for the graphs that captured it)
    finally:
        group.shutdown()


@TWO_GPUS
@pytest.mark.timeout(900, method="thread")
def test_two_gpus_equal_one_with_speculation(tmp_path):
    from test_tensor_parallel import checkpoint_with_mtp

    path = checkpoint_with_mtp("deepseek_v32", str(tmp_path / "ckpt"))
    prompts = _prompts(4, 40, 320)
    exact = dict(dtype="float32", indexer_cache_dtype="model", max_total_tokens=4096, speculative_num_steps=2)
    one, _, _, _ = _run(path, prompts, **exact)
    two, replays, worker, _ = _run(path, prompts, tensor_parallel_size=2, **exact)
    assert worker == "TensorParallelWorker" and replays.get(StepKind.VERIFY, 0) > 0, replays
    assert two == one


@TWO_GPUS
@pytest.mark.timeout(900, method="thread")
def test_two_gpus_equal_one_with_expert_parallelism_on_the_fp8_bench_preset():
    prompts = _prompts(3, 300, 120000)
    exact = dict(dtype="float32", indexer_cache_dtype="model", max_total_tokens=16384, max_model_len=2048)
    one, _, _, _ = _run("bench-dsv32:4", prompts, **exact)
    two, replays, _, overlap = _run("bench-dsv32:4", prompts, tensor_parallel_size=2, enable_expert_parallel=True,
                                    **exact)
    assert overlap and replays.get(StepKind.DECODE, 0) > 0, replays
    same = sum(a == b for a, b in zip(one, two))
    assert same == len(prompts), f"{same}/{len(prompts)} prompts token-identical; TP=1 {one}\nTP=2 {two}"


@TWO_GPUS
@pytest.mark.timeout(900, method="thread")
@pytest.mark.parametrize("spec_steps,two_batch", [(0, False), (3, False), (0, True), (3, True)],
                         ids=["plain", "mtp", "two_batch", "mtp_two_batch"])
def test_two_gpus_with_dp_attention_and_cuda_graphs_equal_one_on_the_bench_preset(spec_steps, two_batch):
    """DP attention (each rank its own requests and KV cache, routed experts half per rank) with CUDA graphs and
    torch.compile: decode steps replay every rank's DECODE graph of one bucket (rank 0's choice; the MoE all-gather
    and reduce-scatter captured inside, bucket x 2 rows), prefill steps run the compiled layer uncaptured; the
    tokens are one GPU's. Four prompts of different lengths, two per rank. With MTP chains (3 steps): speculative
    rounds replay their DRAFT, VERIFY and DRAFT_EXTEND graphs in lockstep, still one GPU's greedy tokens. With
    two-batch overlap from 2 tokens, every main-model forward runs the MoE layers as two micro-batches: the DECODE /
    VERIFY graphs of 2+ requests (their exchanges on NCCL's stream inside the graphs), and the prefill steps (each
    rank's tokens in half, a prompt cut inside)."""
    prompts = _prompts(4, 300, 120000)
    exact = dict(dtype="float32", indexer_cache_dtype="model", max_total_tokens=16384, max_model_len=2048)
    one, _, _, _ = _run("bench-dsv32:4", prompts, **exact)
    overlap_args = dict(enable_two_batch_overlap=True, two_batch_overlap_min_tokens=2) if two_batch else {}
    two, replays, worker, overlap = _run("bench-dsv32:4", prompts, tensor_parallel_size=2, enable_dp_attention=True,
                                         speculative_num_steps=spec_steps, **overlap_args, **exact)
    assert worker == "DPAttentionWorker" and not overlap
    graphed = StepKind.VERIFY if spec_steps else StepKind.DECODE
    assert replays.get(graphed, 0) > 0 and replays.get(StepKind.EXTEND, 0) == 0, replays
    same = sum(a == b for a, b in zip(one, two))
    assert same == len(prompts), f"{same}/{len(prompts)} prompts token-identical; one GPU {one}\nDP attention {two}"


# ---------------------------------------------------------------- exits (two GPUs, NCCL)

TINY_TP2 = dict(tensor_parallel_size=2, device="cuda", max_total_tokens=4096, max_running_requests=4,
                cuda_graph_max_bs=4, enable_compile=False, progress=False)
SERVE_TP2 = ("--device", "cuda", "--max-total-tokens", "4096", "--cuda-graph-max-bs", "4", "--disable-compile")
SLACK = 512 << 20  # free memory back to where it was, give or take the driver's and allocator's own


def _free_memory() -> list[int]:
    """Free bytes on GPUs 0 and 1 as the driver reports them (this process keeps a context on each)."""
    return [torch.cuda.mem_get_info(d)[0] for d in range(2)]


def _gpu_pids() -> set[int]:
    """PIDs of the processes with a context on a GPU (nvidia-smi; empty where it cannot see them)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {int(x) for x in out.split() if x.strip().isdigit()}


def _assert_released(before: list[int], *pids: int) -> None:
    """The ended processes hold no GPU (nvidia-smi) and both GPUs' free memory is back, within 10 s (the driver
    reclaims an ended process's memory a moment after it exits)."""
    gc.collect()
    torch.cuda.empty_cache()
    deadline = time.monotonic() + 10
    while True:
        free, held = _free_memory(), _gpu_pids() & set(pids)
        if not held and all(f >= b - SLACK for f, b in zip(free, before)):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"GPU not given back: processes {sorted(held)} still hold a GPU; free MiB "
                                 f"{[f >> 20 for f in free]}, before {[b >> 20 for b in before]}")
        time.sleep(0.2)


def _close_within(llm) -> float:
    started = time.monotonic()
    llm.close()
    return time.monotonic() - started


@TWO_GPUS
@pytest.mark.timeout(600, method="thread")
def test_two_gpus_with_llm_and_close_end_every_rank_and_give_the_memory_back():
    """`with LLM(...)` and `LLM.close()` after a run: rank 1 exits 0 and the NCCL group is left within EXIT_S,
    nothing holds either GPU afterwards, and a new group starts in this process (the second engine)."""
    import torch.distributed as dist

    from minidsa import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    before = _free_memory()
    with LLM(**TINY_TP2) as llm:
        child = llm.engine.runner.ranks.processes.procs[1]
        assert len(llm.generate([[5, 6, 7, 8]] * 3, params)[0].token_ids) == 8
        started = time.monotonic()
    took = time.monotonic() - started
    assert took < EXIT_S, took
    assert child.poll() == 0 and not dist.is_initialized()
    del llm
    _assert_released(before, child.pid)

    llm = LLM(**TINY_TP2)
    child = llm.engine.runner.ranks.processes.procs[1]
    assert len(llm.generate([[9, 10, 11]], params)[0].token_ids) == 8
    took = _close_within(llm)
    assert took < EXIT_S, took
    assert child.poll() == 0 and not dist.is_initialized()
    del llm
    _assert_released(before, child.pid)


@TWO_GPUS
@pytest.mark.timeout(600, method="thread")
def test_two_gpus_an_error_in_a_step_or_a_rank_killed_mid_request_ends_the_run():
    """An error inside rank 0's step (injected, test-only: its forward raises after rank 1 was sent the plan):
    RankFailedError naming it, close within EXIT_S. A rank killed while a long request decodes: named within 5 s,
    close within EXIT_S. Both GPUs given back each time."""
    import torch.distributed as dist

    from minidsa import LLM, SamplingParams
    from minidsa.parallel.launch import RankFailedError

    before = _free_memory()
    llm = LLM(**{**TINY_TP2, "enable_cuda_graph": False})  # a graph replay would not call the patched forward
    child = llm.engine.runner.ranks.processes.procs[1]
    try:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, detokenize=False))

        def failing_forward(*args, **kwargs):
            raise ValueError("injected")

        llm.engine.runner.model.forward = failing_forward  # goes with the engine: nothing else keeps the model
        with pytest.raises(RankFailedError, match=r"rank 0 failed inside a step \(ValueError: injected\)"):
            llm.generate([[9, 10, 11]], SamplingParams(max_tokens=4, detokenize=False))
    finally:
        took = _close_within(llm)
    assert took < EXIT_S, took
    assert child.poll() is not None and not dist.is_initialized()
    for rid in list(llm.engine.requests):
        llm.engine.abort(rid, report=False)
    del llm, failing_forward
    _assert_released(before, child.pid)

    llm = LLM(**TINY_TP2)
    child = llm.engine.runner.ranks.processes.procs[1]
    killed = []
    timer = threading.Timer(0.5, lambda: (killed.append(time.monotonic()), os.kill(child.pid, signal.SIGKILL)))
    try:
        timer.start()  # while the request decodes (4000 tokens: seconds even with graphs)
        with pytest.raises(RankFailedError, match="rank 1 .*killed by signal 9"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4000, ignore_eos=True, detokenize=False))
        named = time.monotonic() - killed[0]
        assert named < 5, named
    finally:
        timer.cancel()
        took = _close_within(llm)
    assert took < EXIT_S, took
    assert child.poll() is not None and not dist.is_initialized()
    for rid in list(llm.engine.requests):
        llm.engine.abort(rid, report=False)
    del llm
    _assert_released(before, child.pid)


@TWO_GPUS
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("how", ["sigterm-drain", "second-sigint", "rank-killed", "step-error", "stuck-teardown"])
def test_two_gpus_server_exits_promptly_however_it_ends(how):
    """`minidsa serve --tp 2` on two GPUs, each ending of test_tensor_parallel.py's serve_and_end (bounds, exit
    code, the error named, rank 1 gone); then neither process holds a GPU and the memory is back."""
    pytest.importorskip("aiohttp")  # the server's packages
    pytest.importorskip("msgspec")
    from test_tensor_parallel import serve_and_end

    before = _free_memory()
    pids = serve_and_end(how, *SERVE_TP2)
    _assert_released(before, *pids)
