"""Which all-reduce serves (minidsa/parallel/allreduce.py, kernels/allreduce.py `serves`), on CPU, no GPU, no second
process: the size threshold, every reason the one-shot kernel is turned off (one reason for the whole group, so no
rank is left in a collective the others skipped), the rounds of start-up with a scripted peer, and the wiring (the
config flag, the rank group's TensorParallel on gloo).

What cannot run here: the CUDA IPC buffers and the kernel across two processes (tests/gpu/test_allreduce_gpu.py);
the kernel's own logic runs under Triton's interpreter in tests/test_allreduce_kernel.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from minidsa.kernels import allreduce as k
from minidsa.parallel import allreduce as par
from minidsa.parallel.allreduce import RankFacts

ROW = 7168 * 2  # one row of V3.2's hidden state in bf16


def test_serves_up_to_the_threshold():
    """The default threshold is 64 rows x 7168 bf16 (the largest decode batch) until the benchmark replaces it;
    above it, for other dtypes, empty or strided tensors, NCCL serves."""
    assert k.ONE_SHOT_MAX_BYTES == 64 * ROW
    top = k.ONE_SHOT_MAX_BYTES
    for rows in (1, 2, 8, 64):
        assert k.serves(rows * ROW, torch.bfloat16, True, top)
    assert not k.serves(65 * ROW, torch.bfloat16, True, top)
    assert not k.serves(top + 1, torch.bfloat16, True, top)
    assert k.serves(top, torch.float32, True, top) and k.serves(16, torch.float16, True, top)
    assert not k.serves(0, torch.bfloat16, True, top)
    assert not k.serves(16, torch.int32, True, top)
    assert not k.serves(16, torch.bfloat16, False, top)


def test_grid_is_a_function_of_the_size():
    assert k.grid_for(1) == 1
    assert k.grid_for(7168) == 4
    assert k.grid_for(64 * 7168) == k.MAX_PROGRAMS <= k.SLOT_PROGRAMS
    assert k.MAX_PROGRAMS < 132  # under an H200's SMs (a program waits for its peers to run)
    assert k.grid_for(64 * 7168, k.Launch(block=1024, num_warps=4, max_programs=128)) == 128
    with pytest.raises(ValueError):
        k.Launch(max_programs=k.SLOT_PROGRAMS + 1)
    with pytest.raises(ValueError):
        k.Launch(block=3000)


def test_buffers_layout_and_checks():
    assert k.staging_offset() >= k.SIGNAL_BYTES and k.staging_offset() % k.ALIGN == 0
    assert k.allocation_bytes(4096) == k.staging_offset() + 8192
    ptrs = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="max_bytes"):
        k.PeerBuffers(rank=0, world=2, buffer_ptrs=ptrs, signal_ptrs=ptrs, capacity=4096, max_bytes=8192)
    with pytest.raises(ValueError, match="ranks"):
        k.PeerBuffers(rank=0, world=k.MAX_WORLD + 1, buffer_ptrs=ptrs, signal_ptrs=ptrs, capacity=4096, max_bytes=1)
    a = k.PeerBuffers(rank=0, world=2, buffer_ptrs=ptrs, signal_ptrs=ptrs, capacity=4096, max_bytes=4096)
    assert a == a and a != k.PeerBuffers(rank=0, world=2, buffer_ptrs=ptrs, signal_ptrs=ptrs, capacity=4096,
                                         max_bytes=4096)  # by identity: never compares the tensors
    hash(a)


@pytest.mark.parametrize("world,device,enabled,reason", [
    (2, "cuda:0", False, "turned off"),
    (1, "cuda:0", True, "a group of one rank"),
    (k.MAX_WORLD + 1, "cuda:0", True, "at most"),
    (2, "cpu", True, "not on CUDA"),
    (2, "cuda:1", True, None),
    (k.MAX_WORLD, "cuda:0", True, None),
])
def test_uniform_reasons(world, device, enabled, reason):
    why = par.uniform_reason(world, torch.device(device), enabled)
    assert (why is None) if reason is None else (reason in why)


def _facts(n, **over):
    facts = [RankFacts(None, "host", f"GPU-{r}") for r in range(n)]
    for r, f in over.items():
        facts[int(r[1:])] = f
    return facts


def test_group_reason_is_the_same_for_every_rank():
    assert par.group_reason(_facts(4)) is None
    assert par.group_reason(_facts(2, r1=RankFacts("import triton failed: x", "host", "GPU-1"))) == \
        "rank 1: import triton failed: x"
    assert par.group_reason(_facts(2, r0=RankFacts("no triton", "host", "GPU-0"))) == "no triton"
    assert "2 hosts" in par.group_reason(_facts(2, r1=RankFacts(None, "other", "GPU-1")))
    assert "share a GPU" in par.group_reason(_facts(2, r1=RankFacts(None, "host", "GPU-0")))
    assert "UUID" in par.group_reason(_facts(2, r1=RankFacts(None, "host", None)))


def test_peer_reason():
    local = {"GPU-0": 0, "GPU-1": 1, "GPU-2": 2}
    every = ["GPU-0", "GPU-1", "GPU-2"]
    assert par.peer_reason(0, every, local, lambda a, b: True) is None
    assert "cannot access cuda:2" in par.peer_reason(0, every, local, lambda a, b: b != 2)
    assert "not visible" in par.peer_reason(0, every + ["GPU-9"], local, lambda a, b: True)
    assert par.first_reason([None, "x", "y"]) == "rank 1: x" and par.first_reason([None, None]) is None


def _no_round(obj):
    raise AssertionError("a reason every rank shares needs no round")


@pytest.mark.parametrize("world,device,enabled", [(2, "cpu", True), (2, "cuda:0", False), (1, "cuda:0", True),
                                                  (16, "cuda:0", True)])
def test_start_decides_at_once_where_every_rank_agrees(world, device, enabled):
    """gloo on CPU, turned off, one rank, too many ranks: NCCL (or gloo) serves, decided with no round."""
    got = par.start_peer_all_reduce(0, world, torch.device(device), _no_round, enabled, log=False)
    assert got.buffers is None and got.why
    assert got.describe().startswith("All-reduce: the process group's (NCCL on GPUs) serves every size (")
    got.close()  # nothing to release


class ScriptedPeer:
    """`gather` for rank 0 of 2: rank 1's answer to each round comes from `answers` (one per round, in order)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.rounds = []

    def __call__(self, obj):
        self.rounds.append(obj)
        return [obj, self.answers.pop(0)]


@pytest.fixture
def two_fake_gpus(monkeypatch):
    """This process sees two 'GPUs' (by UUID) that Triton could use; no CUDA call is made until the allocation."""
    monkeypatch.setattr(par, "_triton_reason", lambda: None)
    monkeypatch.setattr(par, "_device_uuid", lambda i: f"GPU-{i}")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_start_falls_back_when_a_peer_has_no_triton(two_fake_gpus):
    peer = ScriptedPeer(RankFacts("import triton failed: gone", par.socket.gethostname(), "GPU-1"))
    got = par.start_peer_all_reduce(0, 2, torch.device("cuda:0"), peer, log=False)
    assert got.buffers is None and got.why == "rank 1: import triton failed: gone"
    assert len(peer.rounds) == 1  # every rank stops after the same round


def test_start_falls_back_without_peer_access(two_fake_gpus, monkeypatch):
    host = par.socket.gethostname()
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    peer = ScriptedPeer(RankFacts(None, host, "GPU-1"), None)
    got = par.start_peer_all_reduce(0, 2, torch.device("cuda:0"), peer, log=False)
    assert got.buffers is None and got.why == "rank 0: cuda:0 cannot access cuda:1 peer to peer"
    assert len(peer.rounds) == 2 and peer.rounds[1] == got.why.removeprefix("rank 0: ")


def test_start_falls_back_when_a_buffer_cannot_be_shared(two_fake_gpus, monkeypatch):
    """A rank whose allocation (or IPC handle) fails says so in the allocation round; every rank then releases what
    it made and the group's all-reduce serves."""
    host = par.socket.gethostname()
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)

    class NoRuntime:
        def __init__(self):
            raise OSError("libcudart.so: cannot open shared object file")

    monkeypatch.setattr(par, "CudaRuntime", NoRuntime)
    peer = ScriptedPeer(RankFacts(None, host, "GPU-1"), None, (None, b"h" * 64))
    got = par.start_peer_all_reduce(0, 2, torch.device("cuda:0"), peer, log=False)
    assert got.buffers is None and got.why.startswith("rank 0: OSError: libcudart.so")
    assert len(peer.rounds) == 3


def test_start_falls_back_when_a_peer_cannot_map_the_buffers(two_fake_gpus, monkeypatch):
    host = par.socket.gethostname()
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    calls = []

    class FakeRuntime:
        def set_device(self, i):
            calls.append(("set_device", i))

        def malloc(self, n):
            calls.append(("malloc", n))
            return 1 << 20

        def memset(self, p, v, n):
            calls.append(("memset", v, n))

        def synchronize(self):
            calls.append(("synchronize",))

        def ipc_handle(self, p):
            return b"\0" * 64

        def open_ipc_handle(self, h):
            calls.append(("open", h))
            return 2 << 20

        def close_ipc_handle(self, p):
            calls.append(("close", p))

        def free(self, p):
            calls.append(("free", p))

    monkeypatch.setattr(par, "CudaRuntime", FakeRuntime)
    peer = ScriptedPeer(RankFacts(None, host, "GPU-1"), None, (None, b"p" * 64), "cudaIpcOpenMemHandle failed: x")
    got = par.start_peer_all_reduce(0, 2, torch.device("cuda:0"), peer, log=False)
    assert got.buffers is None and got.why == "rank 1: cudaIpcOpenMemHandle failed: x"
    size = k.allocation_bytes(k.ONE_SHOT_MAX_BYTES)
    # zeroed, and the zeroes landed, before the handle left this rank; released after the failure
    assert calls == [("set_device", 0), ("malloc", size), ("memset", 0, size), ("synchronize",), ("open", b"p" * 64),
                     ("synchronize",), ("close", 2 << 20), ("free", 1 << 20)]


def test_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="minidsa.parallel.allreduce"):
        par.start_peer_all_reduce(0, 2, torch.device("cpu"), _no_round)
    lines = [r for r in caplog.records if r.name == "minidsa.parallel.allreduce"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "serves every size (not on CUDA" in lines[0].message


def test_the_flag_and_the_compile_cache_key():
    from minidsa import cli
    from minidsa.config import EngineConfig
    from minidsa.exec.compile_cache import GRAPH_ARGS

    assert EngineConfig().enable_custom_all_reduce is False  # opt-in until measured on GPUs
    assert "enable_custom_all_reduce" in GRAPH_ARGS  # the compiled layers hold a different op
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--enable-custom-all-reduce"])
    assert cli.engine_config_from_args(args).enable_custom_all_reduce is True


def test_a_gloo_group_keeps_the_group_all_reduce():
    """CPU (gloo), the distributed path at one rank: TensorParallel has no peer buffers, the rank group says why."""
    from minidsa.parallel.launch import single_rank_group

    ranks = single_rank_group("cpu")
    try:
        assert ranks.tp.peer is None and ranks.all_reduce is not None and ranks.all_reduce.buffers is None
        x = torch.randn(3, 8)
        assert torch.equal(ranks.tp.all_reduce(x), x)
    finally:
        ranks.shutdown()
