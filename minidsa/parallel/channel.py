"""Plain data between the ranks over the gloo control group, pickled. No tensor travels: what a rank's device state
needs is in the plan.

- `PlanChannel`: rank 0 -> every rank, the engine's plans (`StepPlan`s, `DPStepPlan`s, `StopPlan`), one broadcast;
  `send` on rank 0 and `receive` on the others pair up one to one, in order.
- `ResultChannel`: every rank -> rank 0, a DP-attention step's results, one gather; `send` on the ranks > 0 and
  `gather` on rank 0 pair up one to one, in order.

Both send a fixed first message (most plans and results fit it) and the rest of a longer one after it, so that a
step costs one collective: `torch.distributed.gather_object` took two (the sizes, then the padded data) and
measured ~3x a fixed-size gather on two gloo ranks.
"""

from __future__ import annotations

import pickle
import struct

import torch
import torch.distributed as dist

from minidsa.parallel.launch import RankGroup

# Most plans and results fit the first message; a longer one follows in a second message of exactly its size.
FIRST_MESSAGE_BYTES = 4096
_HEADER = struct.Struct("<Q")


def _encode(obj: object, first: torch.Tensor) -> torch.Tensor | None:
    """`obj` pickled behind its length: the first FIRST_MESSAGE_BYTES into `first`, the rest returned (None: it fit)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    message = _HEADER.pack(len(data)) + data
    head = message[:FIRST_MESSAGE_BYTES]
    first[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    if len(message) <= FIRST_MESSAGE_BYTES:
        return None
    return torch.frombuffer(bytearray(message[FIRST_MESSAGE_BYTES:]), dtype=torch.uint8)


def _rest_bytes(first: torch.Tensor) -> int:
    """How much of the message whose first part is `first` comes after it."""
    (length,) = _HEADER.unpack_from(first.numpy().tobytes(), 0)
    return max(0, _HEADER.size + length - FIRST_MESSAGE_BYTES)


def _decode(first: torch.Tensor, rest: torch.Tensor | None) -> object:
    message = first.numpy().tobytes() + (b"" if rest is None else rest.numpy().tobytes())
    (length,) = _HEADER.unpack_from(message, 0)
    return pickle.loads(message[_HEADER.size:_HEADER.size + length])


class PlanChannel:
    def __init__(self, group: RankGroup):
        self.group = group
        self._first = torch.zeros(FIRST_MESSAGE_BYTES, dtype=torch.uint8)

    @property
    def receivers(self) -> int:
        return self.group.world_size - 1

    def send(self, plan: object) -> None:
        """Rank 0: hand `plan` to every other rank (nothing to do in a group of one)."""
        if self.receivers == 0:
            return
        rest = _encode(plan, self._first)
        dist.broadcast(self._first, src=0, group=self.group.control_group)
        if rest is not None:
            dist.broadcast(rest, src=0, group=self.group.control_group)

    def receive(self) -> object:
        """Ranks > 0: the next plan rank 0 sent."""
        dist.broadcast(self._first, src=0, group=self.group.control_group)
        rest = None
        if n := _rest_bytes(self._first):
            rest = torch.empty(n, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group.control_group)
        return _decode(self._first, rest)


class ResultChannel:
    """Every rank's result of a step to rank 0: one gather of the first messages; a rank whose result is longer
    sends the rest to rank 0 alone (point to point), which its header announced."""

    def __init__(self, group: RankGroup):
        self.group = group
        self._first = torch.zeros(FIRST_MESSAGE_BYTES, dtype=torch.uint8)
        self._firsts = ([torch.zeros(FIRST_MESSAGE_BYTES, dtype=torch.uint8) for _ in range(group.world_size)]
                        if group.rank == 0 else None)

    def send(self, result: object) -> None:
        """Ranks > 0: this rank's result of the step."""
        rest = _encode(result, self._first)
        dist.gather(self._first, None, dst=0, group=self.group.control_group)
        if rest is not None:
            dist.send(rest, dst=0, group=self.group.control_group)

    def gather(self, own: object) -> list[object]:
        """Rank 0: every rank's result of the step, in rank order (`own`: rank 0's)."""
        if self.group.world_size == 1:
            return [own]
        # rank 0's own result needs no trip: its slot of the gather is sent as it is, and never read
        dist.gather(self._first, self._firsts, dst=0, group=self.group.control_group)
        results: list[object] = [own]
        for r in range(1, self.group.world_size):
            rest = None
            if n := _rest_bytes(self._firsts[r]):
                rest = torch.empty(n, dtype=torch.uint8)
                dist.recv(rest, src=r, group=self.group.control_group)
            results.append(_decode(self._firsts[r], rest))
        return results
