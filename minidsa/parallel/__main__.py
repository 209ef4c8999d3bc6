"""A tensor-parallel rank > 0: `python -m minidsa.parallel` (started by rank 0, spec on stdin).

It builds its worker (its shard of the model, the caches, sampler and speculator) and launches each of rank
0's step plans until told to stop (`ranks.run_rank`). Its stdin stays open as a lifeline: EOF (rank 0
exited, was killed, or stopped the group) ends the process at once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback

logger = logging.getLogger("minidsa.parallel")


def _exit_when_rank0_goes(stream) -> None:
    def watch() -> None:
        stream.read()  # returns at EOF only: rank 0 closed the pipe or is gone
        os._exit(0)

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
    ranks = None
    try:
        ranks = join_ranks(spec)
        run_rank(ranks, spec.resolved, spec.kernels)
    except BaseException:
        print(f"[rank {spec.rank}] tensor-parallel rank {spec.rank} failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        os._exit(1)  # no teardown that could wait on the peers
    ranks.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
