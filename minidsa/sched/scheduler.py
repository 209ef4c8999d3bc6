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

Prefix caching (optional, prefix_cache.py): at admission a request takes the
longest cached prefix of its tokens (whole pages, at most all tokens but the
last, so the prefill that follows always produces logits) and prefill starts
after it. Full pages whose tokens are cached in every layer enter the cache
at the start of each step (so requests admitted later reuse the prefix of
ones still running) and when a request finishes, aborts or is preempted;
the pages of a preempted request often still match when it comes back.
Evictable cached pages count as free: allocation evicts them on demand.
A waiting request whose next pages a request of the same batch is about to
compute (a long common prefix of requests arriving together) is passed
over for one step, then hits them (see `_shares_pending`).

Mixed steps (`mixed=True`, the engine's default without speculation): every
decode row runs in each step, and prefill chunks ride along in the same
forward, so decoders never stall behind a whole prefill step. The chunks of
a step with decode rows take at most `max_mixed_prefill_tokens` (and no more
than `max_prefill_tokens` minus the decode rows): every decoder waits for
that step's chunks, so this cap bounds the inter-token latency a long prompt
inflicts on them. A step without decode rows has the whole
`max_prefill_tokens` (an idle engine prefills at full speed). A budget
smaller than a chunk or a page only slows a prefill: the partially
prefilled request goes first in the next step and takes at least one token.
A step with decode rows only is a pure DECODE step (CUDA graphs); one with
both is a mixed EXTEND step (`num_decode` > 0; an extend graph up to its
largest token bucket, else compiled / eager).
Without `mixed` (speculation: the speculator needs pure decode batches)
prefill and decode alternate as above.

Overlapped scheduling: the engine plans step N+1 before step N's tokens
reach the host. Planning therefore advances `seq_len` when a step is planned
(positions below it are cached by the time a later step reads them), a
request whose last allowed token is in flight is not planned again
(`Request.all_tokens_planned`), and a preempted request with a token in
flight is not re-admitted until that token has arrived.

The scheduler never touches device tensors: the req_to_token entries it
decides are queued as `TableWrite`s (`take_table_writes`) that travel in the
step plan to the worker.

Any request of up to `max_model_len` tokens fits in an otherwise empty
cache (the engine sizes max_model_len so), so the oldest running request
always makes progress: no deadlock, no livelock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from minidsa.common.plan import StepKind, TableWrite
from minidsa.common.request import Request, RequestStatus
from minidsa.sched.pages import PageAllocator, RowAllocator, pages_needed
from minidsa.sched.prefix_cache import Node, PrefixCache


@dataclass
class ScheduledBatch:
    """What runs this step: decode rows first (`num_decode` of them, one token each), then prefill chunks."""

    kind: StepKind  # DECODE (decode rows only) or EXTEND (prefill chunks, after `num_decode` decode rows if mixed)
    reqs: list[Request]
    extend_lens: list[int]  # tokens of each request this step (1 for decode rows)
    num_decode: int = 0
    preempted: list[Request] = field(default_factory=list)  # preempted while planning this step


class Scheduler:
    def __init__(self, allocator: PageAllocator, rows: RowAllocator, *, max_running_requests: int,
                 max_prefill_tokens: int, chunked_prefill_size: int, decode_reserve: int = 1,
                 prefix_cache: PrefixCache | None = None, mixed: bool = False,
                 max_mixed_prefill_tokens: int | None = None):
        self.allocator = allocator
        self.rows = rows  # req_to_token rows (alloc / free / num_free / max_reqs)
        self.mixed = mixed
        self._table_writes: list[TableWrite] = []
        self.page_size = allocator.page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        # None: mixed steps are bounded by max_prefill_tokens alone
        self.max_mixed_prefill_tokens = max_prefill_tokens if max_mixed_prefill_tokens is None \
            else max_mixed_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.decode_reserve = decode_reserve
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._admit_counter = 0
        self.num_preemptions = 0
        self.prefix_cache = prefix_cache
        if prefix_cache is not None and prefix_cache.allocator is not allocator:
            raise ValueError("the prefix cache must use the scheduler's page allocator")
        # request id -> (tree node of its last cached page or None, number of its pages in the tree)
        self._cached_upto: dict[str, tuple[Node | None, int]] = {}
        self.cache_query_tokens = 0  # tokens looked up in the prefix cache at admission
        self.cache_hit_tokens = 0  # of which were found (not prefilled)

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

    def take_table_writes(self) -> list[TableWrite]:
        """The req_to_token writes decided since the last call, in order (for the next step plan)."""
        writes, self._table_writes = self._table_writes, []
        return writes

    # -- planning ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        if self.prefix_cache is not None:  # planned steps cache their tokens before any later step reads them
            for req in self.running:
                self._cache_pages(req)
        if not self.mixed:
            return self._schedule_prefill() or self._schedule_decode()
        decode = self._schedule_decode()
        if decode is None:
            return self._schedule_prefill()
        prefill = self._schedule_prefill(min(self.max_prefill_tokens - len(decode.reqs),
                                             self.max_mixed_prefill_tokens))
        if prefill is None:
            return decode
        return ScheduledBatch(StepKind.EXTEND, decode.reqs + prefill.reqs, decode.extend_lens + prefill.extend_lens,
                              len(decode.reqs), decode.preempted)

    def _schedule_prefill(self, budget: int | None = None) -> ScheduledBatch | None:
        reqs: list[Request] = []
        lens: list[int] = []
        budget = self.max_prefill_tokens if budget is None else budget
        computing: set[int] = set()  # pages this batch completes (chain hashes): see _shares_pending
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
                    return ScheduledBatch(StepKind.EXTEND, reqs, lens)
                if self.prefix_cache is not None:
                    node, done = self._cached_upto[req.request_id]
                    computing.update(self._chain_hashes(req, node, done, (req.seq_len + got) // self.page_size))
        headroom = self._decode_headroom_pages()
        i = 0  # waiting[i] is the next candidate; earlier ones wait for pages this batch computes
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_running_requests \
                and self.rows.num_free > 0:
            req = self.waiting[i]
            if req.num_pending:
                break  # preempted with a token in flight: recompute once it has arrived
            total = req.num_tokens  # prompt + tokens generated before a preemption
            hit: list[Node] = []
            # always leave the last token to compute: it gives the logits; prompt logprobs need every position
            if self.prefix_cache is not None and req.use_prefix_cache and req.params.prompt_logprobs is None:
                hit = self.prefix_cache.match(req.token_slice(0, total), total - 1)
                if computing and self._shares_pending(req, hit, computing):
                    i += 1
                    continue
            cached = len(hit) * self.page_size
            n = min(total - cached, self.chunked_prefill_size, budget)
            reserve = self.decode_reserve if cached + n == total else 0
            need = pages_needed(cached + n + reserve, self.page_size) - len(hit)
            pinned = self.prefix_cache.num_evictable(hit) if hit else 0  # hit pages stop being evictable
            if need + headroom > self.allocator.num_available_pages - pinned:
                break
            del self.waiting[i]
            self._admit(req, hit)
            self._grow(req, cached + n + reserve)
            reqs.append(req)
            lens.append(n)
            budget -= n
            if cached + n < total:
                break  # only the last request of a batch may be partially prefilled
            if self.prefix_cache is not None:
                computing.update(self._chain_hashes(req, hit[-1] if hit else None, len(hit),
                                                    total // self.page_size))
        if not reqs:
            return None
        return ScheduledBatch(StepKind.EXTEND, reqs, lens)

    # In-batch prefix sharing: requests arriving together with a common prefix would all miss the cache and
    # compute it side by side. A waiting request whose next pages (past its cache hit) are pages that a request
    # of this batch completes waits one step instead, then hits them. Pages are compared by a chain hash that
    # starts at the cache node both continue from. Short common prefixes (a BOS token, a chat header) are not
    # worth a step of delay.
    IN_BATCH_SHARE_MIN_TOKENS = 32

    def _chain_hashes(self, req: Request, node: Node | None, first: int, end: int) -> Iterator[int]:
        ps = self.page_size
        h = id(node)
        for k in range(first, end):
            h = hash((h, tuple(req.token_slice(k * ps, (k + 1) * ps))))
            yield h

    def _shares_pending(self, req: Request, hit: list[Node], computing: set[int]) -> bool:
        need = -(-self.IN_BATCH_SHARE_MIN_TOKENS // self.page_size)  # pages
        last = (req.num_tokens - 1) // self.page_size  # a hit never covers the last token
        if last - len(hit) < need:
            return False
        hashes = self._chain_hashes(req, hit[-1] if hit else None, len(hit), len(hit) + need)
        return all(h in computing for h in hashes)

    def _schedule_decode(self) -> ScheduledBatch | None:
        preempted: list[Request] = []
        for req in [r for r in self.running if self._decodes(r)]:  # oldest first
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            while self._grow(req, req.seq_len + self.decode_reserve) < req.seq_len + self.decode_reserve:
                victim = max(self.running, key=lambda r: r.admit_seq)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
        reqs = [r for r in self.running if self._decodes(r)]
        if not reqs:
            if preempted and not self.running:  # everything got preempted (not with a sane max_model_len)
                raise RuntimeError("KV cache too small to decode a single request")
            return None
        return ScheduledBatch(StepKind.DECODE, reqs, [1] * len(reqs), len(reqs), preempted)

    @staticmethod
    def _decodes(req: Request) -> bool:
        """The request decodes this step: its prefill is planned and it may still produce a token."""
        return not req.in_prefill and not req.all_tokens_planned

    def _decode_headroom_pages(self) -> int:
        """Pages the running decoders still need for their next step."""
        need = 0
        for r in self.running:
            if self._decodes(r):
                need += max(0, pages_needed(r.seq_len + self.decode_reserve, self.page_size) - len(r.pages))
        return need

    # -- KV ownership ---------------------------------------------------------
    def _admit(self, req: Request, hit: list[Node]) -> None:
        req.row = self.rows.alloc()
        req.status = RequestStatus.RUNNING
        req.seq_len = 0
        req.prefill_len = req.num_tokens
        req.admit_seq = self._admit_counter
        self._admit_counter += 1
        self.running.append(req)
        if self.prefix_cache is None:
            return
        self.cache_query_tokens += req.num_tokens
        self._cached_upto[req.request_id] = (hit[-1] if hit else None, len(hit))
        if hit:
            req.pages = self.prefix_cache.lock(hit)
            req.seq_len = len(hit) * self.page_size  # prefill starts after the cached prefix
            self._table_writes.append(TableWrite(req.row, 0, tuple(req.pages)))
            self.cache_hit_tokens += req.seq_len

    def _grow(self, req: Request, num_positions: int, partial: bool = False) -> int:
        """Make the request's pages cover row positions [0, num_positions); map them in req_to_token.

        All or nothing unless `partial`, which takes what is free. Returns the positions now covered.
        """
        ps = self.page_size
        have = len(req.pages)
        need = pages_needed(num_positions, ps) - have
        if need > 0:
            available = self.allocator.num_available_pages  # alloc evicts cached pages when it must
            if need > available:
                if not partial:
                    return have * ps
                need = available
            if need > 0:
                new = self.allocator.alloc(need)
                req.pages.extend(new)
                self._table_writes.append(TableWrite(req.row, have, tuple(new)))
        return len(req.pages) * ps

    def _cache_pages(self, req: Request) -> None:
        """Put the request's newly completed pages in the prefix cache.

        A page qualifies once all its positions are below seq_len (every layer, the MTP layer too, holds
        their KV; positions past it may hold speculative scratch) and the lookahead token after it is known.
        Where the tree already holds an equal page, the request moves onto the tree's page and frees its
        own, so the pages a request holds from the tree always form one path from the root.
        """
        if not req.use_prefix_cache:
            return
        cache, ps = self.prefix_cache, self.page_size
        parent, done = self._cached_upto.get(req.request_id, (None, 0))
        full = min(req.seq_len, req.num_tokens - cache.lookahead, len(req.pages) * ps) // ps
        if full <= done:
            return
        tokens = req.token_slice(done * ps, full * ps + cache.lookahead)
        node, tree_pages = cache.insert(parent, tokens, req.pages[done:full])
        for k, page in enumerate(tree_pages, start=done):
            if page != req.pages[k]:
                self.allocator.share([page])
                self.allocator.free([req.pages[k]])
                req.pages[k] = page
                self._table_writes.append(TableWrite(req.row, k, (page,)))
        self._cached_upto[req.request_id] = (node, full)

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        if self.prefix_cache is not None:
            self._cache_pages(req)
            del self._cached_upto[req.request_id]
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req.row >= 0:
            self.rows.free(req.row)
            req.row = -1
        req.seq_len = 0
        req.prefill_len = 0

    def _preempt(self, req: Request) -> None:
        """Free the request's KV; it is recomputed from prompt + generated tokens when re-admitted."""
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def check_consistent(self) -> None:
        """Every page's reference count is the number of running requests holding it, pages held by two
        requests are prefix-cache pages, and rows allocated are exactly those of running requests."""
        holders: dict[int, int] = {}
        for r in self.running:
            if len(r.pages) != len(set(r.pages)):
                raise AssertionError(f"KV page held twice by request {r.request_id}")
            for p in r.pages:
                holders[p] = holders.get(p, 0) + 1
        shared = [p for p, n in holders.items() if n > 1 and not self.allocator.is_cached(p)]
        if shared:
            raise AssertionError(f"KV pages owned by two requests outside the prefix cache: {shared[:20]}")
        self.allocator.check_refs(holders)
        if self.prefix_cache is not None:
            self.prefix_cache.check()
            for r in self.running:  # its cached pages are the tree path ending at its recorded node
                node, n = self._cached_upto[r.request_id]
                path = []
                while node is not None and node is not self.prefix_cache.root:
                    path.append(node.page)
                    node = node.parent
                if path[::-1] != r.pages[:n]:
                    raise AssertionError(f"request {r.request_id}: its first {n} pages are not its prefix-cache path")
        elif self.allocator.num_cached_pages:
            raise AssertionError("KV pages flagged cached without a prefix cache")
        rows_used = self.rows.max_reqs - self.rows.num_free
        if rows_used != len(self.running):
            raise AssertionError(f"req_to_token leak: {rows_used} rows allocated, {len(self.running)} running")

