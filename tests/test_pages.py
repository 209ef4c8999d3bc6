"""The page allocator's debug checks (sched/pages.py) find each way its bookkeeping can go wrong."""

import pytest

from minidsa.sched.pages import PageAllocator


def _alloc_with_held(n: int = 3) -> tuple[PageAllocator, list[int]]:
    a = PageAllocator(16, 4)
    return a, a.alloc(n)


@pytest.mark.smoke
def test_a_consistent_allocator_passes_and_a_held_page_is_a_leak():
    a, pages = _alloc_with_held()
    a.check_refs(dict.fromkeys(pages, 1))
    with pytest.raises(AssertionError, match="3 pages still allocated: \\[1, 2, 3\\]"):
        a.check_all_free()
    a.free(pages)
    a.check_all_free()
    a._free.append(a._free.pop())  # the arrays still grow and shrink after a check (no buffer pinned)


@pytest.mark.parametrize("corrupt,message", [
    (lambda a, p: a._ref.__setitem__(p[0], 2), "wrong reference counts, e.g. page 1: 2 holders"),
    (lambda a, p: a._free.append(p[0]), "free list are still held: \\[1\\]"),
    (lambda a, p: a._free.append(a._free[0]), "duplicates or the dummy page"),
    (lambda a, p: a._free.append(0), "duplicates or the dummy page"),
    (lambda a, p: a._free.remove(10), "1 pages held by nobody but not free: \\[10\\]"),
    (lambda a, p: a._used.__setitem__(p[1], 0), "used flags disagree"),
    (lambda a, p: setattr(a, "num_evictable_pages", 1), "counters: 0 cached / 1 evictable counted, 0 / 0 found"),
])
def test_each_kind_of_corruption_is_named(corrupt, message):
    a, pages = _alloc_with_held()
    corrupt(a, pages)
    with pytest.raises(AssertionError, match=message):
        a.check_refs(dict.fromkeys(pages, 1))
