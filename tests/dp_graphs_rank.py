"""A DP-attention rank > 0 that serves through the step graphs' static, padded buffers on CPU, as rank 0 does in
tests/test_dp_attention.py (`static_graphs`), and logs the key of every graph it replays, one JSON line each, to the
file `DP_GRAPH_REPLAYS` names. The test points the rank launcher's interpreter at a script running this file
instead of `-m minidsa.parallel`."""

from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ENV = "DP_GRAPH_REPLAYS"


def static_graphs(setattr, log) -> None:
    """From now on every runner's `prepare_fast_paths` builds the step graphs' static buffers (`static_fast_paths`:
    nothing captured without a GPU) and every graph replay first calls `log(key)`. `setattr`: how to patch
    (pytest's monkeypatch.setattr, or the builtin)."""
    from harness import static_fast_paths
    from minidsa.exec.graphs import StepGraphs
    from minidsa.exec.runner import ModelRunner

    graph_for = StepGraphs._graph_for

    def logged(self, key):
        log(key)
        return graph_for(self, key)

    setattr(ModelRunner, "prepare_fast_paths", lambda self, spec_layout: static_fast_paths(self, spec_layout))
    setattr(StepGraphs, "_graph_for", logged)


def main() -> None:
    path = os.environ[ENV]

    def log(key) -> None:
        with open(path, "a") as f:
            f.write(json.dumps([key[0].name, key[1], key[2]]) + "\n")

    static_graphs(setattr, log)
    runpy.run_module("minidsa.parallel", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
