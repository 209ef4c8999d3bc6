"""Scheduler: decides WHICH requests run each step and holds their KV pages.

Policy (one forward per step, prefill and decode alternate, prefill first):

1. Prefill step, if there is prefill work that fits. Token budget
   `max_prefill_tokens` per step; no request contributes more than
   `chunked_prefill_size` tokens, so a long prompt is prefilled in chunks
   over several steps. The (at most one) partially prefilled request goes
   first, then waiting requests in FIFO order are admitted while there is a
   free request slot (`max_running_requests`), budget left, and free pages
   for their chunk *plus* the pages the running decoders need for their next
   step (so admitting never forces an immediate preemption). A request that
   does not fit whole takes a chunk and ends the batch.
2. Otherwise a decode step over every running request whose prefill is
   done. Each must hold KV for `decode_reserve` new positions
   (1, or 1 + draft tokens under speculative decoding). When pages run
   out, the most recently admitted request is preempted: its pages and row
   are freed, its generated tokens kept, and it goes back to the front of
   the waiting queue; on re-admission prompt + generated tokens are
   prefilled again (recompute), after which it continues where it stopped.
3. `abort` removes a request at any time (between steps) and frees its KV.

Decode stalls while prefills run; that is the price of one mode per step
(CUDA graphs and the speculator see pure decode batches).

Any request of up to `max_model_len` tokens fits in an otherwise empty
cache (the engine sizes max_model_len so), so the oldest running request
always makes progress: no deadlock, no livelock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minidsa.batch import ForwardMode
from minidsa.kv_cache import PageAllocator, ReqToTokenPool, pages_needed, slots_of
from minidsa.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """What runs this step: a prefill (EXTEND) batch with chunk lengths, or a DECODE batch."""

    mode: ForwardMode
    reqs: list[Request]
    extend_lens: list[int]  # EXTEND: tokens of each request this step; DECODE: 1 each
    preempted: list[Request] = field(default_factory=list)  # preempted while planning this step


class Scheduler:
    def __init__(self, allocator: PageAllocator, req_pool: ReqToTokenPool, *, max_running_requests: int,
                 max_prefill_tokens: int, chunked_prefill_size: int, decode_reserve: int = 1):
        self.allocator = allocator
        self.req_pool = req_pool
        self.page_size = allocator.page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.decode_reserve = decode_reserve
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._admit_counter = 0
        self.num_preemptions = 0

    # -- queue --------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self._release(req)
        req.status = RequestStatus.FINISHED

    def finish(self, req: Request) -> None:
        """A running request is done: free its KV now."""
        self._release(req)
        req.status = RequestStatus.FINISHED

    # -- planning ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        reqs: list[Request] = []
        lens: list[int] = []
        budget = self.max_prefill_tokens
        for req in self.running:  # the partially prefilled request, if any
            if req.in_prefill and budget > 0:
                want = min(req.prefill_len - req.seq_len, self.chunked_prefill_size, budget)
                got = min(want, self._grow(req, req.seq_len + want, partial=True) - req.seq_len)
                if got <= 0:
                    return None  # no pages: decoders run (and may preempt it)
                reqs.append(req)
                lens.append(got)
                budget -= got
                if got < req.prefill_len - req.seq_len:
                    return ScheduledBatch(ForwardMode.EXTEND, reqs, lens)
        headroom = self._decode_headroom_pages()
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests \
                and self.req_pool.num_free > 0:
            req = self.waiting[0]
            total = req.num_tokens  # prompt + tokens generated before a preemption
            n = min(total, self.chunked_prefill_size, budget)
            reserve = self.decode_reserve if n == total else 0
            need = pages_needed(n + reserve, self.page_size)
            if need + headroom > self.allocator.num_free_pages:
                break
            self.waiting.popleft()
            self._admit(req)
            self._grow(req, n + reserve)
            reqs.append(req)
            lens.append(n)
            budget -= n
            if n < total:
                break  # only the last request of a batch may be partially prefilled
        if not reqs:
            return None
        return ScheduledBatch(ForwardMode.EXTEND, reqs, lens)

    def _schedule_decode(self) -> ScheduledBatch | None:
        preempted: list[Request] = []
        for req in [r for r in self.running if not r.in_prefill]:  # oldest first
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            while self._grow(req, req.seq_len + self.decode_reserve) < req.seq_len + self.decode_reserve:
                victim = max(self.running, key=lambda r: r.admit_seq)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
        reqs = [r for r in self.running if not r.in_prefill]
        if not reqs:
            if preempted:  # everything got preempted (cannot happen with a sane max_model_len)
                raise RuntimeError("KV cache too small to decode a single request")
            return None
        return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * len(reqs), preempted)

    def _decode_headroom_pages(self) -> int:
        """Pages the running decoders still need for their next step."""
        need = 0
        for r in self.running:
            if not r.in_prefill:
                need += max(0, pages_needed(r.seq_len + self.decode_reserve, self.page_size) - len(r.pages))
        return need

    # -- KV ownership ---------------------------------------------------------
    def _admit(self, req: Request) -> None:
        req.row = self.req_pool.alloc()
        req.status = RequestStatus.RUNNING
        req.seq_len = 0
        req.prefill_len = req.num_tokens
        req.admit_seq = self._admit_counter
        self._admit_counter += 1
        self.running.append(req)

    def _grow(self, req: Request, num_positions: int, partial: bool = False) -> int:
        """Make the request's pages cover row positions [0, num_positions); map them in req_to_token.

        All or nothing unless `partial`, which takes what is free. Returns the positions now covered.
        """
        ps = self.page_size
        have = len(req.pages)
        need = pages_needed(num_positions, ps) - have
        if need > 0:
            if need > self.allocator.num_free_pages:
                if not partial:
                    return have * ps
                need = self.allocator.num_free_pages
            if need > 0:
                req.pages.extend(self.allocator.alloc(need))
                end = min(len(req.pages) * ps, self.req_pool.max_context_len)
                if end > have * ps:
                    self.req_pool.write(req.row, have * ps, slots_of(req.pages, have * ps, end, ps))
        return len(req.pages) * ps

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req.row >= 0:
            self.req_pool.free(req.row)
            req.row = -1
        req.seq_len = 0
        req.prefill_len = 0

    def _preempt(self, req: Request) -> None:
        """Free the request's KV; it is recomputed from prompt + generated tokens when re-admitted."""
        self._release(req)
        req.status = RequestStatus.WAITING
        req.spec_state = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def check_consistent(self) -> None:
        """Pages and rows held by the allocator are exactly those of running requests."""
        held = [p for r in self.running for p in r.pages]
        if len(held) != len(set(held)):
            raise AssertionError("KV page owned by two requests")
        if self.allocator.num_used_pages != len(held):
            raise AssertionError(f"KV slot leak: {self.allocator.num_used_pages} pages allocated, "
                                 f"{len(held)} held by {len(self.running)} running requests")
        rows_used = self.req_pool.max_reqs - self.req_pool.num_free
        if rows_used != len(self.running):
            raise AssertionError(f"req_to_token leak: {rows_used} rows allocated, {len(self.running)} running")
