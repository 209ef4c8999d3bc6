"""Prefix cache: a tree of full KV pages keyed by the token ids they hold, shared between requests.

A page's KV (MLA latent and indexer key of every layer, at each of its
slots) depends only on the tokens up to the page's end, so requests whose
prompts share their first k * page_size tokens can share their first k
pages. The tree has one node per cached page; a node's children are keyed by
the next page's tokens, so a walk from the root finds the longest cached
prefix a page at a time. Only full pages are cached.

With MTP speculation each key carries one more token (`lookahead = 1`): the
MTP layer's cache at position i pairs the target's hidden state at i with
the token at i + 1, so a page's last MTP slot holds the right KV only for
the token that followed the page when it was computed.

Ownership. The PageAllocator counts the requests holding each page and
flags the pages the tree holds. A cached page no request holds is
*evictable*: its KV stays for later matches until an allocation needs the
memory; then the allocator calls `evict`, which removes the least recently
used leaves first (removing an inner node would cut off its subtree). A
request holds its tree pages as one path from the root (see
`Scheduler._cache_pages`), so a node no request holds has no held
descendant, and every evictable page is reachable by repeated leaf eviction.

The scheduler decides what enters: full pages whose tokens every layer, the
MTP layer included, has cached (row positions below the request's
seq_len), never positions reserved for speculative drafts.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from minidsa.sched.pages import PageAllocator


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # the page's token ids (+ lookahead tokens)
    page: int
    parent: "Node | None"
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    last_access: int = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, lookahead: int = 0):
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1, got {lookahead}")
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.lookahead = lookahead
        self.root = Node((), 0, None)
        self._nodes: dict[int, Node] = {}  # page -> its node
        self._clock = 0
        # Candidate evictable leaves (last_access, tie-break, node); entries may be stale and are checked
        # when popped. A node is pushed whenever it becomes an evictable leaf.
        self._heap: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()
        self.num_evicted_pages = 0
        allocator.attach_cache(self)

    @property
    def num_pages(self) -> int:
        return len(self._nodes)

    def __repr__(self) -> str:
        return (f"PrefixCache(pages={self.num_pages}, evictable={self.allocator.num_evictable_pages}, "
                f"page_size={self.page_size}, lookahead={self.lookahead})")

    def _key(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        ps = self.page_size
        return tuple(tokens[k * ps:(k + 1) * ps + self.lookahead])

    # -- lookup ----------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int) -> list[Node]:
        """Nodes of the longest cached prefix of `tokens` covering at most `limit` tokens; nothing is locked."""
        full = min(limit, len(tokens) - self.lookahead) // self.page_size
        node, path = self.root, []
        for k in range(full):
            node = node.children.get(self._key(tokens, k))
            if node is None:
                break
            path.append(node)
        return path

    def num_evictable(self, path: list[Node]) -> int:
        """How many of the path's pages are evictable now (locking them takes them off the table)."""
        return sum(1 for n in path if self.allocator.ref(n.page) == 0)

    def lock(self, path: list[Node]) -> list[int]:
        """A request takes the path's pages: they stay until it frees them. Returns the pages."""
        pages = [n.page for n in path]
        self.allocator.share(pages)
        self._clock += 1
        for n in path:
            n.last_access = self._clock
        return pages

    # -- insertion ---------------------------------------------------------------------
    def insert(self, parent: Node | None, tokens: Sequence[int], pages: Sequence[int]) -> tuple[Node, list[int]]:
        """Cache a request's next full pages `pages` below `parent`, the node of its page before them (None:
        the root). `tokens` are the request's tokens from the first of these pages on, up to the end of the
        last one plus `lookahead`.

        Where the tree already has a page under the same key (another request computed the same prefix),
        the tree's page stays. Returns the deepest node and the tree's page for each of `pages`: where it
        differs from the request's, the caller moves the request onto the tree's page and frees its copy.
        """
        node = parent or self.root
        self._clock += 1
        tree_pages = []
        for i, page in enumerate(pages):
            key = self._key(tokens, i)
            assert len(key) == self.page_size + self.lookahead, "tokens do not cover the page (+ lookahead)"
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node)
                self.allocator.cache_add(page)  # raises unless a request holds it and it is not cached yet
                node.children[key] = child
                self._nodes[page] = child
            child.last_access = self._clock
            tree_pages.append(child.page)
            node = child
        return node, tree_pages

    # -- eviction -------------------------------------------------------------------------
    def _is_evictable_leaf(self, node: Node) -> bool:
        return (self._nodes.get(node.page) is node and not node.children
                and self.allocator.ref(node.page) == 0)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
        if len(self._heap) > 2 * len(self._nodes) + 64:  # stale entries piled up: start over
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_access, next(self._tie), n) for n in self._nodes.values() if self._is_evictable_leaf(n)]
        heapq.heapify(self._heap)

    def on_evictable(self, page: int) -> None:
        """Allocator hook: the last request holding cached `page` let it go."""
        node = self._nodes[page]
        if not node.children:
            self._push(node)

    def evict(self, n: int) -> int:
        """Free up to `n` evictable pages, least recently used leaves first. Returns how many were freed."""
        freed, rebuilt = 0, False
        while freed < n:
            if not self._heap:
                if rebuilt or self.allocator.num_evictable_pages == 0:
                    break
                self._rebuild_heap()  # only if a push was missed; keeps eviction from ever stalling
                rebuilt = True
                continue
            stamp, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node):
                continue  # stale: locked again, evicted, or got a child since it was pushed
            if stamp != node.last_access:  # touched since: wait in line with its new time
                heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
                continue
            parent = node.parent
            del parent.children[node.key]
            del self._nodes[node.page]
            self.allocator.cache_evict(node.page)
            self.num_evicted_pages += 1
            freed += 1
            if parent is not self.root and self._is_evictable_leaf(parent):
                self._push(parent)
        return freed

    def evict_all(self) -> int:
        """Drop every page no request holds (e.g. between benchmark runs)."""
        return self.evict(self.allocator.num_evictable_pages)

    # -- debug ------------------------------------------------------------------------------
    def check(self) -> None:
        """AssertionError unless the tree and the allocator's cache flags agree."""
        alloc, seen = self.allocator, 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                seen += 1
                if child.parent is not node or child.key != key or self._nodes.get(child.page) is not child:
                    raise AssertionError(f"prefix cache: node of page {child.page} is mislinked")
                if len(key) != self.page_size + self.lookahead:
                    raise AssertionError(f"prefix cache: page {child.page} has a key of {len(key)} tokens")
                if not alloc.is_cached(child.page):
                    raise AssertionError(f"prefix cache: page {child.page} is in the tree, not flagged cached")
                if node is not self.root and alloc.ref(child.page) > 0 and alloc.ref(node.page) == 0:
                    raise AssertionError(f"prefix cache: page {child.page} is held but its parent page "
                                         f"{node.page} is not (requests must hold whole paths)")
                stack.append(child)
        if seen != len(self._nodes) or seen != alloc.num_cached_pages:
            raise AssertionError(f"prefix cache leak: {seen} pages in the tree, {len(self._nodes)} indexed, "
                                 f"{alloc.num_cached_pages} flagged cached by the allocator")
