"""What the speculator uses of the model runner: `SpecRunner`, a narrow interface.

The speculator decides which tokens a round runs and builds its batches; the runner runs them and owns the
device state. `MTPSpeculator` reaches the runner through these members only (exec/runner.py's `ModelRunner`
provides them; a test drives the speculator through an object that has nothing else):

- `device`, `dtype`, `model_config`: where the draft state lives and its sizes (vocabulary, hidden size).
- `num_rows`: rows of the req->token table, one per running request; the draft state has one per row.
- `req_to_token`: the table itself, `[num_rows, width]` int32, row position -> KV slot. Read only: the
  out_cache_loc layouts (layout.py) are gathered from it.
- `forward(batch)`: the main model on a VERIFY batch; `forward_mtp(batch, hidden_prev, prev_topk=None)`: the
  MTP layer on a DRAFT or DRAFT_EXTEND batch, fed the target's hidden states (and, optionally, the indexer top-k
  of the same positions). Both return a `ModelOutput` whose tensors may be a graph's static buffers: valid until
  the next forward of the same kind.
- `move_kv(src, dst)`: copy the KV of slots `src` to slots `dst` (MLA and indexer caches, every layer): tree
  compaction.
- `has_draft_extend_graph`: draft extends replay a captured graph, whose static shape is every request padded
  to num_draft_tokens tokens; the graph computes its own top-k (none is handed to it).
"""

from __future__ import annotations

from typing import Protocol

import torch

from minidsa.common.batch import ForwardBatch
from minidsa.config import ModelConfig
from minidsa.models.deepseek_v32 import ModelOutput


class SpecRunner(Protocol):
    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig

    @property
    def num_rows(self) -> int: ...

    @property
    def req_to_token(self) -> torch.Tensor: ...

    @property
    def has_draft_extend_graph(self) -> bool: ...

    def forward(self, batch: ForwardBatch) -> ModelOutput: ...

    def forward_mtp(self, batch: ForwardBatch, hidden_prev: torch.Tensor,
                    prev_topk: torch.Tensor | None = None) -> ModelOutput: ...

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...

