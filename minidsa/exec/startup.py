"""Start-up phases a person can follow: one INFO line per phase (weights, DeepGEMM, KV cache, capture, warm-up,
...) with its seconds and what it compiled or found cached, and the summary line with the total.

The lines go to the `minidsa.exec.startup` logger, which `minidsa bench` shows even at its default WARNING level.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    detail: str = ""  # set by the phase's code: what it did, what the caches gave


class StartupPhases:
    """The phases of one engine's start-up, in order."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        """Time a phase; its line is logged when it ends (with a failure too, marked so)."""
        p = Phase(name)
        start = time.perf_counter()
        ok = False
        try:
            yield p
            ok = True
        finally:
            p.seconds = time.perf_counter() - start
            self._log(p, ok)

    def record(self, name: str, seconds: float, detail: str = "") -> None:
        """A phase timed by its caller."""
        self._log(Phase(name, seconds, detail), True)

    def _log(self, p: Phase, ok: bool) -> None:
        self.phases.append(p)
        logger.info("start-up: %s %.1f s%s%s", p.name, p.seconds, f" ({p.detail})" if p.detail else "",
                    "" if ok else " (failed)")

    def seconds(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    def summary(self, total: float) -> str:
        """"start-up 95.2 s: weights 6.1 s, ..., other 0.4 s" (other: what no phase covered)."""
        parts = [f"{p.name} {p.seconds:.1f} s" for p in self.phases]
        rest = total - sum(p.seconds for p in self.phases)
        if rest >= 0.05:
            parts.append(f"other {rest:.1f} s")
        return f"start-up {total:.1f} s: " + ", ".join(parts)
