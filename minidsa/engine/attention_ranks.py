"""The engine's host bookkeeping per attention rank: KV pages, req_to_token rows, prefix cache and scheduler.

One process, or tensor parallelism: one `AttentionRank` (every rank holds the same, replicated cache). Data-parallel
attention (`--enable-dp-attention`, minidsa/parallel/dp_attention.py): one per rank, each over that rank's own KV
cache (the ranks agree on one capacity, so the engine's is N times it). A request lives on one attention rank from
its admission to its end (preemption and recomputation included); `place` picks it, by cached prefix and load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minidsa.sched.pages import KVCapacity, PageAllocator, RowAllocator
from minidsa.sched.prefix_cache import PrefixCache
from minidsa.sched.scheduler import Scheduler


@dataclass
class AttentionRank:
    rank: int
    page_allocator: PageAllocator
    row_allocator: RowAllocator
    prefix_cache: PrefixCache | None
    scheduler: Scheduler

    @classmethod
    def build(cls, rank: int, capacity: KVCapacity, prefix_caching: bool, lookahead: int, **scheduler_args
              ) -> "AttentionRank":
        pages = PageAllocator(capacity.num_pages, capacity.page_size)
        rows = RowAllocator(capacity.num_rows)
        # With MTP speculation a page's last MTP slot depends on the token after the page: it is part of the key.
        cache = PrefixCache(pages, lookahead=lookahead) if prefix_caching else None
        return cls(rank, pages, rows, cache, Scheduler(pages, rows, prefix_cache=cache, **scheduler_args))

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def check_no_leaks(self, idle: bool) -> None:
        """AssertionError when the scheduler's pages and rows disagree; `idle` (no request unfinished): everything
        free."""
        self.scheduler.check_consistent()
        if idle:
            self.page_allocator.check_all_free()
            self.row_allocator.check_all_free()


    def cached_prefix_tokens(self, prompt_ids: Sequence[int]) -> int:
        """Tokens of `prompt_ids` this rank's prefix cache holds (whole pages; nothing is locked)."""
        if self.prefix_cache is None or len(prompt_ids) < 2:
            return 0
        return len(self.prefix_cache.match(prompt_ids, len(prompt_ids) - 1)) * self.page_allocator.page_size


def place(ranks: list[AttentionRank], prompt_ids: Sequence[int] | None = None, load_gap: int = 0) -> AttentionRank:
    """The attention rank a new request goes to. The rank whose prefix cache holds the longest prefix of its prompt
    (a page at least), unless that rank runs more than `load_gap` requests over the least loaded one: a shared
    system prompt or a conversation's earlier turns are prefilled once, not once per rank. Otherwise (nothing cached,
    or too much load there) the fewest requests (running and waiting), then the most free KV pages, then the lowest
    rank."""
    least = min(ranks, key=lambda r: (r.num_requests, -r.page_allocator.num_free_pages, r.rank))
    if prompt_ids is None or len(ranks) == 1:
        return least
    cached = {r.rank: r.cached_prefix_tokens(prompt_ids) for r in ranks}
    best = max(ranks, key=lambda r: (cached[r.rank], -r.num_requests, r.page_allocator.num_free_pages, -r.rank))
    if cached[best.rank] and best.num_requests - least.num_requests <= load_gap:
        return best
    return least
