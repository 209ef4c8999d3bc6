"""Host-side KV bookkeeping of the control plane: which KV pages and which req_to_token rows are free.

The worker owns the device memory (common/kv_cache.py: the caches and the req_to_token table) and reports its
capacity (`KVCapacity`); the engine builds a `PageAllocator` and a `RowAllocator` from it and hands them to the
scheduler and the prefix cache. Nothing here touches a device tensor: the pages and rows decided here reach the
worker as `TableWrite`s in the step plan.

Slots are token-granular ids `page * page_size + offset`. Page 0 is never handed out: its slot 0 is the dummy
slot that padding rows (CUDA-graph batches, -1 indices) point at.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCapacity:
    """What the worker's KV memory holds: `num_pages` pages of `page_size` token slots (page 0, the reserved dummy
    page, among them) and `num_rows` req_to_token rows (one per running request)."""

    num_pages: int
    page_size: int
    num_rows: int


class OutOfPages(RuntimeError):
    """KV memory is exhausted; the scheduler preempts or waits."""


class PageAllocator:
    """Hands out KV pages and counts who holds them.

    `ref(page)` is the number of requests holding a page: with prefix caching
    several requests share the pages of a common prefix. Separately a page
    may be *cached*, held by the prefix cache (prefix_cache.py). A page goes
    back to the free list once no request holds it and the cache does not
    either. A cached page no request holds is *evictable*: it keeps its KV
    for later hits, and `alloc` asks the cache to evict such pages when the
    free list runs short, so evictable pages count as available.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (page 0 is the reserved dummy page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Low pages first: keeps allocations deterministic and compact.
        # Machine-integer arrays, not lists: the debug checks view them as tensors without copying (millions of
        # pages at page size 1).
        self._free = array("q", range(num_pages - 1, 0, -1))
        self._ref = array("q", bytes(8 * num_pages))  # requests holding each page
        self._used = bytearray(num_pages)  # 1 while some request holds the page (ref > 0)
        self._cached = bytearray(num_pages)  # 1 while the prefix cache holds the page
        self.num_cached_pages = 0
        self.num_evictable_pages = 0  # cached, held by no request
        self.cache = None  # the PrefixCache, once one attaches itself

    def attach_cache(self, cache) -> None:
        """`cache` provides evict(n) -> freed and on_evictable(page); see prefix_cache.PrefixCache."""
        if self.cache is not None:
            raise RuntimeError("a prefix cache is already attached to this allocator")
        self.cache = cache

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list (not counting evictable cached pages)."""
        return len(self._free)

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation can get: free ones plus evictable cached ones."""
        return len(self._free) + self.num_evictable_pages

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        """Pages not on the free list: held by a request or by the prefix cache."""
        return self.num_usable_pages - len(self._free)

    @property
    def num_held_pages(self) -> int:
        """Pages held by at least one request."""
        return self.num_used_pages - self.num_evictable_pages

    def ref(self, page: int) -> int:
        return self._ref[page]

    def is_cached(self, page: int) -> bool:
        return bool(self._cached[page])

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.cache is not None and self.num_evictable_pages:
            self.cache.evict(n - len(self._free))
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            assert self._ref[p] == 0 and not self._cached[p], f"KV page {p} on the free list is still held"
            self._ref[p] = 1
            self._used[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more request holds each of `pages` (held or cached ones: prefix-cache hits)."""
        for p in pages:
            if self._ref[p] == 0:
                if not self._cached[p]:
                    raise RuntimeError(f"KV page {p} is free: it cannot be shared")
                self.num_evictable_pages -= 1
                self._used[p] = 1
            self._ref[p] += 1

    def free(self, pages: list[int]) -> None:
        """One request fewer holds each of `pages`; pages nobody holds any more go back (or stay cached)."""
        released = []
        for p in pages:
            if self._ref[p] == 0:
                raise RuntimeError(f"KV page {p} freed twice (no request holds it)")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._used[p] = 0
                if self._cached[p]:
                    self.num_evictable_pages += 1
                    self.cache.on_evictable(p)
                else:
                    released.append(p)
        self._free.extend(reversed(released))

    def cache_add(self, page: int) -> None:
        """The prefix cache takes a page that a request holds (its KV is complete)."""
        if self._ref[page] == 0:
            raise RuntimeError(f"KV page {page} is held by no request: it cannot enter the prefix cache")
        if self._cached[page]:
            raise RuntimeError(f"KV page {page} is already in the prefix cache")
        self._cached[page] = 1
        self.num_cached_pages += 1

    def cache_evict(self, page: int) -> None:
        """The prefix cache drops an evictable page: it goes back to the free list."""
        if not self._cached[page]:
            raise RuntimeError(f"KV page {page} is not in the prefix cache")
        if self._ref[page]:
            raise RuntimeError(f"KV page {page} evicted while {self._ref[page]} requests hold it")
        self._cached[page] = 0
        self.num_cached_pages -= 1
        self.num_evictable_pages -= 1
        self._free.append(page)

    def check_refs(self, holders: dict[int, int]) -> None:
        """Debug check: `holders[page]` (the running requests' count) is every page's reference count, and
        the free list, the cache flags and the counters agree. Vectorised: a page-size-1 cache has millions of
        pages, and Python loops over them took seconds at the end of every benchmark."""
        ref = _tensor(self._ref, torch.int64)
        want = torch.zeros_like(ref)
        if holders:
            want[torch.tensor(list(holders), dtype=torch.int64)] = torch.tensor(list(holders.values()))
        bad = (ref[1:] != want[1:]).nonzero().flatten().add_(1).tolist()
        if bad:
            p = bad[0]
            raise AssertionError(f"KV slot leak or early free: {len(bad)} pages with wrong reference counts, "
                                 f"e.g. page {p}: {self._ref[p]} holders counted, {holders.get(p, 0)} running "
                                 f"requests hold it; pages {bad[:20]}")
        free = _tensor(self._free, torch.int64)
        on_free = torch.zeros(self.num_pages, dtype=torch.bool)
        on_free[free] = True
        if int(on_free.sum()) != len(self._free) or bool(on_free[0]):
            raise AssertionError("KV free list has duplicates or the dummy page")
        cached, used = _tensor(self._cached, torch.uint8).bool(), _tensor(self._used, torch.uint8).bool()
        held = ref > 0
        wrong = (on_free & (held | cached)).nonzero().flatten().tolist()
        if wrong:
            raise AssertionError(f"KV pages on the free list are still held: {wrong[:20]}")
        lost = (~on_free[1:] & ~held[1:] & ~cached[1:]).nonzero().flatten().add_(1).tolist()
        if lost:
            raise AssertionError(f"KV slot leak: {len(lost)} pages held by nobody but not free: {lost[:20]}")
        if bool((used != held).any()):
            raise AssertionError("KV allocator: used flags disagree with reference counts")
        num_cached, evictable = int(cached.sum()), int((cached & ~held).sum())
        if num_cached != self.num_cached_pages or evictable != self.num_evictable_pages:
            raise AssertionError(f"KV allocator counters: {self.num_cached_pages} cached / "
                                 f"{self.num_evictable_pages} evictable counted, {num_cached} / {evictable} found")

    def check_all_free(self) -> None:
        """Debug check: raise if any page is still held by a request (pages held only by the prefix cache are
        fine: they are evictable)."""
        held = (_tensor(self._ref, torch.int64)[1:] > 0).nonzero().flatten().add_(1).tolist()
        if held:
            raise AssertionError(f"KV slot leak: {len(held)} pages still allocated: {held[:20]}")
        self.check_refs({})


def _tensor(buffer: array | bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A copy of a host array as a tensor. A copy: a tensor viewing the array would pin its buffer, and the array
    could not grow while it lives (an exception's traceback can keep it alive)."""
    if len(buffer) == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).clone()


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


class RowAllocator:
    """Which req_to_token rows are free: host bookkeeping of the control plane (the table is the worker's)."""

    def __init__(self, max_reqs: int):
        self.max_reqs = max_reqs
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfPages("no free req_to_token rows")
        return self._free.pop()

    def free(self, row: int) -> None:
        if row in self._free:
            raise RuntimeError(f"req_to_token row {row} freed twice")
        self._free.append(row)

    def check_all_free(self) -> None:
        if len(self._free) != self.max_reqs:
            raise AssertionError(f"req_to_token leak: {self.max_reqs - len(self._free)} rows still allocated")
