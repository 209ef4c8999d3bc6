"""A DP-attention rank > 0 that serves through the step graphs' static, padded buffers on CPU and a compiled engine's
step functions (the decoder layer compiled, or left uncompiled), as rank 0 does in tests/test_dp_attention.py
(`static_graphs`), and logs the key of every graph it replays, one JSON line each, to the file `DP_GRAPH_REPLAYS`
names. The test points the rank launcher's interpreter at a script running this file
instead of `-m minidsa.parallel`."""

from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ENV = "DP_GRAPH_REPLAYS"
FRAMES_ENV = "DP_COMPILED_FRAMES"  # set: the layer is compiled, and the frames compiled so far are logged there


def static_graphs(setattr, log, counter=None) -> None:
    """From now on every runner's `prepare_fast_paths` builds the step graphs' static buffers (as `static_fast_paths`:
    nothing captured without a GPU) over a compiled engine's step functions, warming the uncaptured path up as a GPU
    start-up does; every graph replay first calls `log(key)`. The layer: `counter` (a torch.compile backend, e.g.
    a CompileCounterWithBackend: compiled as the engine does, `ModelRunner.compile_layer`), or `call_layer` itself
    (not compiled). `setattr`: how to patch (pytest's monkeypatch.setattr, or the builtin)."""
    from harness import CPU_WARMUP_TOKENS
    from minidsa.exec.graphs import StepGraphs
    from minidsa.exec.runner import ModelRunner
    from minidsa.models.deepseek_v32 import call_layer

    graph_for = StepGraphs._graph_for

    def logged(self, key):
        log(key)
        return graph_for(self, key)

    def prepare_fast_paths(self, spec_layout) -> None:
        # at the point of start-up where every rank runs it: the warm-up's MoE exchanges must match the other ranks'
        if counter is not None and self.config.enable_two_batch_overlap:  # its stages compiled too, as on a GPU
            self.overlap = self.compile_overlap(counter)
        run_main, run_mtp = self.step_functions(call_layer if counter is None else self.compile_layer(counter),
                                                self.overlap)
        self.use_graphs(self.build_graphs(spec_layout, run_main, run_mtp), warm_up_tokens=CPU_WARMUP_TOKENS)

    setattr(ModelRunner, "prepare_fast_paths", prepare_fast_paths)
    setattr(StepGraphs, "_graph_for", logged)


def main() -> None:
    path = os.environ[ENV]

    def log(key) -> None:
        with open(path, "a") as f:
            f.write(json.dumps([key[0].name, key[1], key[2]]) + "\n")

    counter = None
    frames = os.environ.get(FRAMES_ENV)
    if frames:  # compiled: after start-up (the first line) and after every forward, the frames compiled so far
        from torch._dynamo.testing import CompileCounterWithBackend

        from minidsa.exec.runner import ModelRunner

        counter = CompileCounterWithBackend("aot_eager")
        forward = ModelRunner.forward

        def counted(self, batch):
            out = forward(self, batch)
            with open(frames, "a") as f:
                f.write(f"{counter.frame_count}\n")
            return out

        ModelRunner.forward = counted
    static_graphs(setattr, log, counter)
    if frames:
        from minidsa.exec.runner import ModelRunner

        prepare = ModelRunner.prepare_fast_paths

        def prepared(self, spec_layout) -> None:
            prepare(self, spec_layout)
            with open(frames, "a") as f:
                f.write(f"{counter.frame_count}\n")

        ModelRunner.prepare_fast_paths = prepared
    runpy.run_module("minidsa.parallel", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
