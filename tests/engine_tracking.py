"""Test-side engine tracking for the KV-leak check: `track_engines()` collects a `TrackedEngine` for every
Engine constructed inside the block, by wrapping `Engine.__init__` for its duration (the engine module itself
keeps no registry of instances).

A TrackedEngine keeps the engine's host-side bookkeeping alive (scheduler, allocators, request table), not
the engine: an engine a test drops frees its weights, KV cache and graphs at once, so a GPU test can build a
second full-size engine after the first (holding the first for the end-of-test check ran the H100 out of
memory), and engines local to the test are still checked when it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from minidsa.engine import Engine


class TrackedEngine:
    """What `Engine.check_no_leaks` reads, shared with the live engine (the same objects, not copies)."""

    def __init__(self, engine: Engine):
        self.is_driver = engine.is_driver
        if engine.is_driver:
            self.scheduler = engine.scheduler
            self.page_allocator = engine.page_allocator
            self.row_allocator = engine.row_allocator
            self.requests = engine.requests
            self.attention_ranks = engine.attention_ranks  # one, or each DP-attention rank's bookkeeping

    def tracks(self, engine: Engine) -> bool:
        return self.is_driver and getattr(engine, "scheduler", None) is self.scheduler

    def check_no_leaks(self) -> None:
        if self.is_driver:  # a tensor-parallel follower holds no bookkeeping of its own
            Engine.check_no_leaks(self)  # type: ignore[arg-type]


@contextlib.contextmanager
def track_engines() -> Iterator[list[TrackedEngine]]:
    created: list[TrackedEngine] = []
    inner = Engine.__init__

    def init(self, *args, **kwargs):
        inner(self, *args, **kwargs)
        created.append(TrackedEngine(self))

    Engine.__init__ = init
    try:
        yield created
    finally:
        Engine.__init__ = inner  # nested blocks restore in reverse order
