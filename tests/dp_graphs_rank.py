"""A DP-attention rank > 0 that serves through the step graphs' static, padded buffers on CPU and a compiled engine's
step functions (the decoder layer left uncompiled), as rank 0 does in tests/test_dp_attention.py (`static_graphs`),
and logs the key of every graph it replays, one JSON line each, to the
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
    """From now on every runner's `prepare_fast_paths` builds the step graphs' static buffers (as `static_fast_paths`:
    nothing captured without a GPU) over a compiled engine's step functions whose layer is `call_layer` itself (not
    compiled), warming the uncaptured path up as a GPU start-up does; every graph replay first calls `log(key)`.
    `setattr`: how to patch (pytest's monkeypatch.setattr, or the builtin)."""
    from harness import CPU_WARMUP_TOKENS
    from minidsa.exec.graphs import StepGraphs
    from minidsa.exec.runner import ModelRunner
    from minidsa.models.deepseek_v32 import call_layer

    graph_for = StepGraphs._graph_for

    def logged(self, key):
        log(key)
        return graph_for(self, key)

    def prepare_fast_paths(self, spec_layout) -> None:
        # `static_fast_paths` with a compiled engine's step functions, the layer left uncompiled (`call_layer`
        # itself): uncaptured steps take the compiled path's route (aligned key widths) and start-up warms it up
        # as on a GPU, at the point where every rank runs it (its MoE exchanges must match the other ranks')
        run_main, run_mtp = self.step_functions(call_layer)
        self.use_graphs(self.build_graphs(spec_layout, run_main, run_mtp), warm_up_tokens=CPU_WARMUP_TOKENS)

    setattr(ModelRunner, "prepare_fast_paths", prepare_fast_paths)
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
