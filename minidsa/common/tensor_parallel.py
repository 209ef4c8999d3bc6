"""Which tensor-parallel rank this process is, and the collectives the model's forward issues.

A `TensorParallel` is handed to the model while it is built (`building_with`): every parallel layer keeps the
one it was built with, so two engines in one process (tests, notebooks) never share hidden global state, and
a plain single-process engine is `TensorParallel.single()` (size 1, no process group, no collective issued).

The collectives are torch's functional collectives (`torch.ops._c10d_functional`): ordinary ops that Dynamo
traces into the compiled decoder layer and that NCCL runs inside CUDA-graph capture, so the decode graphs of
every rank hold their all-reduces. On CPU (gloo) they run eagerly the same way.

Small all-reduces: where the ranks' GPUs can map each other's memory, start-up (minidsa/parallel/allreduce.py) hands
in `peer`, the buffers of a one-shot peer-to-peer all-reduce (kernels/allreduce.py); `all_reduce` then issues the
opaque op `minidsa::all_reduce`, which serves each call with that kernel up to `peer.max_bytes` and with NCCL above
(picked inside the op on the concrete size). Without `peer` (gloo, one rank, GPUs that cannot reach each other,
turned off) the functional NCCL / gloo all-reduce serves every size, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minidsa.kernels.allreduce import PeerBuffers


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group.

    `group_name`: the c10d name of the device process group (NCCL on CUDA, gloo on CPU) the forward's
    collectives run on; None without a group (then nothing is ever reduced).
    `expert_parallel`: routed experts are placed whole, `n_routed_experts / size` per rank, instead of each
    expert's intermediate dimension being split.
    `peer`: the one-shot all-reduce's buffers, where start-up made them (see the module docstring); None: the
    process group's all-reduce serves every size.
    `dp_attention`: data-parallel attention (`--enable-dp-attention`): every rank holds attention, the indexer,
    embeddings, dense MLPs, shared experts and lm_head whole (built with `dense`, no collectives) over its own
    requests; only the routed experts are placed per rank (expert parallel), and each MoE layer exchanges the
    ranks' rows (`all_gather_rows` / `reduce_scatter_rows`).
    """

    rank: int = 0
    size: int = 1
    group_name: str | None = None
    expert_parallel: bool = False
    peer: PeerBuffers | None = None
    dp_attention: bool = False

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls()

    @property
    def dense(self) -> "TensorParallel":
        """What every layer but the routed experts is built with: this, or under DP attention a group of one (the
        layer is whole on this rank and issues no collective)."""
        return TensorParallel.single() if self.dp_attention else self

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on each rank (the same rows everywhere) -> [size * rows, n], rank-major."""
        return self.wait(self.start_all_gather_rows(x))

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[size * rows, n] on each rank -> [rows, n]: rank r gets the sum over the ranks of block r."""
        return self.wait(self.start_reduce_scatter_rows(x))

    # Issued now, waited for later (`wait`): what runs on the compute stream meanwhile overlaps the exchange (two-batch
    # overlap, models/two_batch.py). The result must not be read before `wait` returns it.
    def start_all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), self.size, self.group_name)

    def start_reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "sum", self.size, self.group_name)

    @staticmethod
    def wait(started: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(started)

    @property
    def collectives(self) -> bool:
        """Whether the forward issues collectives (a process group exists, even of size 1)."""
        return self.group_name is not None

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of `total`; a clear error when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) does not split evenly over tensor_parallel_size {self.size}")
        part = total // self.size
        return self.rank * part, part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (row-parallel outputs, vocab-parallel embedding rows, MoE partial sums)."""
        if not self.collectives:
            return x
        peer = self.peer
        if peer is not None:
            return torch.ops.minidsa.all_reduce(x, self.group_name, peer.buffer_ptrs, peer.signal_ptrs, peer.rank,
                                                peer.world, peer.capacity, peer.max_bytes)
        out = torch.ops._c10d_functional.all_reduce(x, "sum", self.group_name)
        return torch.ops._c10d_functional.wait_tensor(out)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank order (vocab-parallel logits)."""
        if not self.collectives:
            return x
        if self.size == 1:
            return self.all_reduce(x)  # the same values through the same kind of collective
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(flat, self.size, self.group_name)
        gathered = torch.ops._c10d_functional.wait_tensor(gathered)  # [size * rows, n], rank-major
        return gathered.view(self.size, flat.shape[0], x.shape[-1]).permute(1, 0, 2).reshape(*lead, -1)


_BUILDING: list[TensorParallel] = []


@contextlib.contextmanager
def building_with(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Model construction inside this block shards itself for `tp` (layers read `building_tp()`)."""
    _BUILDING.append(tp)
    try:
        yield tp
    finally:
        _BUILDING.pop()


def building_tp() -> TensorParallel:
    """The TensorParallel the layer being built now shards itself for: size 1 outside `building_with`, and under DP
    attention (every layer whole on each rank but the routed experts: `building_experts_tp`)."""
    return building_experts_tp().dense


def building_experts_tp() -> TensorParallel:
    """The TensorParallel the routed experts being built now are placed for (the group's, DP attention or not)."""
    return _BUILDING[-1] if _BUILDING else TensorParallel.single()
