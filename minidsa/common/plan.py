"""What crosses from the control plane (engine, scheduler) to the worker and back: `StepPlan`, `StepResult`, and
`StepKind`, the one name of what a step or a forward is (plans, `ForwardBatch`, CUDA graphs).

Plain data only (ints, lists, SamplingParams structs): a plan can be pickled and broadcast to every rank
of a tensor-parallel group, and each rank's `Worker.execute(plan)` does the same thing. The control plane
never touches a device tensor; the worker never sees a `Request`.

A plan lists the requests of one forward in batch order. Request b owns row `rows[b]` of req_to_token,
has `prefix_lens[b]` positions cached before the step and runs `extend_lens[b]` tokens after them:
- a prefill chunk: its tokens are in `input_ids` (host-known prompt / recomputed output tokens);
- a decode row (`from_device[b]`, one token): its input is the token the worker sampled for that row
  in an earlier step, kept on the device (so a step can be planned before the previous one has
  delivered its tokens to the host: overlapped scheduling).
`sample[b]`: the last position's logits are sampled (a completed prefill or a decode row).
`grammar_rows`: the sampled rows a grammar constrains (structured outputs). Their masks depend on the tokens of
the step before, which the plan is made without: they come to `Worker.launch_sampling` as a bitmask, after the
forward was launched.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minidsa.common.request import SamplingParams


class StepKind(enum.IntEnum):
    """What a step plan or a forward is. A plan is EXTEND, DECODE or SPEC; the worker's forwards are EXTEND, DECODE,
    VERIFY, DRAFT and DRAFT_EXTEND (a SPEC plan runs several of them); the captured CUDA graphs are keyed by it."""

    EXTEND = 0  # prefill chunks; decode rows may ride along in the same forward (a mixed step: `has_decode_rows`)
    DECODE = 1  # one device-fed token per request: CUDA graphs where a bucket fits
    SPEC = 2  # plan level: one speculative round (draft, verify, accept, draft extend) per request
    VERIFY = 3  # the target model scores every draft token of a round at once
    DRAFT = 4  # the MTP layer's decode steps (draft tokens)
    DRAFT_EXTEND = 5  # the MTP layer catches up on the positions the target just cached

    @property
    def runs_mtp(self) -> bool:
        """A forward of this kind runs the MTP layer (fed the target's hidden states), not the main model."""
        return self in (StepKind.DRAFT, StepKind.DRAFT_EXTEND)


@dataclass(frozen=True)
class TableWrite:
    """Row positions [first_page * page_size, (first_page + len(pages)) * page_size) of req_to_token row `row`
    map onto `pages` (the worker writes their slots; the scheduler only decides them)."""

    row: int
    first_page: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class PromptScoring:
    """Prompt logprobs one prefill chunk produces for a request: hidden row `first_row + i` of the request's
    chunk predicts `targets[i]`; `top` alternatives each."""

    first_row: int
    targets: tuple[int, ...]
    top: int


@dataclass(frozen=True)
class StepPlan:
    kind: StepKind  # EXTEND, DECODE or SPEC
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]  # the host-known tokens, concatenated in batch order (decode rows have none here)
    from_device: list[bool]
    sample: list[bool]
    params: list[SamplingParams]  # per request (only sampled rows' are read)
    output_positions: list[int]  # per request: index among its outputs of the token sampled (seeded noise key)
    table_writes: list[TableWrite] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # names only (statistics, test collaborators)
    # per request, only where penalties are on: (prompt ids, output ids so far); such plans are never overlapped
    penalty_context: list[tuple[list[int], list[int]] | None] | None = None
    prompt_scoring: list[PromptScoring | None] | None = None
    spec_roots: list[int] | None = None  # SPEC: each request's last committed token (the tree's root)
    # EXTEND under speculation, per request: the token after the chunk when it is known (the first token of
    # the next chunk), for the draft layer's catch-up; None where the chunk completes the prefill
    spec_lookahead: list[int | None] | None = None
    grammar_rows: list[int] | None = None  # plan indices of sampled rows a grammar masks (None: none)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def has_decode_rows(self) -> bool:
        """Some request runs a device-fed decode token: every request of a DECODE plan, the decode rows riding
        along with prefill chunks in an EXTEND plan (a mixed step)."""
        return any(self.from_device)


@dataclass
class StepResult:
    """Per request of the plan, in its order."""

    tokens: list[list[int]]  # new tokens: [] (prefill chunk not complete), [t] (sampled), several (speculation)
    logprobs: list[list[float]] | None = None  # when any request asked
    top_logprobs: list[list[dict[int, float]]] | None = None
    prompt_logprobs: list[tuple[list[float], list[dict[int, float]]] | None] | None = None
