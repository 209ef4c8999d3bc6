"""Rank 0 -> every rank: plain-data plans (the engine's `StepPlan`s, `StopPlan`), pickled and broadcast over
the gloo control group. No tensor travels: what a rank's device state needs is in the plan.

`send` on rank 0 and `receive` on the others pair up one to one, in order.
"""

from __future__ import annotations

import pickle
import struct

import torch
import torch.distributed as dist

from minidsa.parallel.launch import RankGroup

# Most plans fit the first message; a longer one follows in a second broadcast of exactly its size.
FIRST_MESSAGE_BYTES = 4096
_HEADER = struct.Struct("<Q")


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
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        message = _HEADER.pack(len(data)) + data
        first = message[:FIRST_MESSAGE_BYTES]
        self._first[: len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(self._first, src=0, group=self.group.control_group)
        if len(message) > FIRST_MESSAGE_BYTES:
            rest = torch.frombuffer(bytearray(message[FIRST_MESSAGE_BYTES:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group.control_group)

    def receive(self) -> object:
        """Ranks > 0: the next plan rank 0 sent."""
        dist.broadcast(self._first, src=0, group=self.group.control_group)
        message = self._first.numpy().tobytes()
        (length,) = _HEADER.unpack_from(message)
        total = _HEADER.size + length
        if total > FIRST_MESSAGE_BYTES:
            rest = torch.empty(total - FIRST_MESSAGE_BYTES, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group.control_group)
            message += rest.numpy().tobytes()
        return pickle.loads(message[_HEADER.size:total])
