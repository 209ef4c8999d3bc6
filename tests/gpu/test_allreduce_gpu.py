"""GPU, 2 or more: the one-shot peer-to-peer all-reduce (kernels/allreduce.py over CUDA IPC buffers) against NCCL.

- Two ranks (spawned processes, this process's environment: multicast stays off): start-up chooses the kernel
  (every condition of parallel/allreduce.py holds on NVLink-connected GPUs); on random inputs of several sizes and
  dtypes it gives exactly the fp32 sum in rank order rounded once (the same bits on every rank), and NCCL's result
  within its bf16 roundings, eagerly; then inside CUDA graphs of several sizes, each replayed several times with fresh
  inputs written into its static buffer and with eager calls between replays (a stale flag, epoch or staging half
  shows as a wrong sum or a hang, which the timeout ends); sizes above the threshold go to NCCL inside the op.
- A TP=2 engine with the kernel (enable_custom_all_reduce=True) gives the greedy tokens of one with NCCL only,
  with CUDA graphs and torch.compile (decode rows through the kernel, prefill rows above the threshold through NCCL).

Skipped with fewer than 2 GPUs. Run: python -m pytest -q tests/gpu/test_allreduce_gpu.py
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

HIDDEN = 7168
TIMEOUT_S = 240
for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)


def _expected(x: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(the fp32 sum in rank order rounded once to x's dtype, NCCL's all-reduce, every rank's x)."""
    import torch.distributed as dist

    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x)
    acc = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for t in every:
        acc += t.float()
    ref = x.clone()
    dist.all_reduce(ref)
    return acc.to(x.dtype), ref, every


def _check(got, x, world, what):
    want, nccl, every = _expected(x, world)
    assert torch.equal(got, want), \
        f"{what}: not the fp32 sum in rank order ({(got.float() - want.float()).abs().max()})"
    bound = sum(t.float().abs() for t in every) * 2.0**-7
    assert bool(((got.float() - nccl.float()).abs() <= bound).all()), f"{what}: off NCCL's result"


def _rank_checks(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from minidsa.kernels import allreduce as kernel
    from minidsa.parallel.allreduce import gather_on, start_peer_all_reduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        control = dist.new_group(backend="gloo")
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm)
        made = start_peer_all_reduce(rank, world, device, gather_on(control, world), True)
        assert made.buffers is not None, made.why
        peer, name = made.buffers, dist.group.WORLD.group_name
        assert peer.max_bytes == kernel.ONE_SHOT_MAX_BYTES

        def op(t):
            return torch.ops.minidsa.all_reduce(t, name, peer.buffer_ptrs, peer.signal_ptrs, peer.rank, peer.world,
                                                peer.capacity, peer.max_bytes)

        g = torch.Generator(device=device).manual_seed(rank)
        sizes = [(1, HIDDEN), (3, HIDDEN), (16, HIDDEN), (64, HIDDEN), (5, 1000), (1, 8)]
        # eager: dtypes, sizes, odd sizes (a partial last tile), and above the threshold (NCCL inside the op)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for shape in sizes:
                x = torch.randn(shape, device=device, generator=g).to(dtype)
                if x.numel() * x.element_size() <= peer.max_bytes:
                    _check(op(x), x, world, f"eager {dtype} {shape}")
        big = torch.randn(65, HIDDEN, device=device, generator=g).to(torch.bfloat16)
        assert not kernel.serves(big.numel() * 2, big.dtype, True, peer.max_bytes)
        _, nccl, _ = _expected(big, world)
        assert torch.equal(op(big), nccl), "above the threshold the op is NCCL's all-reduce"
        # CUDA graphs: three sizes, two chained all-reduces each (an epoch per call), replayed with fresh inputs,
        # with eager calls in between
        graphs = []
        for rows in (1, 8, 64):
            static = torch.zeros(rows, HIDDEN, device=device, dtype=torch.bfloat16)
            first = op(static)  # warm (and compiled) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                first = op(static)
                second = op(first)
            graphs.append((static, first, second, graph))
        for replay in range(4):
            for static, first, second, graph in graphs:
                static.copy_(torch.randn(static.shape, device=device, generator=g).to(static.dtype))
                graph.replay()
                torch.cuda.synchronize()
                _check(first.clone(), static, world, f"graph {tuple(static.shape)} replay {replay} first")
                _check(second.clone(), first.clone(), world, f"graph {tuple(static.shape)} replay {replay} second")
                x = torch.randn(2, HIDDEN, device=device, generator=g).to(torch.bfloat16)
                _check(op(x), x, world, f"eager between replays {replay}")
        torch.cuda.synchronize()
        dist.barrier(group=control)
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(fn, args=(world, port), nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the ranks did not finish within {TIMEOUT_S} s: an all-reduce that never returned")


def test_one_shot_equals_nccl_eagerly_and_in_cuda_graphs():
    _spawn(_rank_checks, 2)


PARAMS = dict(max_tokens=12, ignore_eos=True, detokenize=False)


def _tokens(**kw):
    import gc

    from minidsa import LLM, SamplingParams

    # fp32 and the full-precision indexer, as tests/gpu/test_tensor_parallel_gpu.py: run-to-run exact at TP=2
    llm = LLM(model="bench-dsv32:4", progress=False, max_running_requests=8, cuda_graph_max_bs=8, dtype="float32",
              indexer_cache_dtype="model", max_total_tokens=16384, max_model_len=2048, tensor_parallel_size=2, **kw)
    try:
        ranks = llm.engine.runner.ranks
        served = ranks.all_reduce
        assert ranks.tp.peer is served.buffers  # what the model's layers were built with
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, 120000, (300 + 7 * i,), generator=g).tolist() for i in range(4)]
        outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(**PARAMS))]
    finally:
        llm.close()
    del llm
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return outs, served


def test_tp2_engine_with_the_one_shot_kernel_gives_nccls_tokens():
    """At 2 ranks the kernel's sum of two values (in fp32, rounded once) is NCCL's result bit for bit: the same greedy
    tokens, decode (graphs, compiled layers: fp32 rows of 28 KB) through the kernel, prefill (300 rows, 8.6 MB) above
    the threshold through NCCL."""
    nccl, served = _tokens(enable_custom_all_reduce=False)
    assert served.buffers is None and "turned off" in served.why
    one_shot, served = _tokens(enable_custom_all_reduce=True)
    assert served.buffers is not None, served.why
    assert one_shot == nccl
