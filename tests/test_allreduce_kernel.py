"""The one-shot all-reduce kernel (kernels/allreduce.py) on CPU through Triton's interpreter, one process.

What runs here: the kernel's own logic with its peers' side written by the test. Rank 0 of a simulated 2-rank group
runs the kernel while rank 1's staging and its announcements (the flags it would store) are already in place, so
the copy into the staging half of the epoch, the announcements to every rank, the wait, the sum in rank order and the
epoch / arrival-count bookkeeping are all checked, over consecutive calls with different grids. Then the op and
`TensorParallel.all_reduce` with buffers of a group of one (a gloo group of one: the one-shot kernel up to
`max_bytes`, the group's all-reduce above), traced by torch.compile in one graph whatever the size.

What cannot run here: two processes mapping each other's GPU memory (CUDA IPC), the memory ordering of the flags on
real hardware, CUDA-graph replays: tests/gpu/test_allreduce_gpu.py (2 GPUs) and benchmarks/scripts/bench_allreduce.py.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_allreduce_gpu.py checks the compiled kernel", allow_module_level=True)

from triton_interp import import_kernels_interpreted, run_file_interpreted, torch_rounded_casts  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import allreduce as k  # noqa: E402
from minidsa.kernels import custom_ops  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_allreduce_kernel_in_child_process():
    run_file_interpreted(__file__)


class SimulatedGroup:
    """`world` ranks' allocations in host memory (the interpreter's pointers are host addresses), laid out as on the
    GPU: signal area, then staging halves 0 and 1 of `capacity` bytes."""

    def __init__(self, world: int, capacity: int):
        self.world, self.capacity = world, capacity
        self.memory = [torch.zeros(k.allocation_bytes(capacity), dtype=torch.uint8) for _ in range(world)]
        base = [m.data_ptr() for m in self.memory]
        self.buffer_ptrs = torch.tensor([p + k.staging_offset() for p in base], dtype=torch.int64)
        self.signal_ptrs = torch.tensor(base, dtype=torch.int64)

    def signals(self, rank: int) -> torch.Tensor:
        return self.memory[rank][:k.SIGNAL_BYTES].view(torch.int64)

    def staging(self, rank: int, half: int, dtype: torch.dtype) -> torch.Tensor:
        start = k.staging_offset() + half * self.capacity
        return self.memory[rank][start:start + self.capacity].view(dtype)

    def slot(self, rank: int, program: int, sender: int) -> int:
        return int(self.signals(rank)[k.HEADER_WORDS + program * k.MAX_WORLD + sender])

    def peer_arrives(self, peer: int, at: int, epoch: int, x: torch.Tensor) -> None:
        """Rank `peer` has put x in its staging half of `epoch` and announced every program to rank `at`."""
        self.staging(peer, epoch % 2, x.dtype)[:x.numel()] = x.flatten()
        for p in range(k.grid_for(x.numel())):
            self.signals(at)[k.HEADER_WORDS + p * k.MAX_WORLD + peer] = epoch


@in_this_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rank_zero_of_two_over_consecutive_calls(dtype):
    """1, 3, 1, 64 rows x 7168 (grids of 4, 11, 4 and 64 programs): each call uses the staging half of its epoch,
    announces every program to both ranks, sums in fp32 in rank order (exact for fp32 pairs; bf16: the one rounding
    of that sum), and leaves the epoch advanced and the arrival count at 0."""
    group = SimulatedGroup(2, k.ONE_SHOT_MAX_BYTES if dtype == torch.bfloat16 else 2 * k.ONE_SHOT_MAX_BYTES)
    g = torch.Generator().manual_seed(0)
    for epoch, rows in enumerate((1, 3, 1, 64), start=1):
        x0, x1 = (torch.randn(rows, 7168, generator=g).to(dtype) for _ in range(2))
        group.peer_arrives(1, 0, epoch, x1)
        with torch_rounded_casts():
            out = k.one_shot_all_reduce(x0, group.buffer_ptrs, group.signal_ptrs, 0, 2, group.capacity)
        assert torch.equal(out, (x0.float() + x1.float()).to(dtype)), f"call {epoch}"
        assert torch.equal(group.staging(0, epoch % 2, dtype)[:x0.numel()], x0.flatten())
        programs = k.grid_for(x0.numel())
        assert programs == min(k.MAX_PROGRAMS, -(-rows * 7168 // k.BLOCK))
        assert [group.slot(1, p, 0) for p in range(programs)] == [epoch] * programs  # announced to rank 1
        assert [group.slot(0, p, 0) for p in range(programs)] == [epoch] * programs  # and to itself
        assert group.signals(0)[:2].tolist() == [epoch, 0]


@in_this_process
def test_a_peer_ahead_counts_as_arrived():
    """A peer that has already announced a later epoch (it finished this call and started the next) does not stall
    the wait: flags are compared with >=."""
    group = SimulatedGroup(2, 64 * 1024)
    x0 = torch.ones(7168)
    group.peer_arrives(1, 0, 1, torch.full((7168,), 2.0))
    for p in range(k.grid_for(7168)):
        group.signals(0)[k.HEADER_WORDS + p * k.MAX_WORLD + 1] = 2
    out = k.one_shot_all_reduce(x0, group.buffer_ptrs, group.signal_ptrs, 0, 2, group.capacity)
    assert torch.equal(out, torch.full((7168,), 3.0))


@in_this_process
def test_a_bounded_wait_gives_up_on_a_peer_that_never_comes():
    """Start-up's self-test waits a bounded number of polls (max_spins): a peer that never announces makes wrong
    sums, not a hang; the epoch still advances (the launch completed)."""
    group = SimulatedGroup(2, 64 * 1024)
    out = k.one_shot_all_reduce(torch.ones(7168), group.buffer_ptrs, group.signal_ptrs, 0, 2, group.capacity,
                                max_spins=3)
    assert torch.equal(out, torch.ones(7168))  # rank 1's staging is still zeros: not the sum of 2
    assert group.signals(0)[:2].tolist() == [1, 0]


@in_this_process
def test_refuses_what_it_cannot_take():
    group = SimulatedGroup(1, 4096)
    with pytest.raises(ValueError, match="capacity"):
        k.one_shot_all_reduce(torch.ones(4096), group.buffer_ptrs, group.signal_ptrs, 0, 1, group.capacity)
    with pytest.raises(ValueError, match="contiguous"):
        k.one_shot_all_reduce(torch.ones(8, 8).T, group.buffer_ptrs, group.signal_ptrs, 0, 1, group.capacity)


@pytest.fixture
def gloo_group_of_one():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@in_this_process
def test_tensor_parallel_all_reduce_serves_by_size_in_one_compiled_graph(gloo_group_of_one):
    """`TensorParallel.all_reduce` with buffers: the opaque `minidsa::all_reduce` op, which serves up to max_bytes with
    the kernel (the epoch advances) and above it with the group's all-reduce (it does not); under torch.compile
    (dynamic, fullgraph) one graph serves both sizes: the choice is inside the op, no guard on the size."""
    from minidsa.common.tensor_parallel import TensorParallel

    group = SimulatedGroup(1, 8 * 7168 * 4)
    peer = k.PeerBuffers(rank=0, world=1, buffer_ptrs=group.buffer_ptrs, signal_ptrs=group.signal_ptrs,
                         capacity=group.capacity, max_bytes=3 * 7168 * 4)
    tp = TensorParallel(rank=0, size=1, group_name=gloo_group_of_one, peer=peer)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: tp.all_reduce(x) * 2, backend=backend, dynamic=True, fullgraph=True)
    for rows, by_kernel in ((2, True), (3, True), (4, False), (2, True)):  # from 2 rows: dynamic (1 specialises)
        before = int(group.signals(0)[0])
        x = torch.randn(rows, 7168)
        assert torch.equal(compiled(x), x * 2)
        assert int(group.signals(0)[0]) == before + by_kernel, rows
    assert len(graphs) == 1, f"{len(graphs)} graphs: the size was guarded on"
    assert [n for n in graphs[0].graph.nodes if "minidsa.all_reduce" in str(n.target)], graphs[0].code
    assert torch.equal(TensorParallel(rank=0, size=1, group_name=gloo_group_of_one).all_reduce(x), x)  # no peer


_COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minidsa.kernels import allreduce as k
for dtype in ("bf16", "fp16", "fp32"):
    sig = {"x_ptr": "*" + dtype, "out_ptr": "*" + dtype, "buffer_ptrs": "*i64", "signal_ptrs": "*i64", "n": "i32",
           "rank": "i32", "half_elems": "i32", "max_spins": "i32", "WORLD": "constexpr", "SLOTS": "constexpr", "HEADER": "constexpr",
           "BLOCK": "constexpr", "PDL": "constexpr"}
    for world in (2, 4, 8):
        src = ASTSource(k._one_shot_all_reduce_kernel, sig, constexprs={
            "WORLD": world, "SLOTS": k.MAX_WORLD, "HEADER": k.HEADER_WORDS, "BLOCK": k.BLOCK, "PDL": True})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": k.NUM_WARPS})
        ptx = kernel.asm["ptx"]
        assert kernel.asm["cubin"]
        assert "multimem" not in ptx, "multicast instructions"
        assert ".sys" in ptx, "no system-scope atomics"
print("compiled")
"""


@pytest.mark.skipif(INTERPRETED, reason="compiles in a child process without the interpreter")
def test_kernel_compiles_for_h100_without_multicast():
    """Compiled for sm_90 without a GPU (bf16 / fp16 / fp32, 2 / 4 / 8 ranks): what only Triton's compiler refuses
    fails here; its PTX has system-scope atomics for the flags and no multimem instruction."""
    from triton_interp import compile_for_h100

    compile_for_h100(_COMPILE_FOR_H100, "_one_shot_all_reduce_kernel")
