"""MTP speculative decoding: draft with the nextn layer, verify with the target, accept, catch up.

One round for a batch of decoding requests (n = tokens in the target cache,
the root = the last committed token, at row position n, not yet cached):

1. draft: the root's children are the draft's top-k at the last committed
   position (kept from the previous draft extend); `num_steps - 1` DRAFT
   forwards of the MTP layer grow them into beams;
2. build a tree of `num_draft_tokens` nodes (best cumulative draft scores);
3. VERIFY: all nodes in one forward, node k at row position n + k,
   RoPE position n + depth, seeing `[0, n)` plus its ancestors and itself, in
   the indexer's top-k as well as in attention;
4. accept: greedy longest match, or rejection sampling;
5. compaction (trees): the accepted path's KV, MLA and indexer caches of
   every layer, moves to row positions n, n+1, ... with one KV-move; hidden
   states are gathered the same way;
6. DRAFT_EXTEND: the MTP layer runs over the accepted positions (pairing the
   target's hidden state at position i with the token at i + 1), refreshing
   its cache and producing the next round's root children.

Chains (topk = 1, what deployments run) take a path where a round is a few graph replays and one host sync:
every draft token sits at its final row position, so each forward is causal (no tree mask), acceptance is a
handful of batched tensor ops, nothing moves, and the draft extend runs over all `num_draft_tokens` positions
(positions past the accepted ones are rewritten by the next round before anything reads them), so it needs no
host value either. The accepted tokens reach the host once, after the draft extend is enqueued. Trees keep the
host-built tree (EAGLE-2 selection) and per-request acceptance.

The draft state of every req_to_token row (the draft's logits for the token after the root, and its hidden
state at the last committed position) lives in device buffers indexed by row.

The scheduler decides which requests run; this module decides which tokens they run; the runner runs the
forwards, reached through the narrow `SpecRunner` interface (runner_api.py). Every out_cache_loc layout comes from
`layout.SpecLayout`.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

import torch

from minidsa.common.batch import ForwardBatch, ints_to_device
from minidsa.common.plan import StepKind
from minidsa.common.request import SamplingParams
from minidsa.common.sampling import Sampler, TokenMask, probabilities, row_key, uniforms
from minidsa.config import SpecOptions
from minidsa.models.deepseek_v32 import ModelOutput
from minidsa.speculative.layout import SpecLayout
from minidsa.speculative.runner_api import SpecRunner
from minidsa.speculative.tree import DraftTree, accept_greedy, accept_sampled, grow_tree

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecRows:
    """The requests of one speculative round, as plain data (from the step plan)."""

    rows: list[int]  # req_to_token rows
    seq_lens: list[int]  # cached positions; the root sits at row position seq_len
    roots: list[int]  # the last committed token of each request (not yet cached)
    params: list[SamplingParams]
    output_positions: list[int]  # index among the request's outputs of the first token this round emits
    request_ids: list[str]
    # Structured outputs: these requests take no draft this round; their one token is sampled from the verify's
    # first position under their grammar's mask (`mask`: packed int32 [len(constrained), ceil(V / 32)] on the
    # device), as a plain decode step would
    constrained: list[int] = field(default_factory=list)
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class SpecStats:
    verify_steps: int = 0
    draft_tokens: int = 0  # draft tokens proposed (nodes other than the root)
    accepted_tokens: int = 0  # draft tokens accepted
    per_request: dict[str, list[int]] = field(default_factory=dict)  # request id -> accepted length per round


class AcceptanceSimulator:
    """Benchmark-only: how many drafts each request's round accepts so that a round yields `accept_len` tokens on
    average (SGLang's SGLANG_SIMULATE_ACC_LEN). floor(L - 1) drafts, one more with probability frac(L - 1): the
    mean is exact, the spread the smallest possible. Its own seeded RNG keeps runs repeatable."""

    def __init__(self, accept_len: float, num_steps: int, seed: int):
        self.accept_len = accept_len
        self.num_steps = num_steps
        self.rng = random.Random(seed)

    def draw(self, bs: int) -> list[int]:
        mean = self.accept_len - 1.0
        lo = math.floor(mean)
        return [min(self.num_steps, lo + (self.rng.random() < mean - lo)) for _ in range(bs)]


# Keys of the acceptance draws of sampled rows: another hash stream than the sampling noise of the same key.
_ACCEPT_SALT = 0x5DEECE66D


class MTPSpeculator:
    def __init__(self, runner: SpecRunner, options: SpecOptions, sampler: Sampler, seed: int = 0):
        self.runner = runner
        self.opts = options
        self.sampler = sampler
        self.layout = SpecLayout(options.num_steps, options.topk, options.num_draft_tokens)
        self.stats = SpecStats()
        mc, dev = runner.model_config, runner.device
        rows = runner.num_rows
        # Per req_to_token row, what its next round starts from (rewritten whenever a prefill completes on it).
        self.draft_logits = torch.zeros(rows, mc.vocab_size, dtype=torch.float32, device=dev)
        self.draft_hidden = torch.zeros(rows, mc.hidden_size, dtype=runner.dtype, device=dev)
        self._has_state: set[int] = set()
        self.simulator = (AcceptanceSimulator(options.simulate_accept_len, options.num_steps, seed)
                          if options.simulate_accept_len else None)

    @property
    def reserved_tokens(self) -> int:
        """Row positions past the cached ones each decoding request must hold slots for."""
        return self.opts.reserved_tokens

    def _keep_state(self, rows: list[int], rows_t: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self.draft_logits[rows_t] = logits.float()
        self.draft_hidden[rows_t] = hidden
        self._has_state.update(rows)

    # ------------------------------------------------------------------ prefill
    def on_extend(self, rows: list[int], batch: ForwardBatch, out: ModelOutput,
                  lookahead: list[int | None]) -> None:
        """Run the MTP layer over the positions an EXTEND forward just cached.

        The MTP input at position i pairs the target's hidden state at i with the token at i + 1:
        the next token of the chunk, then `lookahead[b]`: the first token of the request's next chunk,
        or (prefill complete) the token just sampled, or None (nothing follows: max_tokens 0). A request
        whose prefill completed gets its draft state.
        """
        ids, prefix, extend, hidden_rows, finals = [], [], [], [], []
        start = 0
        token_ids = batch.input_ids.tolist()
        for b in range(len(rows)):
            n = int(batch.extend_lens[b])
            p = int(batch.seq_lens[b]) - n
            shifted = token_ids[start + 1:start + n]
            nxt = lookahead[b]
            if nxt is not None:
                shifted = shifted + [int(nxt)]
            if shifted:
                ids += shifted
                prefix.append(p)
                extend.append(len(shifted))
                hidden_rows.append(torch.arange(start, start + len(shifted)))
                finals.append(b)
            start += n
        if not extend:
            return
        mtp_rows = [rows[b] for b in finals]
        loc = SpecLayout.draft_extend_cache_loc(self.runner.req_to_token, mtp_rows, prefix, extend)
        mtp_batch = ForwardBatch.build(StepKind.DRAFT_EXTEND, ids, mtp_rows, prefix, extend, loc,
                                       self.runner.device, logits="last")
        sel = torch.cat(hidden_rows).to(out.hidden.device)
        reuse = out.topk[sel] if out.topk is not None else None  # same positions, same visibility
        mout = self.runner.forward_mtp(mtp_batch, out.hidden[sel], reuse)
        # the last state is what the next round needs; a partial chunk's is overwritten by its next chunk
        self._keep_state(mtp_rows, mtp_batch.req_pool_indices, mout.logits, mout.hidden[mtp_batch.logits_indices])

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, reqs: SpecRows) -> list[list[int]]:
        """One speculative round; returns the new tokens of each request (accepted drafts + 1). The root and
        the accepted drafts are cached afterwards: the caller advances each request by len(tokens)."""
        for row, rid in zip(reqs.rows, reqs.request_ids):
            assert row in self._has_state, f"request {rid} (row {row}) has no draft state"
        if self.opts.topk == 1:
            return self._chain_round(reqs)
        dev = self.runner.device
        rows = torch.tensor(reqs.rows, device=dev)
        seq = torch.tensor(reqs.seq_lens, device=dev)
        trees = self._draft_tree(reqs, rows, seq)
        return self._verify_tree(reqs, rows, seq, trees)

    def propose(self, reqs: SpecRows, depth: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's proposals at `depth` (1 = the root's children): (tokens, log-probs), each [bs, m] with
        m = k at depth 1 and k*k (beam-major) deeper: the top-k children of every row of `logits`."""
        bs = len(reqs)
        if self.opts.topk == 1:  # a chain needs only the argmax; its score is never read
            toks = logits.argmax(dim=-1).view(bs, -1)
            return toks, torch.zeros_like(toks, dtype=torch.float32)
        logp = torch.log_softmax(logits.float(), dim=-1)
        vals, toks = logp.topk(self.opts.topk, dim=-1)
        return toks.reshape(bs, -1), vals.reshape(bs, -1)

    # ------------------------------------------------------------------ chains
    def _chain_round(self, reqs: SpecRows) -> list[list[int]]:
        runner, lay, opts = self.runner, self.layout, self.opts
        dev, bs, steps, nd = runner.device, len(reqs), opts.num_steps, opts.num_draft_tokens
        rows_t, seq_t, roots = ints_to_device(reqs.rows + reqs.seq_lens + reqs.roots, dev).split(bs)
        rows, seq = reqs.rows, reqs.seq_lens

        # Draft: depth 1 from the kept state, then steps - 1 causal MTP decodes, each token at its final position.
        drafts = [self.propose(reqs, 1, self.draft_logits[rows_t])[0].view(bs)]
        hidden = self.draft_hidden[rows_t]
        if steps > 1:
            steps_loc = lay.draft_steps_view(lay.draft_cache_loc(runner.req_to_token, rows_t, seq_t), bs)
            prev_topk = None
            for f in range(steps - 1):
                batch = ForwardBatch.build(StepKind.DRAFT, drafts[-1], rows, [n + f for n in seq], [1] * bs,
                                           steps_loc[f], dev)
                out = runner.forward_mtp(batch, hidden, prev_topk)
                if opts.share_topk_across_steps:
                    prev_topk = out.topk
                drafts.append(self.propose(reqs, f + 2, out.logits)[0].view(bs))
                hidden = out.hidden
        drafted = torch.stack(drafts, 1)  # [bs, steps]

        # Verify: root + drafts, causal, at row positions n .. n + steps.
        loc = lay.verify_cache_loc(runner.req_to_token, rows_t, seq_t)
        ids = torch.cat([roots.view(bs, 1), drafted], 1).view(-1)
        verify = ForwardBatch.build(StepKind.VERIFY, ids, rows, seq, [nd] * bs, loc, dev, logits="all")
        out = runner.forward(verify)
        accepted, emitted = self._accept_chain(reqs, drafted, out.logits.view(bs, nd, -1))
        if reqs.constrained:
            first = self._constrained_tokens(reqs, out.logits.view(bs, nd, -1)[:, 0])
            sel = ints_to_device(reqs.constrained, dev)
            accepted[sel] = 0
            emitted[sel] = first.unsqueeze(1).expand(-1, nd)

        # Draft extend over all nd positions (target hidden at n + j with the token at n + j + 1); the next
        # round's state comes from position n + accepted.
        extend = ForwardBatch.build(StepKind.DRAFT_EXTEND, emitted.view(-1), rows, seq, [nd] * bs, loc, dev)
        extend.logits_indices = torch.arange(bs, device=dev) * nd + accepted
        reuse = out.topk if opts.topk == 1 and not runner.has_draft_extend_graph else None
        mout = runner.forward_mtp(extend, out.hidden, reuse)
        self._keep_state(rows, rows_t, mout.logits, mout.hidden[extend.logits_indices])

        host = torch.cat([accepted.view(bs, 1), emitted], 1).cpu().tolist()  # the round's one host sync
        new_tokens = [toks[:1 + a] for a, *toks in host]
        self._count(reqs, [a for a, *_ in host], nd)
        return new_tokens

    def _accept_chain(self, reqs: SpecRows, drafted: torch.Tensor, logits: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted drafts [bs], emitted tokens [bs, nd]): emitted[:, :accepted] are the accepted drafts,
        emitted[:, accepted] the target's next token; later columns are placeholders (the draft extend's inputs at
        positions the next round rewrites)."""
        bs, steps = drafted.shape
        dev = drafted.device
        target = logits.argmax(dim=-1)  # [bs, nd]: greedy rows' next token at every position
        sampled_rows = [b for b, p in enumerate(reqs.params) if not p.greedy]
        if sampled_rows:
            accept_mask, target = self._rejection_sample(reqs, drafted, logits, target, sampled_rows)
        else:
            accept_mask = drafted == target[:, :steps]
        if self.simulator is not None:
            accepted = ints_to_device(self.simulator.draw(bs), dev)
        else:
            accepted = accept_mask.to(torch.int64).cumprod(dim=1).sum(dim=1)
        cols = torch.arange(steps + 1, device=dev).unsqueeze(0)
        padded = torch.cat([drafted, target[:, steps:]], 1)
        emitted = torch.where(cols < accepted.unsqueeze(1), padded, target.gather(1, accepted.unsqueeze(1)))
        return accepted, emitted

    def _rejection_sample(self, reqs: SpecRows, drafted: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                          sampled_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling against one-hot drafts, every position at once (sampled rows; greedy rows compare
        argmaxes). Draft d at position j is accepted with probability p_j(d); the token after the accepted ones is
        drawn from p_j with the rejected draft removed (renormalised), or from p at the last position when every
        draft was accepted, so each emitted token follows the target distribution exactly. Draws are keyed by
        (seed, output position) like the plain sampler's, so seeded requests repeat."""
        bs, nd, vocab = logits.shape
        steps = nd - 1
        dev = logits.device
        sel = torch.tensor(sampled_rows, device=dev)
        params = [reqs.params[b] for b in sampled_rows for _ in range(nd)]
        positions = [reqs.output_positions[b] + j for b in sampled_rows for j in range(nd)]
        sb = self.sampler.batch(params, positions)
        p = probabilities(logits[sel].reshape(-1, vocab), sb).view(len(sampled_rows), nd, vocab)
        d = drafted[sel]
        p_draft = p[:, :steps].gather(2, d.unsqueeze(2)).squeeze(2)  # [m, steps]
        u = uniforms(sb.keys ^ _ACCEPT_SALT).view(-1, nd)[:, :steps]
        residual = p.clone()
        residual[:, :steps].scatter_(2, d.unsqueeze(2), 0.0)
        draw = self.sampler.race(torch.log(residual.view(-1, vocab)), torch.ones_like(sb.temperature), sb.keys,
                                 torch.zeros_like(sb.greedy)).view(-1, nd)
        accept_mask = drafted == target[:, :steps]
        accept_mask[sel] = u < p_draft
        target = target.clone()
        target[sel] = draw
        return accept_mask, target

    def _constrained_tokens(self, reqs: SpecRows, first_logits: torch.Tensor) -> torch.Tensor:
        """The constrained requests' tokens: their verify logits at the root's position (the target's next-token
        logits, as a decode step computes them), masked by their grammars and sampled as the plain sampler does."""
        rows = reqs.constrained
        logits = first_logits[ints_to_device(rows, first_logits.device)].float()
        mask = TokenMask(reqs.mask, torch.arange(len(rows), device=logits.device))
        return self.sampler(logits, [reqs.params[b] for b in rows], [reqs.output_positions[b] for b in rows],
                            mask=mask).ids

    def _count(self, reqs: SpecRows, accepted: list[int], nd: int) -> None:
        for rid, a in zip(reqs.request_ids, accepted):
            self.stats.verify_steps += 1
            self.stats.draft_tokens += nd - 1
            self.stats.accepted_tokens += a
            self.stats.per_request.setdefault(rid, []).append(a)

    # ------------------------------------------------------------------ trees
    def _draft_tree(self, reqs: SpecRows, rows: torch.Tensor, seq: torch.Tensor) -> list[DraftTree]:
        runner, lay, opts = self.runner, self.layout, self.opts
        bs, k, dev = len(reqs), opts.topk, runner.device
        toks, vals = self.propose(reqs, 1, self.draft_logits[rows])  # [bs, k]
        step_lp = [[vals[b:b + 1]] for b in range(bs)]
        step_tok = [[toks[b:b + 1]] for b in range(bs)]
        # beams feeding each depth, as flat candidate ids of the depth before (depth 1: all k)
        step_par: list[list] = [[None, torch.arange(k)] for _ in range(bs)]
        if opts.num_steps > 1:
            flat = lay.draft_cache_loc(runner.req_to_token, rows, seq)
            steps_loc = lay.draft_steps_view(flat, bs)
            hidden = self.draft_hidden[rows].repeat_interleave(k, 0)  # [bs*k, H]
            beam_tok, beam_score = toks.reshape(-1), vals.reshape(-1)  # [bs*k]
            # scratch ancestry of each beam: [bs*k, steps*k] bits over the draft region
            ancestry = torch.zeros(bs * k, lay.draft_width, dtype=torch.bool, device=dev)
            n_max = max(reqs.seq_lens)
            for f in range(opts.num_steps - 1):
                own = lay.draft_step_positions(f, seq) - seq.repeat_interleave(k)  # = f*k + j
                ancestry[torch.arange(bs * k, device=dev), own] = True
                batch = ForwardBatch.build(
                    StepKind.DRAFT, beam_tok, reqs.rows, reqs.seq_lens, [k] * bs, steps_loc[f], dev,
                    logits="all", positions=(seq + f).repeat_interleave(k), kv_lens=seq.repeat_interleave(k),
                    tree_mask=ancestry, max_kv_len=n_max + lay.draft_width)
                out = runner.forward_mtp(batch, hidden, None)
                ch, lp = self.propose(reqs, f + 2, out.logits)  # [bs, k*k]
                cum = beam_score.unsqueeze(1) + lp.view(bs * k, k)
                cum_b, ch_b = cum.view(bs, k, k), ch.view(bs, k, k)
                for b in range(bs):
                    step_lp[b].append(cum_b[b])
                    step_tok[b].append(ch_b[b])
                # next beams: the k best of the k*k expanded candidates of each request
                best = cum_b.view(bs, k * k).topk(k, dim=-1).indices  # [bs, k] flat candidate ids
                for b in range(bs):
                    step_par[b].append(best[b])
                parent_beam = best // k  # which beam each new beam extends
                gather = (torch.arange(bs, device=dev).unsqueeze(1) * k + parent_beam).reshape(-1)
                beam_tok = ch_b.view(bs, k * k).gather(1, best).reshape(-1)
                beam_score = cum_b.view(bs, k * k).gather(1, best).reshape(-1)
                hidden = out.hidden[gather]
                ancestry = ancestry[gather].clone()
        trees = []
        for b, root in enumerate(reqs.roots):
            tree = grow_tree(root, step_lp[b], step_par[b], step_tok[b], opts.num_draft_tokens)
            trees.append(tree.padded(opts.num_draft_tokens, pad_token=0) if tree.size < opts.num_draft_tokens else tree)
        return trees

    def _verify_tree(self, reqs: SpecRows, rows: torch.Tensor, seq: torch.Tensor,
                     trees: list[DraftTree]) -> list[list[int]]:
        runner, lay = self.runner, self.layout
        dev, bs, nd = runner.device, len(reqs), self.opts.num_draft_tokens
        ids = torch.tensor([t for tr in trees for t in tr.tokens], device=dev)
        depth = torch.tensor([d for tr in trees for d in tr.depths()], device=dev)
        mask = torch.cat([tr.ancestor_mask() for tr in trees]).to(dev)  # [bs*nd, nd]
        loc = lay.verify_cache_loc(runner.req_to_token, rows, seq)
        n_rep = seq.repeat_interleave(nd)
        batch = ForwardBatch.build(
            StepKind.VERIFY, ids, reqs.rows, reqs.seq_lens, [nd] * bs, loc, dev, logits="all",
            positions=n_rep + depth, kv_lens=n_rep, tree_mask=mask, max_kv_len=max(reqs.seq_lens) + nd)
        out = runner.forward(batch)
        logits = out.logits.view(bs, nd, -1)

        forced = {}
        if reqs.constrained:
            forced = dict(zip(reqs.constrained, self._constrained_tokens(reqs, logits[:, 0]).tolist()))
        paths, new_tokens = self._accept_tree(reqs, trees, logits, forced)

        # Compaction: accepted nodes to the front.
        src, dst = lay.compaction_moves(runner.req_to_token, reqs.rows, reqs.seq_lens, paths)
        if src.numel():
            runner.move_kv(src, dst)
        hid_rows = torch.cat([torch.tensor(p, device=dev) + b * nd for b, p in enumerate(paths)])
        hidden = out.hidden[hid_rows]
        self._count(reqs, [len(p) - 1 for p in paths], nd)

        # Draft extend: pair target hidden at n + m with the token at n + m + 1.
        ext_batch, hidden = self._draft_extend_batch(reqs.rows, reqs.seq_lens, new_tokens, hidden)
        mout = runner.forward_mtp(ext_batch, hidden, None)
        self._keep_state(reqs.rows, rows, mout.logits, mout.hidden[ext_batch.logits_indices])
        return new_tokens

    def _draft_extend_batch(self, rows: list[int], seq: list[int], new_tokens: list[list[int]],
                            hidden: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
        """The DRAFT_EXTEND batch over each request's accepted positions [n, n + len(tokens)).

        When the runner has a draft-extend graph, every request is padded to
        num_draft_tokens tokens (static shape); pad tokens write the dummy slot 0,
        see one position, and their outputs are ignored.
        """
        runner, dev = self.runner, self.runner.device
        lens = [len(t) for t in new_tokens]
        loc = SpecLayout.draft_extend_cache_loc(runner.req_to_token, rows, seq, lens)
        ids = [t for toks in new_tokens for t in toks]
        if not runner.has_draft_extend_graph:
            return ForwardBatch.build(StepKind.DRAFT_EXTEND, ids, rows, seq, lens, loc, dev, logits="last"), hidden
        nd = self.opts.num_draft_tokens
        real = torch.tensor([b * nd + m for b, n in enumerate(lens) for m in range(n)], device=dev)
        pad_ids = torch.zeros(len(rows) * nd, dtype=torch.int64, device=dev)
        pad_ids[real] = torch.tensor(ids, device=dev)
        pad_loc = torch.zeros_like(pad_ids)
        pad_loc[real] = loc
        positions = torch.zeros_like(pad_ids)
        positions[real] = torch.tensor([n + m for n, k in zip(seq, lens) for m in range(k)], device=dev)
        kv_lens = torch.ones_like(pad_ids)
        kv_lens[real] = positions[real] + 1
        batch = ForwardBatch.build(StepKind.DRAFT_EXTEND, pad_ids, rows, seq, [nd] * len(rows), pad_loc, dev,
                                   positions=positions, kv_lens=kv_lens, max_kv_len=max(seq) + nd)
        batch.logits_indices = torch.tensor([b * nd + n - 1 for b, n in enumerate(lens)], device=dev)
        pad_hidden = hidden.new_zeros(len(rows) * nd, hidden.shape[-1])
        pad_hidden[real] = hidden
        return batch, pad_hidden

    def _accept_tree(self, reqs: SpecRows, trees: list[DraftTree], logits: torch.Tensor,
                     forced: dict[int, int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per request: the accepted path from the root and the tokens emitted. `forced`: requests that take no
        draft, with their token."""
        paths, new_tokens = [], []
        greedy_rows = [b for b, p in enumerate(reqs.params) if p.greedy]
        argmax = logits[greedy_rows].argmax(-1).tolist() if greedy_rows else []
        sampled_rows = [b for b, p in enumerate(reqs.params) if not p.greedy]
        probs = {}
        if sampled_rows:
            nd = logits.shape[1]
            params = [reqs.params[b] for b in sampled_rows for _ in range(nd)]
            positions = [reqs.output_positions[b] for b in sampled_rows for _ in range(nd)]
            sb = self.sampler.batch(params, positions)
            p = probabilities(logits[sampled_rows].reshape(len(sampled_rows) * nd, -1), sb)
            for i, b in enumerate(sampled_rows):
                probs[b] = p[i * nd:(i + 1) * nd].cpu()
        g = iter(argmax)
        for b, (p, pos, tree) in enumerate(zip(reqs.params, reqs.output_positions, trees)):
            if b in forced:
                path, nxt = [0], forced[b]
                if p.greedy:
                    next(g)
            elif p.greedy:
                path, nxt = accept_greedy(tree, next(g))
            else:
                key = row_key(p.seed, pos) if p.seed is not None \
                    else self.sampler.rng.getrandbits(63)
                gen = torch.Generator().manual_seed(key & ((1 << 63) - 1))
                path, nxt = accept_sampled(tree, probs[b], gen)
            paths.append(path)
            new_tokens.append([tree.tokens[k] for k in path[1:]] + [nxt])
        return paths, new_tokens
