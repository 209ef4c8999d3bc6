"""`minidsa.server.app.serve` whose engine starts only once the test creates a file (argv[1]), so the test can
talk to the server while it is starting. Prints "port N" first. The gate is the test's, not the engine's."""

from __future__ import annotations

import os
import sys
import time

from minidsa.config import EngineConfig
from minidsa.engine import Engine
from minidsa.server import app


def main() -> None:
    gate = sys.argv[1]

    def engine_when_allowed(config: EngineConfig) -> Engine:
        while not os.path.exists(gate):
            time.sleep(0.05)
        return Engine(config)

    sock = app.bind_socket("127.0.0.1", 0)
    print(f"port {sock.getsockname()[1]}", flush=True)
    app.serve(EngineConfig(device="cpu", max_total_tokens=4096, max_running_requests=4), sock=sock,
              engine_factory=engine_when_allowed)


if __name__ == "__main__":
    main()
