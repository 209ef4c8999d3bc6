"""Worker: the only owner of device state. Executes a `StepPlan`, returns a `StepResult`.

It holds the model runner (model, KV caches, req_to_token, CUDA graphs), the sampler and the speculator,
and one more device tensor: `next_input_ids[row]`, the token last sampled for each req_to_token row. A
decode row's input is read from there, so the control plane can plan step N+1 while step N runs
(overlapped scheduling) without knowing step N's tokens.

`launch(plan)` enqueues the step's device work (page-table writes, forward, sampling, the copy of the
sampled ids to pinned host memory) and records one CUDA event; `PendingStep.result()` waits on that
event, the only host sync of a plain step, and turns the ids into lists. `execute(plan)` is both at
once.

A plan with grammar rows (structured outputs) launches in two halves: `launch(plan)` enqueues the forward and
returns the step awaiting its mask; `launch_sampling(pending, bitmask)` copies the rows' packed bitmask (filled
on the host once the previous step's tokens reached the grammars, `mask_buffer` pinned memory) without a host
sync, masks those rows' logits and samples. So the engine launches step N+1's forward before it reads step N's
tokens, as for any step, and only the sampling waits for the mask.

Under tensor parallelism (minidsa/parallel/) every rank holds a Worker built the same way
(`build_worker`) and runs every plan: rank 0's engine broadcasts each plan before launching it, the other
ranks launch it as it arrives. Their forwards meet in the collectives; the all-gathered logits are the same
on every rank, so every rank samples the same tokens (the sampler's keys come from the plan and the shared
seed) and the speculator makes the same choices, without any token travelling back. Only rank 0 reads the
results. Grammar masks are filled on rank 0 only: `_share_mask` broadcasts each step's bitmask from rank 0's
device to the others' over the device group (in stream order, no host sync) before every rank samples.

Steps that need host data mid-step synchronise inside `launch`: a speculative round (trees are built
from draft tokens on the host), prompt logprobs, and the speculator's draft extend after a prefill.
"""

from __future__ import annotations

import logging

import torch

from minidsa.common.batch import ForwardBatch, host_to_device, ints_to_device
from minidsa.common.kv_cache import row_slots
from minidsa.common.plan import PromptScoring, StepKind, StepPlan, StepResult
from minidsa.common.sampling import SampledTokens, Sampler, TokenMask
from minidsa.exec.runner import ModelRunner
from minidsa.models.deepseek_v32 import ModelOutput
from minidsa.sched.pages import KVCapacity
from minidsa.speculative.mtp import SpecRows

logger = logging.getLogger(__name__)


class PendingStep:
    """A launched step: its sampled tokens are on their way to the host (or, `awaits_mask`, its forward ran and
    its sampling waits for `Worker.launch_sampling`)."""

    def __init__(self, plan: StepPlan, sampled: list[int], tokens: SampledTokens | None,
                 prompt_logprobs: list | None, event: "torch.cuda.Event | None",
                 done: StepResult | None = None, forward: tuple[ForwardBatch, ModelOutput] | None = None):
        self.plan = plan
        self._sampled = sampled  # plan indices of the rows that sampled, in the order of `tokens`
        self._tokens = tokens
        self._prompt_logprobs = prompt_logprobs
        self._event = event
        self._done = done
        self.forward = forward  # the batch and model output, until the sampling is launched

    @property
    def awaits_mask(self) -> bool:
        return self.forward is not None

    def result(self) -> StepResult:
        if self._done is not None:
            return self._done
        if self.forward is not None:
            raise RuntimeError("the step's sampling was never launched (Worker.launch_sampling)")
        if self._event is not None:
            self._event.synchronize()  # the one host sync of the step: the tokens are needed now
        n = self.plan.batch_size
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs = top = None
        t = self._tokens
        if t is not None:
            for b, tok in zip(self._sampled, t.ids.tolist()):
                tokens[b] = [tok]
            if t.logprobs is not None:
                logprobs = [[] for _ in range(n)]
                for b, lp in zip(self._sampled, t.logprobs.tolist()):
                    logprobs[b] = [lp]
            if t.top_ids is not None:
                top = [[] for _ in range(n)]
                for b, ids, lps, p in zip(self._sampled, t.top_ids.tolist(), t.top_logprobs.tolist(),
                                          [self.plan.params[b] for b in self._sampled]):
                    top[b] = [dict(zip(ids[:p.top_logprobs], lps[:p.top_logprobs]))]
        self._done = StepResult(tokens, logprobs, top, self._prompt_logprobs)
        return self._done


def _to_host(x: torch.Tensor | None) -> torch.Tensor | None:
    """Start copying a device tensor to pinned host memory (no sync); CPU tensors stay as they are."""
    if x is None or x.device.type != "cuda":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


class Worker:
    is_driver = True  # this process runs the control plane (a torchrun follower rank's worker says False)

    def __init__(self, runner: ModelRunner, sampler: Sampler, speculator=None):
        self.runner = runner
        self.sampler = sampler
        self.speculator = speculator
        self.device = runner.device
        self.page_size = runner.page_size
        # The token last sampled for each req_to_token row: the next decode step's input.
        self.next_input_ids = torch.zeros(runner.num_rows, dtype=torch.int64, device=self.device)
        self.bitmask_width = (sampler.vocab_size + 31) // 32  # int32 words of a grammar mask row

    @property
    def kv_capacity(self) -> KVCapacity:
        """The KV pages and req_to_token rows the control plane allocates (the engine builds its allocators)."""
        return self.runner.kv_capacity

    def execute(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).result()

    def prepare_fast_paths(self) -> None:
        """torch.compile and CUDA-graph capture (they run the model: every rank calls this at the same point,
        after building its worker and before the first plan)."""
        self.runner.prepare_fast_paths(self.speculator.layout if self.speculator is not None else None)

    def close(self) -> None:
        """Release what outlives the process's objects (tensor-parallel ranks); nothing for one process."""

    def launch(self, plan: StepPlan) -> PendingStep:
        table = self.runner.req_to_token_table
        for w in plan.table_writes:
            table.write_pages(w.row, w.first_page, w.pages, self.page_size)
        if plan.kind == StepKind.SPEC:
            if plan.grammar_rows:  # the round needs its constrained requests' masks (`launch_sampling`)
                return PendingStep(plan, [], None, None, None, forward=(None, None))
            return PendingStep(plan, [], None, None, None, done=self._speculate(plan, None))
        batch = self._batch(plan)
        out = self.runner.forward(batch)
        prompt_logprobs = self._score_prompts(plan, out.hidden) if plan.prompt_scoring else None
        pending = PendingStep(plan, [], None, prompt_logprobs, None, forward=(batch, out))
        if not plan.grammar_rows:
            self._sample(pending, None)
        return pending

    def mask_buffer(self, rows: int) -> torch.Tensor:
        """Host memory for a step's grammar bitmask, int32 [rows, bitmask_width]: pinned where the device is a GPU,
        so `launch_sampling` copies it without a host sync (the caching host allocator holds on to it until that
        copy has run)."""
        return torch.empty((rows, self.bitmask_width), dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def launch_sampling(self, pending: PendingStep, bitmask: torch.Tensor | None) -> None:
        """Sample a step that `launch` left awaiting its mask. `bitmask`: row i allows the tokens of plan row
        `plan.grammar_rows[i]` (from `mask_buffer`); None on tensor-parallel ranks > 0, which get rank 0's."""
        rows = len(pending.plan.grammar_rows)
        if bitmask is None:
            mask = torch.empty((rows, self.bitmask_width), dtype=torch.int32, device=self.device)
        else:
            if tuple(bitmask.shape) != (rows, self.bitmask_width):
                raise ValueError(f"grammar bitmask of shape {tuple(bitmask.shape)}, the step needs "
                                 f"{(rows, self.bitmask_width)}")
            mask = host_to_device(bitmask, self.device)
        self._share_mask(mask)
        if pending.plan.kind == StepKind.SPEC:
            pending.forward = None
            pending._done = self._speculate(pending.plan, mask)
            return
        self._sample(pending, mask)

    def _share_mask(self, mask: torch.Tensor) -> None:
        """Tensor parallelism: every rank samples with rank 0's mask (one process: nothing to share)."""

    def _sample(self, pending: PendingStep, mask: torch.Tensor | None) -> None:
        """The step's sampling (with the grammar rows' device bitmask, if any), the copy of its tokens to the host."""
        plan = pending.plan
        batch, out = pending.forward
        pending.forward = None
        sampled = [b for b, s in enumerate(plan.sample) if s]
        tokens = None
        if sampled:
            logits = out.logits if len(sampled) == plan.batch_size else \
                out.logits[ints_to_device(sampled, self.device)]
            params = [plan.params[b] for b in sampled]
            penalty = plan.penalty_context
            penalised = penalty is not None and any(penalty[b] is not None for b in sampled)
            token_mask = None
            if mask is not None:
                at = {b: i for i, b in enumerate(sampled)}  # grammar rows are sampled rows
                token_mask = TokenMask(mask, ints_to_device([at[b] for b in plan.grammar_rows], self.device))
            tokens = self.sampler(logits, params, [plan.output_positions[b] for b in sampled],
                                  [penalty[b][0] if penalty[b] else [] for b in sampled] if penalised else None,
                                  [penalty[b][1] if penalty[b] else [] for b in sampled] if penalised else None,
                                  mask=token_mask)
            rows = batch.req_pool_indices if len(sampled) == plan.batch_size else \
                ints_to_device([plan.rows[b] for b in sampled], self.device)
            self.next_input_ids[rows] = tokens.ids
        if self.speculator is not None and plan.kind == StepKind.EXTEND:
            self._draft_extend_after_prefill(plan, batch, out, sampled, tokens)
        event = None
        if tokens is not None:
            tokens = SampledTokens(*(_to_host(t) for t in tokens))
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
        pending._sampled, pending._tokens, pending._event = sampled, tokens, event

    # -- batches ------------------------------------------------------------------
    def _batch(self, plan: StepPlan) -> ForwardBatch:
        dev, r2t = self.device, self.runner.req_to_token
        rows, starts, lens = plan.rows, plan.prefix_lens, plan.extend_lens
        if plan.kind == StepKind.DECODE:
            rows_t, starts_t = ints_to_device(rows + starts, dev).split(len(rows))
            loc = r2t[rows_t, starts_t].long()
            return ForwardBatch.build(StepKind.DECODE, self.next_input_ids[rows_t], rows, starts, lens, loc, dev)
        ids = torch.zeros(plan.num_tokens, dtype=torch.int64)
        host_pos, dev_pos, dev_rows = [], [], []
        offset = 0
        for b, n in enumerate(lens):
            if plan.from_device[b]:
                assert n == 1, "a device-fed row runs one token"
                dev_pos.append(offset)
                dev_rows.append(rows[b])
            else:
                host_pos += range(offset, offset + n)
            offset += n
        assert len(host_pos) == len(plan.input_ids), (len(host_pos), len(plan.input_ids))
        if host_pos:
            ids[torch.tensor(host_pos, dtype=torch.int64)] = torch.tensor(plan.input_ids, dtype=torch.int64)
        ids = host_to_device(ids, dev)
        if dev_pos:
            at, from_rows = ints_to_device(dev_pos + dev_rows, dev).split(len(dev_pos))
            ids[at] = self.next_input_ids[from_rows]
        loc = row_slots(r2t, rows, starts, lens)
        return ForwardBatch.build(StepKind.EXTEND, ids, rows, starts, lens, loc, dev)

    # -- host-data steps ------------------------------------------------------------
    def _score_prompts(self, plan: StepPlan, hidden: torch.Tensor
                       ) -> list[tuple[list[float], list[dict[int, float]]] | None]:
        """Log-probabilities of the prompt tokens this step's chunks predict, for the requests that asked."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[int, PromptScoring]] = []
        offset = 0
        for b, n in enumerate(plan.extend_lens):
            s = plan.prompt_scoring[b]
            if s is not None and s.targets:
                rows += range(offset + s.first_row, offset + s.first_row + len(s.targets))
                targets += s.targets
                owners.append((b, s))
            offset += n
        result: list = [None] * plan.batch_size
        if not rows:
            return result
        k = max(s.top for _, s in owners)
        values, tops = self.runner.token_logprobs(hidden, rows, targets, k)
        at = 0
        for b, s in owners:
            m = len(s.targets)
            result[b] = (values[at:at + m], [dict(list(t.items())[:s.top]) for t in tops[at:at + m]])
            at += m
        return result

    def _draft_extend_after_prefill(self, plan: StepPlan, batch: ForwardBatch, out: ModelOutput,
                                    sampled: list[int], tokens: SampledTokens | None) -> None:
        """The MTP layer catches up on the prefill chunks (speculation runs unmixed: no decode rows here)."""
        ids = dict(zip(sampled, tokens.ids.tolist())) if tokens is not None else {}
        lookahead: list[int | None] = []
        for b in range(plan.batch_size):
            nxt = plan.spec_lookahead[b] if plan.spec_lookahead is not None else None
            lookahead.append(ids.get(b, nxt))
        self.speculator.on_extend(plan.rows, batch, out, lookahead)

    def _speculate(self, plan: StepPlan, mask: torch.Tensor | None) -> StepResult:
        spec = SpecRows(plan.rows, plan.prefix_lens, plan.spec_roots, plan.params, plan.output_positions,
                        plan.request_ids, list(plan.grammar_rows or []), mask)
        tokens = self.speculator.decode(spec)
        assert len(tokens) == plan.batch_size and all(tokens), "speculator must return >= 1 token per request"
        rows, last = ints_to_device(plan.rows + [t[-1] for t in tokens], self.device).split(plan.batch_size)
        self.next_input_ids[rows] = last
        return StepResult(tokens)
