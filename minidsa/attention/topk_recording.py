"""See which context positions each indexer layer selected: an inspection tool (examples/quickstart.ipynb,
benchmarks/scripts/bench_mla.py, tests), beside the attention backend it records.

`TopkRecorder(backend)` wraps a `DSABackend`'s `index_topk` on that one instance (the backend has no
recording hook of its own) and, while recording, appends `(layer id, positions)` per indexer call: positions
`[tokens, index_topk]` int32 row positions, -1 = unused, recovered from the selected slots through the
batch's req_to_token rows. CUDA-graph replays run no Python, and with torch.compile (the GPU default) every
step runs compiled layers: to record every step on a GPU, build the engine with enable_cuda_graph=False and
enable_compile=False.

    with TopkRecorder(llm.engine.runner.attn) as rec:
        llm.generate(prompt, params)
    rec.records  # [(layer, positions), ...] in call order
"""

from __future__ import annotations

import torch


def slots_to_positions(req_to_token: torch.Tensor, token_rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Row position of each selected slot (-1 stays -1): the first position of the token's row mapping to it."""
    table = req_to_token[token_rows].long()  # [T, W]
    hit = table.unsqueeze(1) == slots.long().unsqueeze(2)  # [T, k, W]
    pos = hit.int().argmax(dim=2)
    return torch.where(slots >= 0, pos, -1).to(torch.int32)


class TopkRecorder:
    def __init__(self, backend):
        self.backend = backend
        self.records: list[tuple[int, torch.Tensor]] | None = None  # None: not recording
        inner = type(backend).index_topk

        def index_topk(layer, batch, q, weights, cos, sin, rope_interleave, step_meta=None):
            slots = inner(backend, layer, batch, q, weights, cos, sin, rope_interleave, step_meta)
            if self.records is not None:
                self.records.append((layer.layer_id,
                                     slots_to_positions(backend.req_to_token, batch.token_rows, slots)))
            return slots

        backend.index_topk = index_topk

    def start(self) -> None:
        self.records = []

    def close(self) -> None:
        """Stop recording and unwrap the backend (the records stay)."""
        self.backend.__dict__.pop("index_topk", None)

    def __enter__(self) -> "TopkRecorder":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
