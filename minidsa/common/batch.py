"""What one model call sees: `ForwardBatch`, tagged with its `StepKind` (common/plan.py).

Layout conventions (all tensors on the model's device):
- Tokens of all requests are flattened: `T` query tokens, request b owns
  the contiguous run `[extend_start[b], extend_start[b] + extend_lens[b])`.
- A request's KV lives at `req_to_token[req_pool_indices[b], 0:seq_lens[b]]`
  (row positions -> physical slots). The tokens of this step are written to
  `out_cache_loc` *before* attention reads the cache.
- Visibility: query token t sees the row positions `[0, kv_lens[t])` of its
  request, plus, for a tree verify, the positions `kv_lens[t] + j` where
  `tree_mask[t, j]` is set (its own ancestors and itself among the draft
  tokens). Without a tree, `kv_lens[t] = position-in-row + 1` (causal).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from dataclasses import dataclass

import torch

from minidsa.common.plan import StepKind


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host tensor to `device` without making the host wait for the device's queued work
    (a plain `.to("cuda")` of pageable memory synchronises the stream): pinned staging, non-blocking copy."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def ints_to_device(values: list[int], device: torch.device | str) -> torch.Tensor:
    """int64 tensor of `values` on `device` (non-blocking)."""
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)


@dataclass
class ForwardBatch:
    kind: StepKind  # EXTEND, DECODE, VERIFY (main model); DRAFT, DRAFT_EXTEND (the MTP layer)
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, RoPE positions
    out_cache_loc: torch.Tensor  # [T] int64, slots this step writes
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64, filled row positions after this step
    extend_lens: torch.Tensor  # [B] int64, query tokens per request
    token_req: torch.Tensor  # [T] int64, request (batch index) of each token
    kv_lens: torch.Tensor  # [T] int64, causal visible prefix of each token
    logits_indices: torch.Tensor  # [N] int64, tokens whose logits are wanted
    max_kv_len: int  # host-side bound on seq_lens (sizes the reference ops' buffers)
    tree_mask: torch.Tensor | None = None  # [T, W] bool, extra visible positions after kv_lens
    # DP attention (host ints): every attention rank's token count this forward, so that each MoE layer can
    # gather and scatter the ranks' rows (None: every rank runs as many tokens as this batch; no DP attention).
    # Read on the host only (never inside the compiled layer: the tensors below carry what the layer needs).
    dp_tokens: tuple[int, ...] | None = None
    # DP attention, where the counts differ: which rows of the all-gathered [ranks * max(dp_tokens)] are real,
    # and an empty int64 tensor of max(dp_tokens) - T elements, the padding this rank adds before the all-gather
    # (a tensor's size, not an int: the compiled layer sees a symbolic size, not a value to guard on per step)
    dp_real_rows: torch.Tensor | None = None
    dp_pad: torch.Tensor | None = None
    # DP attention: the (batch-size bucket, context bucket) of the graph every rank replays for this forward, chosen
    # by rank 0 for all ranks (`parallel.dp_attention.step_graph`); None: every rank runs uncaptured
    dp_graph: tuple[int, int] | None = None
    # Two-batch overlap (models/two_batch.py): the tokens of the first of the two micro-batches the MoE layers
    # interleave (`micro_batches`; None: one batch), and in an uncaptured DP step every rank's (whose rows then
    # differ; None in a graph's static batch: every rank splits the bucket alike)
    two_batches: int | None = None
    dp_two_batches: tuple[int, ...] | None = None

    def for_dp_attention(self, dp_tokens: tuple[int, ...], graph: tuple[int, int] | None = None,
                         two_batches: tuple[int, ...] | None = None, rank: int = 0) -> "ForwardBatch":
        """This batch as one attention rank's part of a DP-attention step whose ranks run `dp_tokens` tokens (and,
        with `graph`, replay the graph of its kind at those buckets: every rank's rows are then the bucket's, all taken
        as real inside the graph, the padding rows at the dummy slot). `two_batches`: every rank's first micro-batch
        (tokens) of an uncaptured step split for two-batch overlap; this batch is rank `rank`'s."""
        if graph is not None:
            return dataclasses.replace(self, dp_tokens=tuple(dp_tokens), dp_graph=tuple(graph))
        most = max(dp_tokens)
        real = pad = None
        if any(n != most for n in dp_tokens):
            device = self.input_ids.device
            real = ints_to_device([r * most + i for r, n in enumerate(dp_tokens) for i in range(n)], device)
            pad = torch.empty(most - self.num_tokens, dtype=torch.int64, device=device)
        split = {} if two_batches is None else dict(two_batches=two_batches[rank], dp_two_batches=tuple(two_batches))
        return dataclasses.replace(self, dp_tokens=tuple(dp_tokens), dp_real_rows=real, dp_pad=pad, **split)

    def micro_batches(self) -> tuple["ForwardBatch", "ForwardBatch"]:
        """The two micro-batches of `two_batches`: its first tokens, and the rest, each a batch of its own (its
        request rows, its tokens' request index re-based) with its own attention and indexer inputs, and in an
        uncaptured DP step its own exchange layout (every rank's rows in it). A request may be cut in two: its later
        tokens, in the second micro-batch, see the keys its earlier ones stored (the first micro-batch runs each
        layer's attention first). Logits are the whole batch's (the model's head runs on the joined rows), so the
        halves carry none. Either may be empty on a rank (an idle rank's one dummy token)."""
        t = self.two_batches
        if t is None:
            raise ValueError("micro_batches: the batch is not split for two-batch overlap")
        if self.dp_tokens is None:  # a graph's static batch: as many tokens per request (host sizes)
            lens = [self.num_tokens // max(1, self.batch_size)] * self.batch_size
        else:
            lens = self.extend_lens.tolist()  # an uncaptured step: one small copy to the host
        starts = list(itertools.accumulate(lens, initial=0))
        b = bisect.bisect_right(starts, t) - 1 if t < starts[-1] else len(lens)  # the request holding token t
        k = t - starts[b] if b < len(lens) else 0  # its tokens in the first micro-batch
        seq_first, ext_first = self.seq_lens[:b + bool(k)], self.extend_lens[:b + bool(k)]
        ext_second = self.extend_lens[b:]
        if k:  # request b is cut: k tokens in the first micro-batch, the rest in the second
            seq_first, ext_first, ext_second = seq_first.clone(), ext_first.clone(), ext_second.clone()
            seq_first[-1] -= lens[b] - k
            ext_first[-1] = k
            ext_second[0] -= k

        def part(tokens: slice, requests: slice, seq_lens, extend_lens, token_req) -> "ForwardBatch":
            return dataclasses.replace(
                self, input_ids=self.input_ids[tokens], positions=self.positions[tokens],
                out_cache_loc=self.out_cache_loc[tokens], req_pool_indices=self.req_pool_indices[requests],
                seq_lens=seq_lens, extend_lens=extend_lens, token_req=token_req, kv_lens=self.kv_lens[tokens],
                logits_indices=self.logits_indices[:0], two_batches=None, dp_two_batches=None,
                tree_mask=None if self.tree_mask is None else self.tree_mask[tokens])

        first = part(slice(None, t), slice(None, b + bool(k)), seq_first, ext_first, self.token_req[:t])
        second = part(slice(t, None), slice(b, None), self.seq_lens[b:], ext_second, self.token_req[t:] - b)
        if self.dp_two_batches is not None:  # each micro-batch's exchange: every rank's rows in it
            firsts = self.dp_two_batches
            first = first.for_dp_attention(firsts)
            second = second.for_dp_attention(tuple(n - a for n, a in zip(self.dp_tokens, firsts)))
        return first, second

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def token_rows(self) -> torch.Tensor:
        """req_to_token row of each token."""
        return self.req_pool_indices[self.token_req]

    @classmethod
    def build(
        cls,
        kind: StepKind,
        input_ids: list[int] | torch.Tensor,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        device: torch.device | str,
        logits: str = "last",
        positions: list[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        kv_lens: list[int] | torch.Tensor | None = None,
        max_kv_len: int | None = None,
    ) -> "ForwardBatch":
        """Batch of requests each appending `extend_lens[b]` tokens after `prefix_lens[b]` cached ones.

        `logits`: "last" (one row per request), "all" (every token) or "none".
        Default positions and kv_lens are causal: token i of request b sits at
        row position prefix_lens[b] + i and sees everything before it. Tree
        steps pass their own positions / kv_lens / tree_mask, and `max_kv_len`
        when their tokens see row positions beyond prefix + extend.
        """
        assert len(req_pool_indices) == len(prefix_lens) == len(extend_lens)
        token_req, pos, kv = [], [], []
        for b, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
            token_req += [b] * n
            pos += range(p, p + n)
            kv += range(p + 1, p + n + 1)
        num_tokens = len(token_req)
        assert len(input_ids) == num_tokens, (len(input_ids), num_tokens)
        assert out_cache_loc.numel() == num_tokens, (out_cache_loc.numel(), num_tokens)
        if logits == "last":
            logits_idx = list(itertools.accumulate(extend_lens))
            logits_idx = [e - 1 for e in logits_idx]
        elif logits == "all":
            logits_idx = list(range(num_tokens))
        else:
            logits_idx = []
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        # Every host-built field in one pinned buffer, one non-blocking copy.
        host: dict[str, list[int] | torch.Tensor] = {
            "req_pool_indices": list(req_pool_indices), "seq_lens": seq_lens, "extend_lens": list(extend_lens),
            "token_req": token_req, "logits_indices": logits_idx}
        on_device: dict[str, torch.Tensor] = {}
        for name, value in (("input_ids", input_ids), ("positions", pos if positions is None else positions),
                            ("kv_lens", kv if kv_lens is None else kv_lens)):
            if isinstance(value, torch.Tensor):
                on_device[name] = value.to(device=device, dtype=torch.int64)
            else:
                host[name] = list(value)
        sizes = [len(v) for v in host.values()]
        flat = ints_to_device([x for v in host.values() for x in v], device).split(sizes)
        fields = dict(zip(host, flat), **on_device)
        return cls(
            kind=kind,
            input_ids=fields["input_ids"],
            positions=fields["positions"],
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            req_pool_indices=fields["req_pool_indices"],
            seq_lens=fields["seq_lens"],
            extend_lens=fields["extend_lens"],
            token_req=fields["token_req"],
            kv_lens=fields["kv_lens"],
            logits_indices=fields["logits_indices"],
            max_kv_len=max(seq_lens, default=0) if max_kv_len is None else max_kv_len,
            tree_mask=None if tree_mask is None else tree_mask.to(device),
        )
