"""A one-shot all-reduce (sum) for small tensors over peer-visible buffers, in one Triton launch per rank.

Why: a decode step's all-reduces (batch 1-64 rows x 7168, bf16: 14 KB to 0.9 MB) are latency-bound, and NCCL's
fixed cost dominates them; vLLM and SGLang serve them with a kernel that reads every peer's buffer directly over
NVLink (CUDA IPC), and NCCL above a size (DESIGN.md section 8). NVLink multicast stays off on our machines, so this
uses plain peer-to-peer loads and stores only: no multimem instructions, no NVLS.

Buffers (`PeerBuffers`, made and shared once at start-up by minidsa/parallel/allreduce.py, handed to the model in
its `TensorParallel`): every rank owns one device allocation that every peer has mapped (CUDA IPC):

    [signal area: SIGNAL_BYTES][staging half 0: capacity bytes][staging half 1: capacity bytes]

`buffer_ptrs[r]` / `signal_ptrs[r]` (int64 device tensors, the same order on every rank) are rank r's staging and
signal addresses as mapped in THIS process. The signal area holds int64 words: [0] this rank's epoch (all-reduces
completed), [1] how many programs of the running launch have finished, then [2 + p * MAX_WORLD + r]: the latest epoch
at which program p of rank r announced its data to this rank.

Protocol of one call (epoch e = the rank's epoch + 1, read from its own signal area: no host state, so a CUDA
graph replays it any number of times, and eager calls and replays interleave freely):
1. program p copies its share of x (tiles p, p + grid, ...) into this rank's staging half e % 2;
2. a CTA barrier, then for every rank r (itself included) one release store at system scope of e into rank r's
   slot [p][this rank]: "program p's share of epoch e is in my staging";
3. it spins (acquire loads, system scope) until every rank's slot [p][r] here is >= e (a later epoch counts too:
   that rank has gone on);
4. it sums its share over ranks 0..N-1 in that order, in fp32, from every rank's staging half e % 2 (loads that skip
   L1), and writes out in x's dtype: every rank gets the same bits;
5. the last program to finish (a per-rank arrival count) sets the count back to 0 and the epoch to e.

Why two staging halves: a rank may start call n + 1 (and overwrite its staging) while a slower peer still reads
its call-n data; it cannot start call n + 2 before every peer has finished call n (it saw each peer's program 0
announce call n + 1, and a launch starts only after the previous one on its stream finished: PDL's wait is this
kernel's first statement). So halves n % 2 and (n + 1) % 2 never meet a reader of the other call. The programs of
one launch never wait for each other, only for the same program of the peers: each program's peers must come to
run alongside it, which they do with at most `SLOT_PROGRAMS` programs of 4-8 warps (a few per SM at most) and no
other kernel holding the SMs (the launch before finished; the launch after cannot start before this one's programs
exit: no program triggers its dependents early).

Every rank must issue the same all-reduces in the same order with the same sizes (as with NCCL): the grid, and so
which slots are used, is a function of the size alone.

Which sizes this serves and which NCCL does (`serves`): up to `ONE_SHOT_MAX_BYTES`, decided per call inside the
custom op (kernels/custom_ops.py `all_reduce`), from the concrete size: compiled graphs get no guards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

# Largest all-reduce (bytes) the one-shot kernel serves; NCCL above. The rule: the smallest `recommended_max_bytes`
# over the rank counts served, from the allreduce_h200_x<ranks>_<commit>.json files
# benchmarks/scripts/bench_allreduce.py writes (NCCL against this kernel inside CUDA graphs, 1-256 rows x 7168 bf16).
# Measured at 2 ranks only (benchmarks/multi_gpu/allreduce_h200_x2_3e069a9.json: 256 rows recommended); until 4 ranks
# are, 64 rows x 7168 bf16, the largest decode batch (vLLM's one-stage kernel serves up to 512 KB at 4 ranks, 256 KB
# at 8; its two-stage kernel above).
ONE_SHOT_MAX_BYTES = 64 * 7168 * 2
MAX_WORLD = 8  # ranks of one host that can map each other's memory
# The launch (`Launch`; benchmarks/scripts/bench_allreduce.py --sweep times others): NOT YET TUNED on the H200s.
MAX_PROGRAMS = 64  # programs of one launch at most (under an H200's 132 SMs)
BLOCK = 2048  # elements per tile (4 KB of bf16: 16 bytes per thread at 8 warps)
NUM_WARPS = 8
SLOT_PROGRAMS = 128  # programs with signal slots: the most any launch may use
HEADER_WORDS = 2  # epoch, arrivals
SIGNAL_BYTES = 8 * (HEADER_WORDS + SLOT_PROGRAMS * MAX_WORLD)  # 8208: padded to ALIGN in the allocation
ALIGN = 4096
SELF_TEST_SPINS = 1 << 24  # polls of a flag before start-up's self-test gives up (seconds; a real call waits on)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def staging_offset() -> int:
    """Bytes from the start of a rank's allocation to its staging half 0 (after the signal area, aligned)."""
    return -(-SIGNAL_BYTES // ALIGN) * ALIGN


def allocation_bytes(capacity: int) -> int:
    """One rank's allocation: the signal area, then two staging halves of `capacity` bytes each."""
    return staging_offset() + 2 * capacity


@dataclass(frozen=True, eq=False)  # eq=False: compared and hashed by identity (it holds tensors)
class PeerBuffers:
    """The peer-visible buffers one rank's one-shot all-reduces run over (see the module docstring).

    `buffer_ptrs`, `signal_ptrs`: int64 [world] on this rank's device, every rank's staging half 0 and signal
    area as mapped here; `capacity`: bytes of one staging half; `max_bytes`: the largest all-reduce served here
    (<= capacity), NCCL above. Made by minidsa/parallel/allreduce.py, which owns (and frees) the memory.
    """

    rank: int
    world: int
    buffer_ptrs: torch.Tensor
    signal_ptrs: torch.Tensor
    capacity: int
    max_bytes: int

    def __post_init__(self):
        if not 1 <= self.world <= MAX_WORLD or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} of {self.world}: the one-shot all-reduce takes 1..{MAX_WORLD} ranks")
        if self.max_bytes > self.capacity:
            raise ValueError(f"max_bytes {self.max_bytes} > staging capacity {self.capacity}")


def serves(nbytes: int, dtype: torch.dtype, contiguous: bool, max_bytes: int) -> bool:
    """Whether the one-shot kernel serves an all-reduce of `nbytes` bytes of `dtype` (else NCCL): a pure function of
    the concrete size, called inside the op."""
    return 0 < nbytes <= max_bytes and dtype in DTYPES and contiguous


@dataclass(frozen=True)
class Launch:
    """How the kernel is launched: elements per tile, warps per program, programs at most (<= SLOT_PROGRAMS)."""

    block: int = BLOCK
    num_warps: int = NUM_WARPS
    max_programs: int = MAX_PROGRAMS

    def __post_init__(self):
        if not 1 <= self.max_programs <= SLOT_PROGRAMS or self.block & (self.block - 1):
            raise ValueError(f"{self}: max_programs in 1..{SLOT_PROGRAMS}, block a power of two")


DEFAULT_LAUNCH = Launch()


def grid_for(numel: int, launch: Launch = DEFAULT_LAUNCH) -> int:
    """Programs of one launch: one per tile, at most `max_programs` (the same on every rank for the same size)."""
    return max(1, min(launch.max_programs, -(-numel // launch.block)))


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, out_ptr, buffer_ptrs, signal_ptrs, n, rank, half_elems, max_spins,
                                WORLD: tl.constexpr, SLOTS: tl.constexpr, HEADER: tl.constexpr,
                                BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    own_signals = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int64))
    # The epoch: written by the previous launch's last program; an atomic read goes to L2 (no stale L1 line).
    epoch = tl.atomic_add(own_signals, 0, sem="relaxed", scope="gpu") + 1
    half = (epoch % 2) * half_elems
    # (16-byte aligned: cudaMalloc'd bases, a 4 KB signal area, halves of a multiple of 4 KB; the hint lets
    # Triton vectorise the accesses through these pointers, which it cannot see the origin of)
    own_staging = tl.multiple_of(tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype)) + half, 16)
    offs = tl.arange(0, BLOCK)
    # 1. this program's share of x into this rank's staging half
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        idx = start + offs
        mask = idx < n
        tl.store(own_staging + idx, tl.load(x_ptr + idx, mask=mask), mask=mask)
    tl.debug_barrier()
    # 2. announce it to every rank (itself too), after every thread's stores (release, system scope)
    for r in tl.static_range(WORLD):
        peer_signals = tl.load(signal_ptrs + r).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(peer_signals + HEADER + pid * SLOTS + rank, epoch, sem="release", scope="sys")
    # 3. wait until every rank's program pid has announced epoch (or a later one); max_spins > 0 (start-up's
    #    self-test only) gives up after that many polls per rank, and the sums are then wrong
    for r in tl.static_range(WORLD):
        slot = own_signals + HEADER + pid * SLOTS + r
        spins = 0
        while (tl.atomic_add(slot, 0, sem="acquire", scope="sys") < epoch) & ((max_spins == 0) | (spins < max_spins)):
            spins += 1
    tl.debug_barrier()
    # 4. the sum over ranks in rank order, fp32, from every rank's staging half (.cg: past L1, from the owner)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        idx = start + offs
        mask = idx < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            staging = tl.multiple_of(tl.load(buffer_ptrs + r).to(tl.pointer_type(dtype)) + half, 16)
            acc += tl.load(staging + idx, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + idx, acc.to(dtype), mask=mask)
    # 5. the last program of this launch to finish advances the epoch for the next launch
    if tl.atomic_add(own_signals + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(own_signals + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(own_signals, epoch, sem="release", scope="gpu")


def one_shot_all_reduce(x: torch.Tensor, buffer_ptrs: torch.Tensor, signal_ptrs: torch.Tensor, rank: int,
                        world: int, capacity: int, out: torch.Tensor | None = None,
                        launch: Launch = DEFAULT_LAUNCH, max_spins: int = 0) -> torch.Tensor:
    """Sum of x over the ranks whose buffers `buffer_ptrs` / `signal_ptrs` hold (PeerBuffers), every rank calling
    it with the same size: x contiguous, of a dtype in DTYPES, at most `capacity` bytes. `max_spins` 0: wait for the
    peers as long as they take (a collective); > 0: give up after that many polls of a flag (wrong sums: for a
    self-test that must not hang)."""
    if not x.is_contiguous() or x.dtype not in DTYPES:
        raise ValueError(f"one-shot all-reduce takes a contiguous tensor of {DTYPES}, got {x.dtype} "
                         f"{'contiguous' if x.is_contiguous() else 'strided'}")
    nbytes = x.numel() * x.element_size()
    if nbytes > capacity:
        raise ValueError(f"one-shot all-reduce of {nbytes} bytes > staging capacity {capacity}")
    out = torch.empty_like(x) if out is None else out
    n = x.numel()
    if n == 0:
        return out
    _one_shot_all_reduce_kernel[(grid_for(n, launch),)](
        x, out, buffer_ptrs, signal_ptrs, n, rank, capacity // x.element_size(), max_spins,
        WORLD=world, SLOTS=MAX_WORLD, HEADER=HEADER_WORDS, BLOCK=launch.block, num_warps=launch.num_warps,
        **pdl_launch(x.device))
    return out


def compile_only(x: torch.Tensor, buffers: PeerBuffers) -> None:
    """Compile the kernel for x's dtype and this rank without launching it (Triton's warm-up; nothing to compile
    under the interpreter)."""
    warmup = getattr(_one_shot_all_reduce_kernel, "warmup", None)
    if warmup is None:
        return
    n = x.numel()
    warmup(x, torch.empty_like(x), buffers.buffer_ptrs, buffers.signal_ptrs, n, buffers.rank,
           buffers.capacity // x.element_size(), SELF_TEST_SPINS, WORLD=buffers.world, SLOTS=MAX_WORLD,
           HEADER=HEADER_WORDS, BLOCK=BLOCK, num_warps=NUM_WARPS, grid=(grid_for(n),), **pdl_launch(x.device))
