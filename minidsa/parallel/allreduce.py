"""Start-up of the one-shot peer-to-peer all-reduce (kernels/allreduce.py): whether it serves, and its buffers.

Decided once per rank group, while the process groups are made (launch.py `_init_groups`), the same way on every
rank, and said in one INFO line. The kernel serves the small all-reduces (up to `ONE_SHOT_MAX_BYTES`, from
benchmarks/scripts/bench_allreduce.py) only where every condition holds, on every rank:

- it is on (`EngineConfig.enable_custom_all_reduce`, `--enable-custom-all-reduce`: off by default until measured);
- the group has 2..MAX_WORLD ranks on CUDA devices of one host, and Triton runs;
- every rank's GPU can access every other rank's (`torch.cuda.can_device_access_peer`, devices matched by UUID);
- each rank's buffer is allocated and shared (CUDA IPC: `cudaIpcGetMemHandle` / `cudaIpcOpenMemHandle` through the
  CUDA runtime torch loaded, as vLLM and SGLang do; no multicast object is ever made);
- a self-test of the kernel on every rank gives the exact sums.

Otherwise the process group's all-reduce serves every size (NCCL; gloo on CPU): the model sees `peer` None.
Every round below is one `all_gather_object` on the control group (gloo) that every rank joins whatever it found,
so the ranks agree and no collective is left unmatched; a failure on one rank turns the kernel off on all.

The memory (under 2 MB a rank) is never freed while the process lives: a rank's CUDA graphs hold its addresses, and
freeing it (an implicit device synchronisation) could wait forever on a peer that died mid-step; `close` is for
tests and benchmarks that own every rank.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from minidsa.kernels import allreduce as kernel
from minidsa.kernels import custom_ops  # noqa: F401 - registers minidsa::all_reduce (TensorParallel calls it)

logger = logging.getLogger(__name__)

Gather = Callable[[Any], list]  # every rank's object, in rank order (all_gather_object on the control group)


# -- the decision (pure functions: tests/test_allreduce.py) ---------------------------------------------------------

@dataclass(frozen=True)
class RankFacts:
    """What each rank tells the others in the first round."""

    why_not: str | None  # this rank's own reason the kernel cannot serve, None if it can
    host: str
    device_uuid: str | None


def uniform_reason(world: int, device: torch.device, enabled: bool) -> str | None:
    """Why the kernel cannot serve, from what every rank of the group has alike (the engine's settings, the device
    type, the group's size): decided without a round. None: ask the group."""
    if world < 2:
        return "a group of one rank"
    if not enabled:
        return "turned off (enable_custom_all_reduce=False)"
    if world > kernel.MAX_WORLD:
        return f"{world} ranks (the kernel takes at most {kernel.MAX_WORLD})"
    if device.type != "cuda":
        return f"not on CUDA ({device})"
    return None


def group_reason(facts: list[RankFacts]) -> str | None:
    """Why the group cannot use the kernel (None: it can), the same on every rank from the gathered facts."""
    for r, f in enumerate(facts):
        if f.why_not is not None:
            return f.why_not if r == 0 else f"rank {r}: {f.why_not}"
    hosts = {f.host for f in facts}
    if len(hosts) > 1:
        return f"the ranks are on {len(hosts)} hosts"
    if any(f.device_uuid is None for f in facts):
        return "a rank's device has no UUID to match"
    if len({f.device_uuid for f in facts}) < len(facts):
        return "two ranks share a GPU"
    return None


def peer_reason(own: int, peer_uuids: list[str], local_uuids: dict[str, int],
                can_access: Callable[[int, int], bool]) -> str | None:
    """Why this rank's GPU (local index `own`) cannot access a peer's (None: it can access all). `local_uuids`: the
    UUID of every GPU this process sees -> its index here."""
    for uuid in peer_uuids:
        index = local_uuids.get(uuid)
        if index is None:
            return f"GPU {uuid} is not visible to this rank (CUDA_VISIBLE_DEVICES)"
        if index != own and not can_access(own, index):
            return f"cuda:{own} cannot access cuda:{index} peer to peer"
    return None


def first_reason(reasons: list[str | None]) -> str | None:
    for r, why in enumerate(reasons):
        if why is not None:
            return f"rank {r}: {why}"
    return None


# -- the CUDA runtime, through ctypes (the same library torch loaded) -----------------------------------------------

class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * 64)]  # cudaIpcMemHandle_t


def _cudart_path() -> str:
    """The CUDA runtime library this process has loaded (torch's), else the system's by name."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    version = (torch.version.cuda or "").split(".")[0]
    return f"libcudart.so.{version}" if version else "libcudart.so"


class CudaRuntime:
    """The few CUDA runtime calls the buffers need (cudaMalloc, cudaMemset, IPC handles)."""

    IPC_LAZY_ENABLE_PEER_ACCESS = 1

    def __init__(self, path: str | None = None):
        self.lib = ctypes.CDLL(path or _cudart_path())
        lib = self.lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        for name, args in (("cudaSetDevice", [ctypes.c_int]),
                           ("cudaMalloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
                           ("cudaFree", [ctypes.c_void_p]),
                           ("cudaMemset", [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]),
                           ("cudaDeviceSynchronize", []),
                           ("cudaIpcGetMemHandle", [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]),
                           ("cudaIpcOpenMemHandle", [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]),
                           ("cudaIpcCloseMemHandle", [ctypes.c_void_p])):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = args

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: {self.lib.cudaGetErrorString(code).decode()} ({code})")

    def set_device(self, index: int) -> None:
        self._check(self.lib.cudaSetDevice(index), "cudaSetDevice")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._check(self.lib.cudaMemset(ctypes.c_void_p(ptr), value, nbytes), "cudaMemset")

    def synchronize(self) -> None:
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def ipc_handle(self, ptr: int) -> bytes:
        handle = _IpcHandle()
        self._check(self.lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return bytes(handle)

    def open_ipc_handle(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), _IpcHandle.from_buffer_copy(handle),
                                                  self.IPC_LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
        return ptr.value

    def close_ipc_handle(self, ptr: int) -> None:
        self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


# -- start-up -------------------------------------------------------------------------------------------------------

@dataclass
class PeerAllReduce:
    """What start-up decided: `buffers` (the model's `TensorParallel.peer`) where the kernel serves, else None and
    `why` says why NCCL serves every size. Owns the memory (see the module docstring for why it is not freed)."""

    buffers: kernel.PeerBuffers | None
    why: str
    _runtime: CudaRuntime | None = None
    _own: int | None = None  # this rank's allocation
    _opened: list[int] = field(default_factory=list)  # the peers' allocations mapped here

    def describe(self) -> str:
        if self.buffers is None:
            return f"All-reduce: the process group's (NCCL on GPUs) serves every size ({self.why})"
        return (f"All-reduce: one-shot peer-to-peer kernel (CUDA IPC, {self.buffers.world} ranks) up to "
                f"{self.buffers.max_bytes} bytes, NCCL above ({self.why})")

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's: only once no rank runs an all-reduce on them any more."""
        rt, self.buffers = self._runtime, None
        if rt is None:
            return
        rt.synchronize()
        for ptr in self._opened:
            rt.close_ipc_handle(ptr)
        if self._own is not None:
            rt.free(self._own)
        self._opened, self._own, self._runtime = [], None, None


def _triton_reason() -> str | None:
    from minidsa.kernels.triton_compat import MISSING

    return MISSING


def _device_uuid(index: int) -> str | None:
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


def start_peer_all_reduce(rank: int, world: int, device: torch.device, gather: Gather, enabled: bool = True,
                          max_bytes: int = kernel.ONE_SHOT_MAX_BYTES, log: bool = True) -> PeerAllReduce:
    """Decide, allocate, share and self-test on every rank of the group (each call of `gather` is one round every
    rank joins); logs one INFO line (`log`)."""
    result = _start(rank, world, torch.device(device), gather, enabled, max_bytes)
    if log:
        logger.info("%s", result.describe())
    return result


def _start(rank: int, world: int, device: torch.device, gather: Gather, enabled: bool,
           max_bytes: int) -> PeerAllReduce:
    why = uniform_reason(world, device, enabled)
    if why is not None:
        return PeerAllReduce(None, why)
    # round 1: this rank's Triton, host and GPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    facts = RankFacts(_triton_reason(), socket.gethostname(), _device_uuid(index))
    every = gather(facts)
    why = group_reason(every)
    if why is not None:
        return PeerAllReduce(None, why)
    # round 2: every GPU reaches every other
    uuids = [f.device_uuid for f in every]
    local = {_device_uuid(i): i for i in range(torch.cuda.device_count())}
    why = first_reason(gather(peer_reason(index, uuids, local, torch.cuda.can_device_access_peer)))
    if why is not None:
        return PeerAllReduce(None, why)
    # round 3: this rank's buffer, zeroed (and the zeroes landed) before any peer can map it
    capacity = -(-max_bytes // kernel.ALIGN) * kernel.ALIGN
    made = PeerAllReduce(None, "")
    handle, failed = None, None
    try:
        rt = made._runtime = CudaRuntime()
        rt.set_device(index)
        made._own = rt.malloc(kernel.allocation_bytes(capacity))
        rt.memset(made._own, 0, kernel.allocation_bytes(capacity))
        rt.synchronize()
        handle = rt.ipc_handle(made._own)
    except Exception as e:  # noqa: BLE001 - reported to every rank, then NCCL serves
        failed = f"{type(e).__name__}: {e}"
    shared = gather((failed, handle))
    why = first_reason([f for f, _ in shared])
    # round 4: map every peer's buffer
    ptrs, failed = [], None
    if why is None:
        try:
            for r, (_, h) in enumerate(shared):
                ptrs.append(made._own if r == rank else made._runtime.open_ipc_handle(h))
                if r != rank:
                    made._opened.append(ptrs[-1])
        except Exception as e:  # noqa: BLE001
            failed = f"{type(e).__name__}: {e}"
        why = first_reason(gather(failed))
    if why is not None:
        _release(made)
        return PeerAllReduce(None, why)
    offset = kernel.staging_offset()
    made.buffers = kernel.PeerBuffers(
        rank=rank, world=world, buffer_ptrs=torch.tensor([p + offset for p in ptrs], dtype=torch.int64, device=device),
        signal_ptrs=torch.tensor(ptrs, dtype=torch.int64, device=device), capacity=capacity, max_bytes=max_bytes)
    # round 5: the kernel compiles on every rank before any launches it (a rank that launched would wait forever
    # for one that could not); round 6: exact sums
    why = first_reason(gather(_compile_reason(made.buffers, device)))
    if why is None:
        why = first_reason(gather(_self_test_reason(made.buffers, device)))
    if why is not None:
        _release(made)
        return PeerAllReduce(None, f"self-test: {why}")
    made.why = "every GPU reaches every other peer to peer, self-test exact"
    return made


def _release(made: PeerAllReduce) -> None:
    try:
        made.close()
    except Exception as e:  # noqa: BLE001 - NCCL serves anyway
        logger.warning("releasing the one-shot all-reduce's buffers: %s", e)


def _self_test_input(rank: int, rows: int, device: torch.device) -> torch.Tensor:
    """Small integers (exact in bf16, and their sums too): row i, column j of rank r = (r + 1) * ((i + j) % 7 + 1)."""
    i = torch.arange(rows, device=device).unsqueeze(1) + torch.arange(7168, device=device)
    return ((rank + 1) * (i % 7 + 1)).to(torch.bfloat16)


def _compile_reason(buffers: kernel.PeerBuffers, device: torch.device) -> str | None:
    x = _self_test_input(buffers.rank, 1, device)
    try:
        kernel.compile_only(x, buffers)
    except Exception as e:  # noqa: BLE001
        return f"the kernel did not compile: {type(e).__name__}: {e}"
    return None


def _self_test_reason(buffers: kernel.PeerBuffers, device: torch.device) -> str | None:
    """Three all-reduces (1, 5, 1 rows: both staging halves, two grids) against their exact sums. All three are
    launched before any is checked: every rank issues the same launches (a peer waits for each one)."""
    total = buffers.world * (buffers.world + 1) // 2
    try:
        # bounded waits: a peer whose kernel never comes makes wrong sums here, not a start-up that hangs
        got = {rows: kernel.one_shot_all_reduce(_self_test_input(buffers.rank, rows, device), buffers.buffer_ptrs,
                                                buffers.signal_ptrs, buffers.rank, buffers.world, buffers.capacity,
                                                max_spins=kernel.SELF_TEST_SPINS)
               for rows in (1, 5)}
        again = kernel.one_shot_all_reduce(_self_test_input(buffers.rank, 1, device), buffers.buffer_ptrs,
                                           buffers.signal_ptrs, buffers.rank, buffers.world, buffers.capacity,
                                           max_spins=kernel.SELF_TEST_SPINS)
        torch.cuda.synchronize(device)
        for rows, out in (*got.items(), (1, again)):
            want = _self_test_input(0, rows, device).float() * total
            if not torch.equal(out.float(), want):
                return f"wrong sums at {rows} rows (max error {(out.float() - want).abs().max().item()})"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def gather_on(group: Any, world: int) -> Gather:
    """`gather` over a process group (the control group, gloo)."""
    import torch.distributed as dist

    def gather(obj: Any) -> list:
        out: list = [None] * world
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather
