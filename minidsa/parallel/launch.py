"""One process per tensor-parallel rank, started by minidsa itself; process groups; a watch on every rank.

Rank 0 is the process that builds the engine (a script, a notebook, `minidsa serve`). It starts ranks
1..N-1 as `python -m minidsa.parallel` children (no torchrun needed; a script run under torchrun
joins the group torchrun made instead, see `launch_mode`), hands each its `WorkerSpec` on stdin, and keeps
the pipe open: a child reads its stdin until EOF, so when rank 0 goes away, however it dies, its children exit
too (a notebook kernel restart included). Children ignore SIGINT and SIGTERM: a Ctrl-C or a `kill` of the
whole process group reaches rank 0, which drains (the server) and then stops them.

Rendezvous is a TCPStore that rank 0 owns: rank 0 waits for every child to check in while watching that none
has exited, so a rank that fails to start is reported by number at once, not after a timeout. Two groups:
the device group (NCCL on CUDA, gloo on CPU) for the forward's collectives, and a gloo
control group for the step plans (a peer that dies closes its sockets: gloo raises at once on the others).

`RankProcesses` watches the children from a thread. When one exits unexpectedly it records which, aborts the
device group (an NCCL collective waiting for a dead peer would otherwise hang until its timeout), and the next
or current collective on rank 0 raises `RankFailedError` naming the rank. Should rank 0 stay stuck inside a
step regardless, the watch ends the process after `STUCK_EXIT_S` rather than leave it hanging.

Leaving (`RankGroup.shutdown`, `leave_groups`): every rank aborts its process groups instead of destroying them.
`destroy_process_group` flushes and destroys the NCCL communicators (ncclCommFinalize / ncclCommDestroy), which
waits on the peers: with a peer gone, or one that disagrees about what is in flight, it never returns. Rank 0
sends StopPlan, then closes its children's stdin and aborts its own groups at the same time as they abort theirs
and exit. Before aborting, every rank destroys its CUDA graphs (`RankGroup.before_leaving`): NCCL (2.26 on) aborts
a communicator only once every graph that captured one of its collectives is gone, and polls until then (seen on
two H200s: with the graphs alive, neither rank's abort returned). Every wait on the way out is still bounded
(`TEARDOWN_S`): a teardown that does not return in time is left behind in a daemon thread, a child that does not
exit is killed, and a process that is ending anyway (`minidsa` commands, ranks > 0) exits with `os._exit`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from minidsa.common.tensor_parallel import TensorParallel
from minidsa.parallel.allreduce import PeerAllReduce, gather_on, start_peer_all_reduce

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("MINIDSA_DIST_STARTUP_TIMEOUT", "600"))  # every rank checked in by then
COLLECTIVE_TIMEOUT_S = float(os.environ.get("MINIDSA_DIST_TIMEOUT", "600"))  # a device-group collective
IDLE_FOREVER = datetime.timedelta(days=365)  # workers wait this long for the next plan (an idle server)
STUCK_EXIT_S = 30.0  # a rank died while rank 0 is inside a step that does not return: exit after this
TEARDOWN_S = 3.0  # each bounded wait on the way out: children leaving, then this process's groups aborting
EXIT_MARGIN_S = 3.0  # a stopped child past its own TEARDOWN_S: time for its os._exit (a CUDA context to free)
_JOIN_KEY = "minidsa/joined/{}"


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died, failed to start, or stopped answering; names the rank."""


@dataclass
class WorkerSpec:
    """Everything a rank > 0 needs to build its part of the engine (pickled to its stdin)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str  # device group: "nccl" or "gloo"
    resolved: Any  # the ResolvedConfig rank 0 made, `device` this rank's
    kernels: Any  # the KernelChoice rank 0 made: every rank serves each kernel the same way
    log_level: int = logging.WARNING
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RankGroup:
    """This process's view of the group: its TensorParallel, the two process groups, the children (rank 0)."""

    tp: TensorParallel
    device_group: Any  # dist.ProcessGroup
    control_group: Any  # dist.ProcessGroup (gloo)
    device: torch.device
    processes: "RankProcesses | None" = None  # rank 0 of a group minidsa started
    all_reduce: PeerAllReduce | None = None  # which all-reduce serves small sizes (tp.peer: its buffers)
    broken: str | None = None  # rank 0 failed inside a step: the ranks are out of step (see `guard`)
    # Run before the groups go: each destroys device state that holds a communicator (a rank's CUDA graphs; see
    # `release_device_state`). None may keep the engine alive (a dropped engine's finaliser runs them).
    before_leaving: list = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def world_size(self) -> int:
        return self.tp.size

    def check(self) -> None:
        if self.processes is not None:
            self.processes.check()
        if self.broken is not None:
            raise RankFailedError(self.broken)

    @contextlib.contextmanager
    def guard(self, step: bool = False) -> Iterator[None]:
        """Collectives inside: a failure caused by a dead rank is re-raised as RankFailedError naming it.

        `step`: rank 0 is running a step the other ranks were sent. Any error there leaves them behind (waiting in
        a collective rank 0 never joins, or a step ahead): the group is broken for good, and this and every later
        step raise RankFailedError saying so (a server then fails its requests and exits, an LLM says why)."""
        self.check()
        watch = self.processes
        if watch is not None:
            watch.state.in_step += 1
        try:
            yield
        except RankFailedError:
            raise
        except BaseException as e:  # gloo "connection closed", an aborted NCCL communicator, a timeout, a bug
            failure = watch.wait_for_failure(2.0) if watch is not None and isinstance(e, Exception) else None
            if failure is not None:
                watch.state.acknowledged.set()
                raise RankFailedError(failure) from e
            if not step or self.world_size == 1:
                raise
            self.broken = (f"tensor-parallel rank 0 failed inside a step ({type(e).__name__}: {e}); the ranks are "
                           "out of step and the engine cannot continue")
            if not isinstance(e, Exception):  # Ctrl-C: still an interrupt, the group broken all the same
                raise
            logger.error("%s", self.broken)  # the traceback travels with the error (`from e`), not in a log record
            raise RankFailedError(self.broken) from e
        finally:
            if watch is not None:
                watch.state.in_step -= 1

    def release_device_state(self) -> None:
        """Destroy what holds the NCCL communicators besides the groups, before they are aborted: CUDA graphs that
        captured a collective. NCCL (2.26 on) destroys or aborts a communicator only once every such graph is gone;
        it polls until then, so an abort with graphs alive never returned (two H200s: both ranks stuck the whole
        TEARDOWN_S, and rank 0's default group stayed registered)."""
        hooks, self.before_leaving = self.before_leaving, []
        for hook in hooks:
            _quietly(hook)

    def shutdown(self) -> None:
        """Release the device state that holds the communicators, then stop the children (EOF on their stdin) and
        leave the process groups, both at once and bounded: every rank of a node aborts its NCCL communicators at
        the same time, as NCCL asks (an abort may wait for its peers' to free memory they share)."""
        self.release_device_state()
        if self.processes is None:
            leave_groups()
            return
        self.processes.state.stopping = True  # the children's exits from now on are not failures
        leaving = threading.Thread(target=leave_groups, name="minidsa-leave", daemon=True)
        try:
            leaving.start()
        except RuntimeError:  # no new thread at interpreter shutdown (a finaliser): one after the other
            self.processes.stop()
            leave_groups()
            return
        self.processes.stop()
        leaving.join()  # leave_groups is bounded


_teardown_stuck = threading.Event()  # a bounded teardown did not return: see `teardown_stuck`


def bounded(fn: Any, timeout: float, what: str) -> bool:
    """Run `fn` in a daemon thread for at most `timeout` s: True if it returned (or raised) in time. A call still
    running is left behind (it holds no lock of ours), logged, and remembered (`teardown_stuck`)."""
    thread = threading.Thread(target=_quietly, args=(fn,), name="minidsa-teardown", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown": a finaliser at exit; run it here
        _quietly(fn)
        return True
    thread.join(timeout)
    if thread.is_alive():
        logger.error("%s did not finish within %.0f s; leaving it behind", what, timeout)
        _teardown_stuck.set()
        return False
    return True


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - leaving: a group already broken by a dead peer may complain
        logger.debug("teardown: %s: %s", type(e).__name__, e)


def leave_groups(timeout: float = TEARDOWN_S) -> None:
    """Abort every process group of this process (the NCCL communicators included), at most `timeout` s.

    Abort, not destroy: NCCL's graceful teardown waits for the peers and hangs when one has gone (see the module
    doc); the abort ends whatever is in flight, locally. Afterwards no group is registered, so another engine can
    start in this process."""
    if dist.is_initialized():
        bounded(lambda: dist.distributed_c10d._abort_process_group(), timeout,
                "aborting the torch.distributed process groups")


def teardown_stuck() -> bool:
    """Whether a bounded teardown of this process was left running: the process should end with `os._exit`
    (interpreter exit could wait on it)."""
    return _teardown_stuck.is_set()


@dataclass
class _WatchState:
    """What the watch thread and rank 0's main thread share (the thread holds this, not the RankProcesses, so
    dropping the engine lets the finaliser stop the children)."""

    failure: str | None = None
    failed: threading.Event = field(default_factory=threading.Event)
    acknowledged: threading.Event = field(default_factory=threading.Event)  # the main thread raised it
    in_step: int = 0  # > 0 while rank 0 is inside collectives (see STUCK_EXIT_S)
    on_failure: list = field(default_factory=list)  # run once by the watch thread (abort the device group)
    stopping: bool = False  # set before a deliberate stop: those exits are not failures


class RankProcesses:
    """Rank 0's children: a watch thread that names the first one to exit unexpectedly."""

    def __init__(self, procs: dict[int, subprocess.Popen]):
        self.procs = procs
        self.state = _WatchState()
        threading.Thread(target=_watch, args=(procs, self.state), name="minidsa-rank-watch", daemon=True).start()
        # Notebook or script: the children go when this object does, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_children, procs, TEARDOWN_S, self.state)

    @property
    def failure(self) -> str | None:
        return self.state.failure

    def wait_for_failure(self, timeout: float) -> str | None:
        self.state.failed.wait(timeout)
        return self.state.failure

    def check(self) -> None:
        if self.state.failure is not None:
            self.state.acknowledged.set()
            raise RankFailedError(self.state.failure)

    def stop(self, timeout: float = TEARDOWN_S) -> None:
        self._finalizer.detach()
        _stop_children(self.procs, timeout, self.state)


def _watch(procs: dict[int, subprocess.Popen], state: _WatchState) -> None:
    while not state.stopping:
        for rank, proc in procs.items():
            code = proc.poll()
            if code is None or state.stopping:
                continue
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            state.failure = (f"tensor-parallel rank {rank} (pid {proc.pid}) {how}; the engine cannot continue "
                             "(its own error, if any, is printed above)")
            logger.error("%s", state.failure)
            state.failed.set()
            for fn in state.on_failure:  # bounded: an abort waits for rank 0's CUDA graphs to go (see shutdown)
                bounded(fn, TEARDOWN_S, "aborting the device group after a rank failed")
            for other in procs.values():
                if other.poll() is None:
                    with contextlib.suppress(OSError):
                        other.kill()
            if not state.acknowledged.wait(STUCK_EXIT_S) and state.in_step > 0:
                logger.critical("%s; rank 0 is stuck in a collective: exiting", state.failure)
                os._exit(1)
            return
        time.sleep(0.05)


def _stop_children(procs: dict[int, subprocess.Popen], timeout: float = TEARDOWN_S,
                   state: _WatchState | None = None) -> None:
    """EOF to every child (each aborts its groups, bounded by `timeout` s itself, and exits), `timeout` s plus
    `EXIT_MARGIN_S` for them to go, then SIGKILL. The margin: a child whose abort used its whole bound still exits
    by itself (seen on two H200s: NCCL's abort ran the full 3 s and the child was killed just before its exit)."""
    if state is not None:
        state.stopping = True
    for proc in procs.values():
        with contextlib.suppress(OSError, ValueError):
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the child's stdin watch exits it
    deadline = time.monotonic() + timeout + EXIT_MARGIN_S
    for rank, proc in procs.items():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel rank %d (pid %d) did not exit within %.0f s of being stopped: killing it",
                           rank, proc.pid, timeout + EXIT_MARGIN_S)
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):  # a GPU process can take a moment to be reaped
                proc.wait(TEARDOWN_S)


def launch_mode(tensor_parallel_size: int) -> tuple[str, int, int]:
    """("spawn", 0, 0): this process is rank 0 and starts the others; ("torchrun", rank, local_rank): torchrun
    (or any launcher setting RANK / WORLD_SIZE / LOCAL_RANK) started every rank."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and "RANK" in os.environ and int(world) > 1:
        if int(world) != tensor_parallel_size:
            raise ValueError(f"WORLD_SIZE={world} (from the launcher) but tensor_parallel_size is "
                             f"{tensor_parallel_size}: they must match")
        return "torchrun", int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    return "spawn", 0, 0


def rank_device(base: str, local_rank: int) -> str:
    """Rank r serves on cuda:r (set CUDA_VISIBLE_DEVICES to choose the GPUs); CPU ranks share the CPU."""
    return f"cuda:{local_rank}" if torch.device(base).type == "cuda" else base


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _write_spec(proc: subprocess.Popen, spec: WorkerSpec) -> None:
    data = pickle.dumps(spec)
    proc.stdin.write(struct.pack("<Q", len(data)) + data)
    proc.stdin.flush()


def read_spec(stream) -> WorkerSpec:
    (length,) = struct.unpack("<Q", stream.read(8))
    return pickle.loads(stream.read(length))


def start_ranks(resolved: Any, kernels: Any) -> RankGroup:
    """Rank 0: start ranks 1..N-1 (or join torchrun's group) and initialise both process groups."""
    engine_config = resolved.args
    world = engine_config.tensor_parallel_size
    mode, rank, local_rank = launch_mode(world)
    device = rank_device(engine_config.device, local_rank)
    backend = _backend(device)
    if torch.device(device).type == "cuda":  # enough GPUs: checked by config.resolve, before anything started
        torch.cuda.set_device(torch.device(device))
    if mode == "torchrun":
        return _init_groups(rank, world, backend, device, None, None, engine_config.enable_expert_parallel,
                            engine_config.enable_custom_all_reduce, engine_config.enable_dp_attention)
    addr = "127.0.0.1"
    store = dist.TCPStore(addr, 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    procs: dict[int, subprocess.Popen] = {}
    watch = None
    try:
        for r in range(1, world):
            spec = WorkerSpec(rank=r, world_size=world, master_addr=addr, master_port=store.port, backend=backend,
                              resolved=resolved.on_device(rank_device(engine_config.device, r)), kernels=kernels,
                              log_level=logging.getLogger("minidsa").getEffectiveLevel())
            procs[r] = subprocess.Popen([sys.executable, "-m", "minidsa.parallel"], stdin=subprocess.PIPE,
                                        env=_child_env())
            with contextlib.suppress(BrokenPipeError):  # it exited at once: the watch below names it
                _write_spec(procs[r], spec)
        watch = RankProcesses(procs)
        _wait_for_check_in(store, watch, world)
        return _init_groups(0, world, backend, device, store, watch, engine_config.enable_expert_parallel,
                            engine_config.enable_custom_all_reduce, engine_config.enable_dp_attention)
    except BaseException:
        if watch is not None:
            watch.stop(timeout=2.0)
        else:
            _stop_children(procs, timeout=2.0)
        raise


def _child_env() -> dict[str, str]:
    """The children import the minidsa this process runs (a notebook's sys.path may differ from PYTHONPATH), with
    the rest of this process's environment (NCCL_NVLS_ENABLE=0 and the machine's other settings included)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above minidsa/
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _wait_for_check_in(store: Any, watch: RankProcesses, world: int) -> None:
    keys = [_JOIN_KEY.format(r) for r in range(1, world)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        if watch.failure is not None:
            watch.state.acknowledged.set()
            raise RankFailedError(watch.failure.replace("; the engine cannot continue", " while starting"))
        if time.monotonic() > deadline:
            late = [r for r in range(1, world) if not store.check([_JOIN_KEY.format(r)])]
            raise RankFailedError(f"tensor-parallel ranks {late} did not start within {STARTUP_TIMEOUT_S:.0f} s "
                                  "(MINIDSA_DIST_STARTUP_TIMEOUT)")
        time.sleep(0.02)


def join_ranks(spec: WorkerSpec) -> RankGroup:
    """Rank > 0 started by `start_ranks`: check in with rank 0's store and initialise both process groups."""
    if torch.device(spec.resolved.args.device).type == "cuda":
        torch.cuda.set_device(torch.device(spec.resolved.args.device))
    store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(_JOIN_KEY.format(spec.rank), "1")
    return _init_groups(spec.rank, spec.world_size, spec.backend, spec.resolved.args.device, store, None,
                        spec.resolved.args.enable_expert_parallel, spec.resolved.args.enable_custom_all_reduce,
                        spec.resolved.args.enable_dp_attention)


def _init_groups(rank: int, world: int, backend: str, device: str, store: Any, watch: RankProcesses | None,
                 expert_parallel: bool, custom_all_reduce: bool = False, dp_attention: bool = False) -> RankGroup:
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process: one distributed "
                           "minidsa engine per process at a time (close the other one first: LLM.close())")
    kwargs = dict(backend=backend, rank=rank, world_size=world,
                  timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    if store is not None:
        kwargs["store"] = store
    else:  # torchrun: env:// rendezvous
        kwargs["init_method"] = "env://"
    dist.init_process_group(**kwargs)
    device_group = dist.group.WORLD
    # Plans: gloo, and no timeout worth the name (an idle server sends none for hours); a dead peer still
    # raises at once (its sockets close), and rank 0's death also reaches the children through their stdin.
    control_group = dist.new_group(backend="gloo", timeout=IDLE_FOREVER)
    dev = torch.device(device)
    # The NCCL communicator is created by its first collective: here, not inside a CUDA-graph capture.
    probe = torch.ones(1, device=dev)
    dist.all_reduce(probe, group=device_group)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if watch is not None and backend == "nccl":
        watch.state.on_failure.append(lambda: dist.distributed_c10d._abort_process_group(device_group))
    # Small all-reduces: the one-shot peer-to-peer kernel where every rank can serve it (parallel/allreduce.py; on
    # CPU, with one rank or turned off it decides at once, without a round), else NCCL / gloo for every size.
    peer = start_peer_all_reduce(rank, world, dev, gather_on(control_group, world), custom_all_reduce,
                                 log=world > 1)
    # DP attention: routed experts whole per rank (expert parallel), every other layer whole on each rank
    tp = TensorParallel(rank=rank, size=world, group_name=device_group.group_name,
                        expert_parallel=expert_parallel or dp_attention, peer=peer.buffers, dp_attention=dp_attention)
    return RankGroup(tp=tp, device_group=device_group, control_group=control_group, device=dev, processes=watch,
                     all_reduce=peer)


def single_rank_group(device: str, expert_parallel: bool = False) -> RankGroup:
    """A group of one (tensor_parallel_size 1 through the distributed path): same layers, collectives and
    plan path as N ranks, no children. Its store is private to this process."""
    backend = _backend(device)
    if torch.device(device).index is not None:  # "cuda" alone: the current device
        torch.cuda.set_device(torch.device(device))
    store = dist.HashStore()
    return _init_groups(0, 1, backend, device, store, None, expert_parallel)


def ignore_interrupts() -> None:
    """Children: SIGINT / SIGTERM are for rank 0 (which drains and then stops them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
