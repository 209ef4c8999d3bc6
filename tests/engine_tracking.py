"""Test-side engine tracking for the KV-leak check: `track_engines()` collects (and keeps alive) every
Engine constructed inside the block, by wrapping `Engine.__init__` for its duration (the engine module
itself keeps no registry of instances)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from minidsa.engine import Engine


@contextlib.contextmanager
def track_engines() -> Iterator[list[Engine]]:
    created: list[Engine] = []
    inner = Engine.__init__

    def init(self, *args, **kwargs):
        inner(self, *args, **kwargs)
        created.append(self)

    Engine.__init__ = init
    try:
        yield created
    finally:
        Engine.__init__ = inner  # nested blocks restore in reverse order
