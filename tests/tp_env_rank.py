"""A tensor-parallel rank > 0 that first writes its environment to the JSON file named by `RANK_ENV_REPORT`, then
runs as `python -m minidsa.parallel` does (tests/test_tensor_parallel.py: the variables the machine sets, such as
NCCL_NVLS_ENABLE=0, reach the processes minidsa starts). The test points the rank launcher's interpreter at a
script running this file, as tp_forced_rank.py's test does."""

from __future__ import annotations

import json
import os
import runpy

ENV = "RANK_ENV_REPORT"


def main() -> None:
    with open(os.environ[ENV], "w") as f:
        json.dump(dict(os.environ), f)
    runpy.run_module("minidsa.parallel", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
