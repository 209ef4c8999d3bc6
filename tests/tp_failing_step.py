"""`minidsa ARGS` (e.g. `serve --tp 2`) whose rank 0 fails inside a step once the file named by `FAIL_STEP_GATE`
exists: its local part of the step raises ValueError("injected step failure") after the plan went to the other
ranks, which then wait in a collective rank 0 never joins (tests/test_tensor_parallel.py, serve_and_end). The
failure is the test's, not the engine's: only this process's Worker.launch is wrapped."""

from __future__ import annotations

import os
import sys

ENV = "FAIL_STEP_GATE"


def main() -> None:
    from minidsa import cli
    from minidsa.exec.worker import Worker

    gate = os.environ[ENV]
    launch = Worker.launch

    def failing_launch(self, plan):
        if os.path.exists(gate):
            raise ValueError("injected step failure")
        return launch(self, plan)

    Worker.launch = failing_launch
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
