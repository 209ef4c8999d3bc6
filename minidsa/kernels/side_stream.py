"""A second CUDA stream for work that can run beside a layer's main path: the indexer's chain.

At small batches most of a decode layer is one kernel after another, each either streaming weights over the whole
GPU or running on a few SMs. The indexer's chain (its query projection, key store, head weights, query
quantisation, logits and top-k: ~40 us a layer at batch 1 on an H100, the top-k on one SM) needs nothing of the
query's own path (q_b, the MLA key store, the absorbed W_UK) and is needed only by the sparse attention. Launched on
a second stream, a CUDA graph captures the two as parallel branches and replays them side by side.

Not every pair gains: kernels on the two streams share the SMs and the memory bandwidth, so a weight-streaming GEMM
sized to fill every SM gets a tail when the other branch holds some. The MoE router beside the shared expert was
tried (H100, bench-dsv32:6, benchmarks/TAIL.md section 7) and not kept.

Three steps, each a custom op (`torch.ops.minidsa.*_side_stream`) so that they run where they stand inside a
compiled layer:
- `fork`: the side stream waits for everything launched so far; launches after it go to the side stream;
- `leave`: launches after it go to the main stream again (no wait: the two branches run concurrently);
- `join`: the main stream waits for the side stream's work, before the first use of its results.

Between fork and leave only opaque ops may run (they launch on the current stream): an inductor-generated kernel
launches on the stream its compiled graph started on, and would not be ordered with the side branch. The engine
turns the side stream on only where every op of the indexer's chain is opaque (`attention.select`,
`KernelChoice.side_stream`). Memory: tensors the side branch reads that were made on the main stream are kept
alive until `join` (its `keep` argument), so the main stream cannot reuse their memory while the side branch may
still read it; what the side branch allocates lives in the caching allocator's pool of the side stream.

Off CUDA the three steps do nothing: the chain runs in program order on the one device.
"""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    """One device's side stream, and the main stream it forked from (to go back to)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.main: torch.cuda.Stream | None = None

    def fork(self) -> None:
        if self.main is not None:
            raise RuntimeError("side stream: fork inside a fork (a leave is missing)")
        self.main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(self.main)
        torch.cuda.set_stream(self.stream)

    def leave(self) -> None:
        if self.main is None:
            raise RuntimeError("side stream: leave without a fork")
        torch.cuda.set_stream(self.main)
        self.main = None

    def join(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def is_current(self) -> bool:
        return torch.cuda.current_stream(self.stream.device) == self.stream


_side: dict[int, SideStream] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def side_stream(device: torch.device) -> SideStream:
    """The device's side stream (made on first use: streams are per process, not per engine)."""
    index = _index(device)
    if index not in _side:
        _side[index] = SideStream(torch.device("cuda", index))
    return _side[index]


def on_side_stream(device: torch.device) -> bool:
    """Are launches on `device` going to its side stream now?"""
    return device.type == "cuda" and _index(device) in _side and _side[_index(device)].is_current()


def fork(device: torch.device) -> None:
    if device.type == "cuda":
        side_stream(device).fork()


def leave(device: torch.device) -> None:
    if device.type == "cuda":
        side_stream(device).leave()


def join(device: torch.device) -> None:
    if device.type == "cuda":
        side_stream(device).join()


@contextlib.contextmanager
def main_stream_after_errors(device: torch.device):
    """Around a forward: a layer that raised between fork and leave leaves launches on the main stream again (and
    the next step forks afresh), so one bad step does not move every later one onto the side stream."""
    try:
        yield
    except BaseException:
        side = _side.get(_index(device)) if device.type == "cuda" else None
        if side is not None and side.main is not None:
            side.leave()
        raise
