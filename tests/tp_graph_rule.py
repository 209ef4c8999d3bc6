"""NCCL's teardown rule, on CPU: a communicator is aborted only once every CUDA graph that captured one of its
collectives is gone (NCCL 2.26 on polls until then, so an abort with a graph alive never returns).

`follow_nccl_graph_rule(setattr)` makes this process obey it: every runner's `prepare_fast_paths` serves through the
step graphs' static buffers (tests/harness.py `static_fast_paths`) and adds a stand-in captured graph to their
`captured` list, and aborting a process group first waits until every stand-in was reset. Run as a script, a rank
> 0 does the same, then runs as `python -m minidsa.parallel` (the test points the rank launcher's interpreter at
it, as tp_env_rank.py's test does)."""

from __future__ import annotations

import os
import runpy
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LIVE: set[int] = set()  # ids of the stand-ins not reset yet
_changed = threading.Condition()


class CapturedGraphStandIn:
    """A CUDA graph holding a communicator: alive until `reset` (torch.cuda.CUDAGraph's way to destroy it)."""

    def __init__(self) -> None:
        with _changed:
            LIVE.add(id(self))

    def reset(self) -> None:
        with _changed:
            LIVE.discard(id(self))
            _changed.notify_all()


def follow_nccl_graph_rule(setattr) -> None:
    """`setattr`: how to patch (pytest's monkeypatch.setattr, or the builtin)."""
    import torch.distributed as dist

    from harness import static_fast_paths
    from minidsa.exec.runner import ModelRunner

    abort = dist.distributed_c10d._abort_process_group

    def prepare_fast_paths(self, spec_layout) -> None:
        static_fast_paths(self, spec_layout)
        self.graphs.captured.append(CapturedGraphStandIn())

    def abort_once_the_graphs_are_gone(group=None) -> None:
        with _changed:
            _changed.wait_for(lambda: not LIVE)
        abort(group)

    setattr(ModelRunner, "prepare_fast_paths", prepare_fast_paths)
    setattr(dist.distributed_c10d, "_abort_process_group", abort_once_the_graphs_are_gone)


def main() -> None:
    follow_nccl_graph_rule(setattr)
    runpy.run_module("minidsa.parallel", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
