"""Draft trees: growing them from the draft's top-k, and accepting a path against the target.

A tree holds `num_draft_tokens` nodes; node 0 is the root (the last
committed token, not yet in the target cache), every other node is a draft
token whose parent comes before it. Chains (topk = 1) are trees whose node
k has parent k - 1.

Drafts are deterministic (the draft's top-k / argmax), so a draft token's
proposal distribution is one-hot. Rejection sampling against a one-hot
proposal accepts child c with probability p(c) (p = the target's
distribution at the parent after earlier rejected siblings are zeroed and p
renormalised), and on rejecting every child samples from what remains: the
emitted token is distributed exactly as p, so speculation does not change
what a sampled request generates, only how many forwards it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]  # node tokens; node 0 = root
    parents: list[int]  # parent node per node; -1 for the root
    scores: list[float] = field(default_factory=list)  # cumulative draft log-prob (root 0)

    def __post_init__(self):
        assert len(self.tokens) == len(self.parents) and self.parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(self.parents) if i), "parents must precede children"

    @property
    def size(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, self.size) if self.parents[i] == node]

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] = node j is node i or one of its ancestors."""
        n = self.size
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = self.parents[j]
        return mask

    def padded(self, size: int, pad_token: int = 0) -> "DraftTree":
        """Extend to `size` nodes with a chain of never-accepted placeholder nodes.

        Keeps every request of a verify batch at the same node count; a pad node
        hangs off the previous pad (or the root) and carries `pad_token`, which a
        real child of the same parent may also carry, so acceptance skips pads.
        """
        assert size >= self.size
        tokens, parents, scores = list(self.tokens), list(self.parents), list(self.scores or [0.0] * self.size)
        for i in range(self.size, size):
            tokens.append(pad_token)
            parents.append(i - 1 if i > self.size else 0)
            scores.append(float("-inf"))
        return DraftTree(tokens, parents, scores)

    def is_pad(self, node: int) -> bool:
        return bool(self.scores) and self.scores[node] == float("-inf")


def grow_tree(root_token: int, step_logprobs: list[torch.Tensor], beam_parents: list[torch.Tensor],
              beam_tokens: list[torch.Tensor], num_draft_tokens: int) -> DraftTree:
    """Select the `num_draft_tokens - 1` best draft candidates (EAGLE-2 style) into a tree.

    step_logprobs[s]: [topk, topk] cumulative log-probs of the candidates expanded
    at draft depth s + 1 from each of the `topk` beams of depth s (depth 0 has one
    beam: the root, so its row 0 is used only). beam_tokens[s]: [topk, topk] their
    tokens. beam_parents[s]: [topk] which candidate of depth s (flat index into
    step s-1's [topk*topk]) each beam of depth s continues; None-like for s = 0.
    """
    tokens, parents, scores = [root_token], [-1], [0.0]
    cand: list[tuple[float, int, int, int]] = []  # (score, creation order, token, parent candidate id)
    # Candidate ids: flat position in the creation order; beams point at candidate ids.
    beam_cand_ids = [-1]  # depth-0 beam = root (candidate id -1)
    order = 0
    for s, (lp, tok) in enumerate(zip(step_logprobs, beam_tokens)):
        rows = 1 if s == 0 else lp.shape[0]
        ids_this_step = []
        for b in range(rows):
            for c in range(lp.shape[1]):
                cand.append((float(lp[b, c]), order, int(tok[b, c]), beam_cand_ids[b]))
                ids_this_step.append(order)
                order += 1
        if s + 1 < len(step_logprobs):
            sel = beam_parents[s + 1].tolist()
            beam_cand_ids = [ids_this_step[i] for i in sel]
    # Best first; ties broken by creation order, so an ancestor (score >= child's) comes first.
    chosen = sorted(cand, key=lambda c: (-c[0], c[1]))[: num_draft_tokens - 1]
    # Ancestors come first in creation order; a chosen node whose parent was not kept (only possible
    # with -inf / NaN scores) is dropped.
    node_of: dict[int, int] = {}  # kept candidate id -> node index
    for score, cid, token, parent in sorted(chosen, key=lambda c: c[1]):
        if parent == -1 or parent in node_of:
            node_of[cid] = len(tokens)
            tokens.append(token)
            parents.append(0 if parent == -1 else node_of[parent])
            scores.append(score)
    return DraftTree(tokens, parents, scores)


def accept_greedy(tree: DraftTree, target_argmax: list[int]) -> tuple[list[int], int]:
    """Longest path whose every draft token equals the target's argmax at its parent.

    Returns (accepted node path starting with the root 0, bonus token = target argmax at the path's end).
    """
    node, path = 0, [0]
    while True:
        want = target_argmax[node]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want and not tree.is_pad(c)), None)
        if nxt is None:
            return path, want
        node = nxt
        path.append(node)


def accept_sampled(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """Rejection sampling against one-hot draft proposals; preserves the target distribution.

    target_probs: [N, V] fp32, the target's (temperature / top-k / top-p processed)
    distribution at every node. Returns (accepted path from the root, next token).
    """
    node, path = 0, [0]
    while True:
        p = target_probs[node].double().clone()
        moved = False
        for c in tree.children(node):
            if tree.is_pad(c):
                continue
            tok = tree.tokens[c]
            total = p.sum()
            if total <= 0:
                break
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if u * total < p[tok]:
                node, moved = c, True
                path.append(c)
                break
            p[tok] = 0.0  # rejected: the residual max(p - onehot, 0), renormalised by the next draw
        if not moved:
            if p.sum() <= 0:  # every token with mass was a rejected child: cannot happen for a true p
                p = target_probs[node].double()
            token = int(torch.multinomial(p / p.sum(), 1, generator=generator))
            return path, token
