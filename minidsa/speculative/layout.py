"""THE one place that lays out `out_cache_loc` for every speculative step.

Per request with `n` committed tokens in the target cache (row positions
`[0, n)`), a speculative round uses the row positions after it:

- draft steps (the MTP layer's own cache): step `i`, branch `j` writes row
  position `n + i * topk + j`. Over a batch the flat buffer is step-major,
  `[num_steps * bs * topk]`, so draft step `i` is row `i` of the contiguous
  view `[num_steps, bs * topk]` (request-major inside a row).
- target verify: draft node `k` (node 0 = the root, the last committed token
  not yet in the cache) writes row position `n + k`: `[bs * num_draft_tokens]`,
  request-major.
- draft extend: the `accept_len + 1` tokens after `n` (root and accepted
  path, already compacted to `n, n+1, ...`).
- tree compaction: accepted node `k_m` (m-th on the path) moves from
  `n + k_m` to `n + m`.

Draft and verify regions overlap, but draft steps write only the MTP layer
and the verify writes only the target layers, and draft extend rewrites the
MTP layer at the accepted positions afterwards.

The speculator and the attention backend call these functions; nobody
reshapes these buffers inline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidsa.common.kv_cache import row_slots


@dataclass(frozen=True)
class SpecLayout:
    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self):
        assert self.num_steps >= 1 and self.topk >= 1 and self.num_draft_tokens >= 2

    @property
    def draft_width(self) -> int:
        """Row positions one request's draft steps use."""
        return self.num_steps * self.topk

    # -- draft steps ----------------------------------------------------------
    def draft_cache_loc(self, req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Flat `[num_steps * bs * topk]` slots, step-major."""
        bs = rows.shape[0]
        rel = torch.arange(self.draft_width, device=rows.device)  # i * topk + j
        pos = seq_lens.view(bs, 1) + rel.view(1, -1)  # [bs, steps*topk]
        slots = req_to_token[rows.view(bs, 1), pos].long()
        flat = slots.view(bs, self.num_steps, self.topk).transpose(0, 1).reshape(-1)
        return flat

    def draft_steps_view(self, flat: torch.Tensor, bs: int) -> torch.Tensor:
        """`[num_steps * bs * topk]` -> contiguous `[num_steps, bs * topk]` (row i = draft step i)."""
        assert flat.dim() == 1 and flat.numel() == self.num_steps * bs * self.topk, (
            f"draft out_cache_loc has {tuple(flat.shape)}, expected [{self.num_steps} * {bs} * {self.topk}]")
        assert flat.is_contiguous()
        return flat.view(self.num_steps, bs * self.topk)

    def draft_steps_flat(self, view: torch.Tensor) -> torch.Tensor:
        assert view.dim() == 2 and view.shape[0] == self.num_steps and view.shape[1] % self.topk == 0, (
            f"draft view has {tuple(view.shape)}, expected [{self.num_steps}, bs * {self.topk}]")
        return view.contiguous().view(-1)

    def draft_step_positions(self, step: int, seq_lens: torch.Tensor) -> torch.Tensor:
        """Row positions written by draft step `step` for each (request, branch): `[bs * topk]`."""
        assert 0 <= step < self.num_steps
        base = seq_lens.view(-1, 1) + step * self.topk + torch.arange(self.topk, device=seq_lens.device)
        return base.reshape(-1)

    # -- verify ---------------------------------------------------------------
    def verify_cache_loc(self, req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """`[bs * num_draft_tokens]` slots, request-major: node k of request b at row position n_b + k."""
        bs = rows.shape[0]
        pos = seq_lens.view(bs, 1) + torch.arange(self.num_draft_tokens, device=rows.device).view(1, -1)
        return req_to_token[rows.view(bs, 1), pos].long().reshape(-1)

    def verify_view(self, flat: torch.Tensor, bs: int) -> torch.Tensor:
        assert flat.dim() == 1 and flat.numel() == bs * self.num_draft_tokens, (
            f"verify buffer has {tuple(flat.shape)}, expected [{bs} * {self.num_draft_tokens}]")
        return flat.view(bs, self.num_draft_tokens)

    # -- draft extend -----------------------------------------------------------
    @staticmethod
    def draft_extend_cache_loc(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int],
                               extend_lens: list[int]) -> torch.Tensor:
        """Slots of row positions `[n_b, n_b + extend_lens[b])`, concatenated: `[sum(extend_lens)]`."""
        return row_slots(req_to_token, rows, seq_lens, extend_lens)

    # -- compaction -------------------------------------------------------------
    def compaction_moves(self, req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int],
                         accepted_nodes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) slots moving accepted node k_m from row position n + k_m to n + m (only where they differ)."""
        src_pos, dst_pos, src_rows = [], [], []
        for r, n, path in zip(rows, seq_lens, accepted_nodes):
            assert path and path[0] == 0, f"an accepted path starts at the root node 0, got {path}"
            assert all(0 <= k < self.num_draft_tokens for k in path)
            for m, k in enumerate(path):
                if k != m:
                    src_pos.append(n + k)
                    dst_pos.append(n + m)
                    src_rows.append(r)
        dev = req_to_token.device
        if not src_rows:
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return empty, empty
        r = torch.tensor(src_rows, device=dev)
        src = req_to_token[r, torch.tensor(src_pos, device=dev)].long()
        dst = req_to_token[r, torch.tensor(dst_pos, device=dev)].long()
        return src, dst
