"""`minidsa ARGS` (e.g. `serve --tp 2`) with a fault injected into rank 0, for tests/test_tensor_parallel.py's
serve_and_end. The faults are the test's, not the engine's: only this process's functions are wrapped.

- `FAIL_STEP_GATE`: once the file it names exists, rank 0's local part of each step raises
  ValueError("injected step failure") after the plan went to the other ranks, which then wait in a collective
  rank 0 never joins.
- `HANG_ABORT=1`: aborting the process groups never returns (as NCCL's teardown can), so the bounded teardown
  is left behind and the command must still end.
"""

from __future__ import annotations

import os
import sys
import threading

FAIL_STEP_GATE = "FAIL_STEP_GATE"
HANG_ABORT = "HANG_ABORT"


def main() -> None:
    import torch.distributed as dist

    from minidsa import cli
    from minidsa.exec.worker import Worker

    gate = os.environ.get(FAIL_STEP_GATE)
    if gate:
        launch = Worker.launch

        def failing_launch(self, plan):
            if os.path.exists(gate):
                raise ValueError("injected step failure")
            return launch(self, plan)

        Worker.launch = failing_launch
    if os.environ.get(HANG_ABORT) == "1":
        dist.distributed_c10d._abort_process_group = lambda group=None: threading.Event().wait()
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
