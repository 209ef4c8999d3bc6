"""Tensor-parallel layers: each keeps its rank's slice of the checkpoint tensor it is loaded from.

nano-vllm style: a parameter's `weight_loader` receives the full checkpoint tensor (lazily: a
`models.loader.CheckpointTensor` reads only the rows / columns asked for from the safetensors file) and
narrows it to this rank's part before the usual conversion (`layers.linear.load_block_scaled`).

- `ColumnParallelLinear`: output rows split (q_b_proj and kv_b_proj by heads, gate / up projections by the
  intermediate dimension, lm_head by vocabulary). Fused projections (gate | up) fuse the local shards.
- `RowParallelLinear`: input columns split; the partial outputs are summed over the ranks (o_proj, down_proj),
  or left partial for a caller that sums several of them with one all-reduce (the MoE layer).
- `VocabParallelEmbedding`: each rank holds `vocab / size` rows; ids outside them contribute zeros; one
  all-reduce.

FP8 block-scaled tensors (e4m3 + `weight_scale_inv` per 128x128 block) are cut on 128-block boundaries: the
scale rows / columns of a slice are the slice's blocks. A split that would cut a block is an error naming the
tensor (`checkpoint_shard`), and a parallel FP8 parameter whose local size is not whole blocks refuses to
become FP8 (`make_fp8_`).

Every sharded parameter records `full_shape`, the checkpoint tensor's shape: random weights are drawn at that
shape and loaded like a checkpoint tensor, so a preset is the same model at every tensor_parallel_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidsa.common.tensor_parallel import TensorParallel, building_tp
from minidsa.kernels.fp8 import FP8_BLOCK, FP8_DTYPE
from minidsa.models.layers.linear import Linear, WeightLoadError, load_block_scaled


def checkpoint_shard(loaded, scale_inv, dim: int, start: int, length: int, full: int, name: str):
    """(loaded, scale_inv) narrowed to [start, start + length) along `dim` (-1 or -2) of a [..., out, in] tensor.

    `full` is the size the config implies for that dimension (checked first, so a wrong checkpoint says so
    rather than failing on a slice). Works on torch tensors and lazy `CheckpointTensor`s alike.
    """
    if loaded.shape[dim] != full:
        raise WeightLoadError(f"tensor {name} has shape {tuple(loaded.shape)}, the config implies {full} along "
                              f"dimension {dim % len(loaded.shape)}")
    if length == full:
        return loaded, scale_inv
    if loaded.dtype == FP8_DTYPE and scale_inv is not None:
        if start % FP8_BLOCK or (length % FP8_BLOCK and start + length != full):
            raise WeightLoadError(
                f"tensor {name} is FP8 with {FP8_BLOCK}x{FP8_BLOCK} block scales: this rank's slice "
                f"[{start}, {start + length}) of dimension {dim % len(loaded.shape)} (size {full}) does not start "
                f"and end on {FP8_BLOCK}-block boundaries; choose a tensor_parallel_size that splits it in whole "
                "blocks")
        blocks = -(-length // FP8_BLOCK)
        scale_inv = scale_inv.narrow(dim, start // FP8_BLOCK, blocks)
    return loaded.narrow(dim, start, length), scale_inv


class ColumnParallelLinear(Linear):
    """y[:, rank's rows] = x W[rank's rows]^T. `what` names the split dimension in errors (e.g. "heads")."""

    def __init__(self, in_features: int, out_features: int, quantizable: bool = True, what: str = "output rows",
                 tp: TensorParallel | None = None):
        self.tp = tp or building_tp()
        start, part = self.tp.split(out_features, what)
        super().__init__(in_features, part, quantizable)
        self.full_out_features, self.shard_start, self.what = out_features, start, what
        self.weight.full_shape = (out_features, in_features)

    def make_fp8_(self, pow2_scale: bool = False) -> None:
        if self.tp.size > 1 and self.out_features % FP8_BLOCK:
            raise ValueError(f"FP8 {self.what}: {self.full_out_features} rows over tensor_parallel_size "
                             f"{self.tp.size} leave {self.out_features} per rank, not whole {FP8_BLOCK}-row blocks")
        super().make_fp8_(pow2_scale)

    def load_weight(self, param, loaded, scale_inv=None, name: str = "") -> None:
        loaded, scale_inv = checkpoint_shard(loaded, scale_inv, -2, self.shard_start, self.out_features,
                                             self.full_out_features, name or "weight")
        super().load_weight(param, loaded, scale_inv, name)


class RowParallelLinear(Linear):
    """y = sum over ranks of x[:, rank's cols] W[:, rank's cols]^T; `reduce_output=False` leaves it partial."""

    def __init__(self, in_features: int, out_features: int, quantizable: bool = True, what: str = "input columns",
                 reduce_output: bool = True, tp: TensorParallel | None = None):
        self.tp = tp or building_tp()
        start, part = self.tp.split(in_features, what)
        super().__init__(part, out_features, quantizable)
        self.full_in_features, self.shard_start, self.what = in_features, start, what
        self.weight.full_shape = (out_features, in_features)
        self.reduce_output = reduce_output

    def make_fp8_(self, pow2_scale: bool = False) -> None:
        if self.tp.size > 1 and self.in_features % FP8_BLOCK:
            raise ValueError(f"FP8 {self.what}: {self.full_in_features} columns over tensor_parallel_size "
                             f"{self.tp.size} leave {self.in_features} per rank, not whole {FP8_BLOCK}-column "
                             "blocks")
        super().make_fp8_(pow2_scale)

    def load_weight(self, param, loaded, scale_inv=None, name: str = "") -> None:
        loaded, scale_inv = checkpoint_shard(loaded, scale_inv, -1, self.shard_start, self.in_features,
                                             self.full_in_features, name or "weight")
        super().load_weight(param, loaded, scale_inv, name)

    def forward(self, x: torch.Tensor, x_quantized=None) -> torch.Tensor:
        """`x_quantized`: as `Linear.forward`'s."""
        y = super().forward(x, x_quantized)
        return self.tp.all_reduce(y) if self.reduce_output else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [rank * V/size, (rank + 1) * V/size) here; the others' ids look up zeros; summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp or building_tp()
        self.vocab_start, self.vocab_part = self.tp.split(num_embeddings, "vocab_size")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(self.vocab_part, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.load_weight
        self.weight.full_shape = (num_embeddings, embedding_dim)

    def load_weight(self, param, loaded, scale_inv=None, name: str = "") -> None:
        loaded, scale_inv = checkpoint_shard(loaded, scale_inv, -2, self.vocab_start, self.vocab_part,
                                             self.num_embeddings, name or "embedding")
        load_block_scaled(param.data, None, loaded, scale_inv, name or "embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.tp.all_reduce(F.embedding(ids, self.weight))
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_part)
        e = F.embedding(local.clamp(0, self.vocab_part - 1), self.weight)
        return self.tp.all_reduce(e.masked_fill(outside.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, "
                f"{self.vocab_start + self.vocab_part}) on rank {self.tp.rank} of {self.tp.size}")
