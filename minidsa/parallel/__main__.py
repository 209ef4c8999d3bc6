"""A tensor-parallel rank > 0: `python -m minidsa.parallel` (started by rank 0, spec on stdin).

It builds its worker (its shard of the model, the caches, sampler and speculator) and launches each of rank
0's step plans until told to stop (`ranks.run_rank`). Its stdin stays open as a lifeline: EOF (rank 0
exited, was killed, or stopped the group) ends the process at once.

Either way out the rank leaves with `os._exit`, so nothing at interpreter exit may wait on NCCL or on a peer that
is gone. On StopPlan (rank 0 closing the engine) it first destroys its CUDA graphs and aborts its process groups
(`RankGroup.shutdown`: NCCL aborts a communicator only once the graphs that captured it are gone), bounded. On EOF
without StopPlan (rank 0 died, or stopped the group after a failed step) the main thread may still be inside a
step: the lifeline aborts the groups, bounded, and exits without touching the graphs the step may be replaying.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback

logger = logging.getLogger("minidsa.parallel")


_leaving = threading.Event()  # set once this rank is on its way out: errors from its aborted groups are expected
_stopped = threading.Event()  # the main thread received StopPlan: it leaves the groups itself
_leave_once = threading.Lock()


def _leave(code: int, ranks=None) -> None:
    """Leave this rank's process groups (bounded) and exit, whatever the other thread is doing. `ranks`: the main
    thread's group after StopPlan, whose device state (CUDA graphs) can go first; None from the lifeline."""
    _leaving.set()
    with _leave_once:  # the first thread out leaves; the other waits here for its os._exit
        from minidsa.parallel.launch import leave_groups

        if ranks is not None:
            ranks.shutdown()
        else:
            leave_groups()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_when_rank0_goes(stream) -> None:
    def watch() -> None:
        stream.read()  # returns at EOF only: rank 0 closed the pipe or is gone
        if _stopped.wait(1.0):  # rank 0 sent StopPlan before closing the pipe: the main thread is leaving
            threading.Event().wait()
        _leave(0)

    threading.Thread(target=watch, name="minidsa-rank0-lifeline", daemon=True).start()


def _configure_logging(rank: int, level: int) -> None:
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")


def main() -> int:
    from minidsa.parallel.launch import ignore_interrupts, join_ranks, read_spec
    from minidsa.parallel.ranks import run_rank

    ignore_interrupts()
    spec = read_spec(sys.stdin.buffer)
    _configure_logging(spec.rank, spec.log_level)
    _exit_when_rank0_goes(sys.stdin.buffer)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))  # CPU ranks share the cores
    try:
        ranks = join_ranks(spec)
        if spec.resolved.args.enable_dp_attention:
            from minidsa.parallel.dp_attention import run_dp_rank

            run_dp_rank(ranks, spec.resolved, spec.kernels)
        else:
            run_rank(ranks, spec.resolved, spec.kernels)
        _stopped.set()
    except BaseException:
        if _leaving.wait(0.5):  # rank 0 stopped the group and the lifeline is aborting it: not a failure
            threading.Event().wait()  # the lifeline exits the process
        print(f"[rank {spec.rank}] tensor-parallel rank {spec.rank} failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        os._exit(1)  # no teardown that could wait on the peers
    _leave(0, ranks)  # StopPlan
    return 0


if __name__ == "__main__":
    sys.exit(main())
