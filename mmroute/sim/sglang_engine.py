"""SGLang's paged radix cache, emulated at token level (no model, no GPU).

Mirrors SGLang ``mem_cache/radix_cache.py`` and ``mem_cache/common.py`` (allocation
and eviction) as observed in 0.5.22/0.5.23 (``tests/fixtures/kv_events/sglang-*``):

* A radix tree over page-aligned token ids, namespaced by ``extra_key`` (cache salt /
  LoRA): the namespace is *not* hashed, so salted requests publish identical events.
* Matching is capped at ``len - 1`` tokens, page-aligned (``floor((L-1)/P)*P``); a match
  ending inside a node splits it (no event).
* After prefill the page-aligned prompt is inserted (``cache_unfinished_req``); at finish
  ``(prompt + output)[:L + n - 1]`` page-aligned (``cache_finished_req``). Each insert
  creating a node publishes one ``BlockStored`` carrying all its pages (0.5.23 coalesced
  form), parent = the previous page's hash (None under the root). Re-inserting cached
  pages publishes nothing: the tree de-duplicates.
* Eviction pops LRU leaves (unlocked, childless), a parent becoming such a leaf joins
  the heap; one coalesced ``BlockRemoved`` per eviction call. Extend allocation evicts
  ``extend_tokens + P`` tokens when fewer are free (the per-request page over-estimate of
  ``alloc_paged_token_slots_extend``); a decode step evicts only when it needs a page
  and none is free (what the 0.5.23 capture shows).
* ``flush_cache`` (and start-up) publish ``AllBlocksCleared``.

Hashes: ``sglang_hash`` (sha256 page chain, int64 of the high 64 bits). Single-threaded.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Hashable

from mmroute.sim.engine_common import CapacityError, Emit, EngineCore
from mmroute.sim.sglang_hash import chain_pages, wire_int64
from mmroute.sim.wire import Cleared, Removed, Stored

__all__ = ["CapacityError", "SglangEngine", "SglangSeq"]


@dataclass(eq=False)
class _Node:
    id: int
    parent: "_Node | None"
    key: list[int]
    digests: list[bytes]
    extra_key: Hashable = None
    children: dict = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


@dataclass
class SglangSeq:
    """One request's state: ``input_ids`` already carry the image pad values."""

    request_id: str
    input_ids: list[int]
    extra_key: Hashable = None
    # filled by the engine
    token_ids: list[int] = field(default_factory=list)
    last_node: _Node | None = None
    protected_len: int = 0  # tokens held by the tree on this request's path
    private_pages: int = 0  # pages allocated to the request, not owned by the tree
    reserved: int = 0  # pages promised at admission, not yet allocated
    cached_tokens: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.input_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.input_ids)


class SglangEngine(EngineCore):
    UNIT, POOL = "pages", "pool"

    def __init__(self, num_pages: int, page_size: int, *, emit: Emit | None = None):
        if page_size <= 0 or num_pages <= 0:
            raise ValueError("page_size and num_pages must be positive")
        super().__init__(emit)
        self.page_size = page_size
        self.num_pages = num_pages
        self._ids = itertools.count(1)
        self._tick = 0
        self.free_pages = num_pages
        self.evictable_pages = 0
        self._reset_tree()
        # SGLang's RadixCache.reset() at start-up publishes AllBlocksCleared (seq 0).
        self._pending.append(Cleared())
        self._flush()

    # --- tree ---------------------------------------------------------------------------

    def _reset_tree(self) -> None:
        self.root = _Node(id=0, parent=None, key=[], digests=[], lock_ref=1)
        self.free_pages = self.num_pages
        self.evictable_pages = 0

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def _child_key(self, extra_key: Hashable, tokens: list[int]) -> tuple:
        return (extra_key, tuple(tokens[: self.page_size]))

    def _match_pages(self, a: list[int], b: list[int]) -> int:
        P = self.page_size
        n = 0
        for start in range(0, min(len(a), len(b)) - P + 1, P):
            if a[start : start + P] != b[start : start + P]:
                break
            n += 1
        return n

    def _split(self, child: _Node, pages: int, now: int) -> _Node:
        """Split ``child`` after ``pages`` pages; the new upper node inherits its lock."""
        P = self.page_size
        parent = child.parent
        assert parent is not None
        upper = _Node(
            id=next(self._ids),
            parent=parent,
            key=child.key[: pages * P],
            digests=child.digests[:pages],
            extra_key=child.extra_key,
            lock_ref=child.lock_ref,
            last_access=now,
        )
        parent.children[self._child_key(child.extra_key, child.key)] = upper
        child.key = child.key[pages * P :]
        child.digests = child.digests[pages:]
        child.parent = upper
        upper.children[self._child_key(child.extra_key, child.key)] = child
        return upper

    def _walk(self, tokens: list[int], extra_key: Hashable, now: int) -> tuple[_Node, int]:
        """Longest page-aligned match; splits a partially matched node. Returns the last
        matched node and the matched length in tokens."""
        P = self.page_size
        node = self.root
        node.last_access = now
        matched = 0
        rest = tokens[: len(tokens) // P * P]
        while rest:
            child = node.children.get(self._child_key(extra_key, rest))
            if child is None:
                break
            child.last_access = now
            pages = self._match_pages(child.key, rest)
            if pages * P < len(child.key):
                node = self._split(child, pages, now)
                matched += pages * P
                break
            node = child
            matched += len(child.key)
            rest = rest[len(child.key) :]
        return node, matched

    def _insert(self, tokens: list[int], extra_key: Hashable, now: int) -> tuple[_Node, int]:
        """Insert page-aligned ``tokens``; returns (last node, tokens already cached)."""
        node, matched = self._walk(tokens, extra_key, now)
        P = self.page_size
        aligned = len(tokens) // P * P
        if matched >= aligned:
            return node, matched
        key = tokens[matched:aligned]
        parent_digest = node.digests[-1] if node is not self.root and node.digests else None
        new = _Node(
            id=next(self._ids),
            parent=node,
            key=key,
            digests=chain_pages(key, P, parent_digest),
            extra_key=extra_key,
            last_access=now,
        )
        node.children[self._child_key(extra_key, key)] = new
        self.evictable_pages += len(key) // P
        self._pending.append(
            Stored(
                block_hashes=[wire_int64(d) for d in new.digests],
                parent_block_hash=wire_int64(parent_digest) if parent_digest is not None else None,
                token_ids=list(key),
                block_size=P,
            )
        )
        return new, matched

    def _inc_lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.key) // self.page_size
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def _dec_lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_pages += len(node.key) // self.page_size
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    def _evictable_leaves(self) -> list[_Node]:
        out = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.lock_ref == 0:
                out.append(n)
        return out

    def _evict(self, num_tokens: int) -> None:
        """RadixCache.evict: pop LRU leaves until ``num_tokens`` are freed."""
        P = self.page_size
        heap = [(n.last_access, n.id, n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted = 0
        hashes: list[int] = []
        while evicted < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            assert parent is not None
            del parent.children[self._child_key(x.extra_key, x.key)]
            pages = len(x.key) // P
            self.free_pages += pages
            self.evictable_pages -= pages
            evicted += len(x.key)
            hashes.extend(wire_int64(d) for d in x.digests)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if hashes:
            # 0.5.23 coalesces consecutive removes of one medium into one event.
            self._pending.append(Removed(hashes))

    def _alloc_pages(self, n: int) -> None:
        if n > self.free_pages:
            raise CapacityError(f"cannot allocate {n} pages, {self.free_pages} free")
        self.free_pages -= n

    # --- request lifecycle ----------------------------------------------------------------

    def usage(self) -> float:
        """sglang:token_usage: the fraction of the pool not free (tree + requests)."""
        return 1.0 - self.free_pages / self.num_pages

    @property
    def unit_tokens(self) -> int:
        return self.page_size

    @property
    def capacity(self) -> int:
        return self.num_pages

    def try_prefill(self, seq: SglangSeq, max_new_tokens: int) -> int | None:
        """Admit and prefill ``seq`` if its lifetime fits; return ``cached_tokens`` or
        None (keep waiting). Publishes the step's batch (removes, then the store)."""
        self._check_new(seq, max_new_tokens)
        P = self.page_size
        L = seq.num_prompt
        now = self._now()
        max_prefix = (L - 1) // P * P  # _compute_max_prefix_len: last token recomputed
        node, prefix = self._walk(seq.input_ids[:max_prefix], seq.extra_key, now)
        self._inc_lock(node)
        lifetime_new = self._lifetime(seq, max_new_tokens) - prefix // P
        if self.free_pages + self.evictable_pages - self._reserved_total < lifetime_new:
            self._dec_lock(node)
            return None
        self._count_prefill(L, prefix)
        seq.last_node = node
        seq.protected_len = prefix
        seq.cached_tokens = prefix
        extend = L - prefix
        if self.free_pages * P < extend + P:
            self._evict(extend + P)
        prompt_pages = -(-L // P) - prefix // P
        self._alloc_pages(prompt_pages)
        seq.private_pages = prompt_pages
        self._start(seq, lifetime_new - prompt_pages)
        self._cache(seq, seq.input_ids[: L // P * P], now)
        self._flush()
        return prefix

    def _cache(self, seq: SglangSeq, tokens: list[int], now: int) -> None:
        """Insert ``tokens`` (page-aligned) for ``seq`` (cache_unfinished_req /
        cache_finished_req). The request's private pages in the inserted range move to
        the tree, or are freed when the tree already held them (another request
        inserted the same pages first)."""
        P = self.page_size
        new_last, matched = self._insert(tokens, seq.extra_key, now)
        covered = (len(tokens) - seq.protected_len) // P
        if covered <= 0:
            return
        created = max(0, (len(tokens) - max(matched, seq.protected_len)) // P)
        seq.private_pages -= covered
        self.free_pages += covered - created
        self._inc_lock(new_last)
        self._dec_lock(seq.last_node)  # type: ignore[arg-type]
        seq.last_node = new_last
        seq.protected_len = len(tokens)

    def append_token(self, seq: SglangSeq, token_id: int, *, compute: bool) -> None:
        self._add_token(seq, token_id)
        if not compute:
            return
        P = self.page_size
        have = seq.protected_len // P + seq.private_pages
        need = -(-len(seq.token_ids) // P) - have
        if need > 0:
            if self.free_pages < need:
                self._evict(need * P)
            self._take_reserved(seq, need)
            self._alloc_pages(need)
            seq.private_pages += need
        self._flush()

    def finish(self, seq: SglangSeq) -> None:
        if not self._retire(seq):
            return
        P = self.page_size
        committed = max(len(seq.token_ids) - 1, seq.num_prompt)
        aligned = committed // P * P
        if aligned > seq.protected_len:
            self._cache(seq, seq.token_ids[:aligned], self._now())
        # The unaligned tail (and any page never inserted) goes back to the pool.
        self.free_pages += seq.private_pages
        seq.private_pages = 0
        if seq.last_node is not None:
            self._dec_lock(seq.last_node)
            seq.last_node = None
        self._flush()

    def flush_cache(self) -> bool:
        """/flush_cache: only when idle; AllBlocksCleared."""
        if self.running:
            return False
        self._reset_tree()
        self._pending.append(Cleared())
        self._flush()
        return True

    def num_cached_pages(self) -> int:
        return self.num_pages - self.free_pages
