"""The speculative layout helper: round trips, positions, and loud shape errors."""

from __future__ import annotations

import pytest
import torch

from minidsa.speculative.layout import SpecLayout
from minidsa.speculative.tree import DraftTree, accept_greedy, accept_sampled, grow_tree


def table(rows=3, width=64):
    # Distinct slots per (row, position) so any mix-up is visible.
    return (torch.arange(rows).view(-1, 1) * 1000 + torch.arange(width).view(1, -1) + 1).to(torch.int32)


def test_draft_steps_view_round_trips_and_maps_step_i_to_row_i():
    lay = SpecLayout(num_steps=3, topk=2, num_draft_tokens=5)
    r2t, rows, seq = table(), torch.tensor([2, 0]), torch.tensor([10, 4])
    flat = lay.draft_cache_loc(r2t, rows, seq)
    view = lay.draft_steps_view(flat, bs=2)
    assert view.shape == (3, 4)
    assert torch.equal(lay.draft_steps_flat(view), flat)
    for i in range(3):
        pos = lay.draft_step_positions(i, seq)  # request-major: (b0,j0), (b0,j1), (b1,j0), (b1,j1)
        expect = r2t[rows.repeat_interleave(2), pos].long()
        assert torch.equal(view[i], expect)
        assert view[i].data_ptr() == flat[i * 4:].data_ptr()  # a view, not a copy


def test_verify_and_extend_layouts():
    lay = SpecLayout(num_steps=2, topk=1, num_draft_tokens=3)
    r2t, rows, seq = table(), torch.tensor([1, 2]), torch.tensor([5, 7])
    ver = lay.verify_view(lay.verify_cache_loc(r2t, rows, seq), bs=2)
    assert ver.tolist() == [[1006, 1007, 1008], [2008, 2009, 2010]]
    ext = SpecLayout.draft_extend_cache_loc(r2t, [1, 2], [5, 7], [2, 1])
    assert ext.tolist() == [1006, 1007, 2008]


@pytest.mark.parametrize("call", [
    lambda lay: lay.draft_steps_view(torch.zeros(11, dtype=torch.long), bs=2),
    lambda lay: lay.draft_steps_view(torch.zeros(3, 4, dtype=torch.long), bs=2),
    lambda lay: lay.draft_steps_flat(torch.zeros(2, 4, dtype=torch.long)),
    lambda lay: lay.verify_view(torch.zeros(9, dtype=torch.long), bs=2),
    lambda lay: lay.compaction_moves(table(), [0], [3], [[1, 2]]),
])
def test_wrong_shapes_are_rejected(call):
    with pytest.raises(AssertionError):
        call(SpecLayout(num_steps=3, topk=2, num_draft_tokens=5))


def test_compaction_moves_accepted_nodes_to_the_front():
    lay = SpecLayout(num_steps=3, topk=2, num_draft_tokens=6)
    r2t = table()
    src, dst = lay.compaction_moves(r2t, [0, 1], [10, 20], [[0, 2, 5], [0, 1]])
    # request 0: node 2 -> position 11, node 5 -> position 12; request 1: chain prefix, nothing moves
    assert src.tolist() == [13, 16] and dst.tolist() == [12, 13]


def test_grow_tree_picks_best_candidates_with_ancestors_first():
    # topk 2, 3 depths. Root children: a (-0.1), b (-1.0).
    lp = [torch.tensor([[-0.1, -1.0]]),
          torch.tensor([[-0.2, -0.5], [-1.1, -3.0]]),  # children of beams a, b
          torch.tensor([[-0.3, -2.0], [-0.9, -4.0]])]  # children of the 2 best depth-2 candidates
    tok = [torch.tensor([[10, 11]]), torch.tensor([[20, 21], [22, 23]]), torch.tensor([[30, 31], [32, 33]])]
    parents = [None, torch.tensor([0, 1]), torch.tensor([0, 1])]  # depth-2 beams: candidates 0 (20) and 1 (21)
    tree = grow_tree(7, lp, parents, tok, num_draft_tokens=6)
    # Cumulative scores: 10 (-0.1), 20 (-0.2), 30 (-0.3), 21 (-0.5), 32 (-0.9) beat 11 (-1.0).
    assert tree.tokens == [7, 10, 20, 21, 30, 32]
    assert tree.parents == [-1, 0, 1, 1, 2, 3]
    mask = tree.ancestor_mask()
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 4]


def test_greedy_acceptance_walks_the_matching_path():
    tree = DraftTree(tokens=[7, 10, 11, 20, 21, 30], parents=[-1, 0, 0, 1, 1, 3])
    # target argmax per node: root->11? no: root->10, node1->21, node4->99
    path, bonus = accept_greedy(tree, [10, 21, 0, 0, 99, 0])
    assert path == [0, 1, 4] and bonus == 99
    path, bonus = accept_greedy(tree, [12, 0, 0, 0, 0, 0])
    assert path == [0] and bonus == 12
    path, bonus = accept_greedy(tree.padded(8, pad_token=5), [10, 20, 0, 30, 0, 5, 0, 0])
    assert path == [0, 1, 3, 5] and bonus == 5  # pad nodes are never accepted


def test_rejection_sampling_preserves_the_target_distribution():
    """The emitted token after the root is distributed as p(root), whatever the draft proposed."""
    vocab = 6
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    tree = DraftTree(tokens=[0, 1, 3, 2], parents=[-1, 0, 0, 1])  # root children propose 1 and 3
    probs = torch.stack([p, torch.full((vocab,), 1 / vocab), p.flip(0), p])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(vocab)
    for _ in range(n):
        path, nxt = accept_sampled(tree, probs, gen)
        first = tree.tokens[path[1]] if len(path) > 1 else nxt
        counts[first] += 1
    freq = counts / n
    # 4 sigma of a binomial at n = 20000 is < 0.015
    assert (freq - p).abs().max() < 0.015, freq
