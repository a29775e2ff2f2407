"""The prefix index: which worker holds which router block key (DESIGN.md "Block keys").

``PrefixIndex`` is the kv ``EventSink``. Per (worker, dp_rank, group) it maps each
engine block hash to the router key recomputed from the event's own token ids and
extra keys (``keys.chain_keys``), reference-counted because engines may store one
hash twice (ENGINES.md §1.4 "Duplicates", §1.5 "Dual-key index"). A global map
``router_key -> worker bitmask`` answers a lookup in one dict probe per request block.

Memory stays small: only ints in dicts, no per-block objects. Worker identities
become bit positions (``slot``); per-worker ``router_key -> count`` dicts say when a
worker's bit must leave the global mask (count = map entries across dp ranks/groups).

Everything here is synchronous: a batch is applied without yielding, so lookups on
the same event loop always see whole batches.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from typing import Any, Callable, Iterable, Sequence

import msgspec

from mmroute.kv.events import (
    DEVICE_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
)
from mmroute.routing.keys import ROOT_KEY, canon_extra, chain_keys

# Status labels (mirror metrics.kv_events{type,status}).
APPLIED = "applied"
UNKNOWN_PARENT = "unknown_parent"
BAD_BLOCK_SIZE = "bad_block_size"
BAD_SHAPE = "bad_shape"  # len(block_hashes) != full blocks in token_ids
SKIPPED_MEDIUM = "skipped_medium"  # host/disk tier (not a device hit)
SKIPPED_GROUP = "skipped_group"  # sliding-window / mamba / non-zero group without kind
UNKNOWN_HASH = "unknown_hash"  # BlockRemoved of a hash we never indexed (counted per hash)

_FULL_ATTENTION = "full_attention"

MapKey = tuple[str, int, int]  # (worker, dp_rank, group_idx)


class _WorkerState:
    __slots__ = ("worker_id", "slot", "bit", "refs", "spec", "counters", "unknown_parent")

    def __init__(self, worker_id: str, slot: int):
        self.worker_id = worker_id
        self.slot = slot
        self.bit = 1 << slot
        # router_key -> number of (dp_rank, group, engine_hash) entries mapping to it.
        self.refs: dict[int, int] = {}
        # Speculative router_key -> expiry (monotonic seconds).
        self.spec: dict[int, float] = {}
        # (event type, status) -> count; events, except UNKNOWN_HASH counts hashes.
        self.counters: Counter[tuple[str, str]] = Counter()
        self.unknown_parent = 0


class _GroupMap:
    """engine_hash -> router_key, plus refcounts above 1 (duplicates are rare)."""

    __slots__ = ("keys", "dups")

    def __init__(self) -> None:
        self.keys: dict[EngineHash, int] = {}
        self.dups: dict[EngineHash, int] = {}


class PrefixIndex:
    """Router-key index over every worker's device KV cache.

    ``block_size``: None learns it from the first accepted BlockStored; events of a
    different size are then counted (``bad_block_size``) and not indexed.
    ``on_unknown_parent(worker_id, dp_rank)`` is called (synchronously) when a store's
    parent is not in the map, so the subscriber can request a replay.
    """

    def __init__(
        self,
        block_size: int | None = None,
        on_unknown_parent: Callable[[str, int], None] | None = None,
    ):
        if block_size is not None and block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.on_unknown_parent = on_unknown_parent
        self._workers: dict[str, _WorkerState] = {}
        self._by_slot: dict[int, _WorkerState] = {}
        self._free_slots: list[int] = []
        self._maps: dict[MapKey, _GroupMap] = {}
        self._holders: dict[int, int] = {}  # router_key -> bitmask of workers (real stores)
        self._spec_mask: dict[int, int] = {}  # router_key -> bitmask (speculative)
        self._spec_heap: list[tuple[float, int, int, Sequence[int]]] = []
        self._spec_seq = 0

    # ---------------------------------------------------------------- workers
    def _state(self, worker_id: str) -> _WorkerState:
        st = self._workers.get(worker_id)
        if st is None:
            slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._by_slot)
            st = _WorkerState(worker_id, slot)
            self._workers[worker_id] = st
            self._by_slot[slot] = st
        return st

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker entirely (all ranks, speculative entries, counters)."""
        st = self._workers.get(worker_id)
        if st is None:
            return
        self.clear(worker_id, None)
        del self._workers[worker_id]
        del self._by_slot[st.slot]
        heapq.heappush(self._free_slots, st.slot)

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    # ---------------------------------------------------------------- EventSink
    def apply(self, worker_id: str, dp_rank: int, batch: EventBatch) -> None:
        """Apply one batch, in order (removes before stores in vLLM eviction batches)."""
        st = self._state(worker_id)
        rank = dp_rank or 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(st, rank, ev)
            elif isinstance(ev, BlockRemoved):
                self._remove(st, rank, ev)
            elif isinstance(ev, AllBlocksCleared):
                self._clear_rank(st, rank)
                self._clear_spec(st)
                st.counters["AllBlocksCleared", APPLIED] += 1

    def clear(self, worker_id: str, dp_rank: int | None = None) -> None:
        """Drop a worker's entries: one rank, or every rank when ``dp_rank`` is None
        (restart, removal, unrecoverable gap). Speculative entries go too."""
        st = self._workers.get(worker_id)
        if st is None:
            return
        if dp_rank is None:
            for rank in sorted({k[1] for k in self._maps if k[0] == worker_id}):
                self._clear_rank(st, rank)
        else:
            self._clear_rank(st, dp_rank)
        self._clear_spec(st)

    # ---------------------------------------------------------------- stores
    def _store(self, st: _WorkerState, rank: int, ev: BlockStored) -> None:
        c = st.counters
        if ev.medium not in DEVICE_MEDIA:
            c["BlockStored", SKIPPED_MEDIUM] += 1
            return
        kind = ev.kv_cache_spec_kind
        group = ev.group_idx or 0
        # Only full attention carries every block (ENGINES.md §1.4); without a kind
        # (vLLM 0.20-0.21) only group 0 is trusted.
        if (kind is not None and kind != _FULL_ATTENTION) or (kind is None and group != 0):
            c["BlockStored", SKIPPED_GROUP] += 1
            return
        bs = ev.block_size
        if self.block_size is None:
            if not isinstance(bs, int) or bs <= 0:
                c["BlockStored", BAD_BLOCK_SIZE] += 1
                return
            self.block_size = bs
        elif bs != self.block_size:
            c["BlockStored", BAD_BLOCK_SIZE] += 1
            return
        hashes = ev.block_hashes
        n = len(hashes)
        # SGLang coalesces N pages into one store (N hashes, N*bs tokens); anything
        # else (partial pages, masked blocks) cannot be keyed block for block.
        if n == 0 or len(ev.token_ids) != n * bs:
            c["BlockStored", BAD_SHAPE] += 1
            return
        mk = (st.worker_id, rank, group)
        gm = self._maps.get(mk)
        parent_hash = ev.parent_block_hash
        if parent_hash is None:
            parent = ROOT_KEY
        else:
            p = gm.keys.get(parent_hash) if gm is not None else None
            if p is None:
                # The subtree is lost until replayed or re-stored (ENGINES.md §1.5 item 3).
                c["BlockStored", UNKNOWN_PARENT] += 1
                st.unknown_parent += 1
                if self.on_unknown_parent is not None:
                    self.on_unknown_parent(st.worker_id, rank)
                return
            parent = p
        extra = ev.extra_keys
        try:
            extras = [canon_extra(e) for e in extra] if extra else None
            rkeys = chain_keys(ev.token_ids, bs, extras, parent)
        except (TypeError, ValueError, OverflowError, msgspec.MsgspecError):
            c["BlockStored", BAD_SHAPE] += 1  # a hostile or garbled event, never fatal
            return
        if gm is None:
            gm = self._maps[mk] = _GroupMap()
        gkeys, gdups = gm.keys, gm.dups
        refs, bit, holders = st.refs, st.bit, self._holders
        spec = st.spec
        for h, rk in zip(hashes, rkeys):
            if h in gkeys:
                # Same physical content stored twice: refcount, keep the first key.
                gdups[h] = gdups.get(h, 1) + 1
                continue
            gkeys[h] = rk
            cnt = refs.get(rk)
            if cnt is None:
                refs[rk] = 1
                holders[rk] = holders.get(rk, 0) | bit
                if spec and rk in spec:
                    self._drop_spec_key(st, rk)  # confirmed by a real store
            else:
                refs[rk] = cnt + 1
        c["BlockStored", APPLIED] += 1

    # ---------------------------------------------------------------- removes
    def _remove(self, st: _WorkerState, rank: int, ev: BlockRemoved) -> None:
        c = st.counters
        if ev.medium not in DEVICE_MEDIA:
            # A host-tier remove says nothing about the device copy (ENGINES.md §3.1).
            c["BlockRemoved", SKIPPED_MEDIUM] += 1
            return
        gm = self._maps.get((st.worker_id, rank, ev.group_idx or 0))
        unknown = 0
        for h in ev.block_hashes:
            if gm is None or h not in gm.keys:
                unknown += 1
                continue
            d = gm.dups.get(h)
            if d is not None:
                if d > 2:
                    gm.dups[h] = d - 1
                else:
                    del gm.dups[h]
                continue
            self._release_key(st, gm.keys.pop(h))
        if unknown:
            c["BlockRemoved", UNKNOWN_HASH] += unknown
        c["BlockRemoved", APPLIED] += 1

    def _release_key(self, st: _WorkerState, rk: int) -> None:
        refs = st.refs
        cnt = refs[rk]
        if cnt > 1:
            refs[rk] = cnt - 1
            return
        del refs[rk]
        m = self._holders[rk] & ~st.bit
        if m:
            self._holders[rk] = m
        else:
            del self._holders[rk]

    def _clear_rank(self, st: _WorkerState, rank: int) -> None:
        for mk in [k for k in self._maps if k[0] == st.worker_id and k[1] == rank]:
            gm = self._maps.pop(mk)
            for rk in gm.keys.values():
                self._release_key(st, rk)

    # ---------------------------------------------------------------- speculative
    def insert_speculative(
        self, worker_id: str, keys: Sequence[int], ttl_s: float, now: float | None = None
    ) -> None:
        """Count ``keys`` as held by ``worker_id`` until ``now + ttl_s`` (monotonic
        clock), so a burst of one prefix sticks before the engine's events arrive.
        A real store of a key confirms (and removes) its speculative entry."""
        if ttl_s <= 0 or not keys:
            return
        if now is None:
            now = time.monotonic()
        self._prune_spec(now)
        st = self._state(worker_id)
        exp = now + ttl_s
        spec, refs, bit, smask = st.spec, st.refs, st.bit, self._spec_mask
        added = []
        for k in keys:
            if k in refs:
                continue  # really held: nothing to anticipate
            if k not in spec:
                smask[k] = smask.get(k, 0) | bit
            spec[k] = exp
            added.append(k)
        if added:
            self._spec_seq += 1
            heapq.heappush(self._spec_heap, (exp, self._spec_seq, st.slot, added))

    def drop_speculative(self, worker_id: str, keys: Sequence[int]) -> None:
        """Forget speculative entries of ``keys`` on ``worker_id`` (the request never
        reached it). Real stores are untouched."""
        st = self._workers.get(worker_id)
        if st is None or not st.spec:
            return
        for k in keys:
            if k in st.spec:
                self._drop_spec_key(st, k)

    def _drop_spec_key(self, st: _WorkerState, k: int) -> None:
        del st.spec[k]
        m = self._spec_mask[k] & ~st.bit
        if m:
            self._spec_mask[k] = m
        else:
            del self._spec_mask[k]

    def _clear_spec(self, st: _WorkerState) -> None:
        for k in list(st.spec):
            self._drop_spec_key(st, k)

    def _prune_spec(self, now: float) -> None:
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            _, _, slot, keys = heapq.heappop(heap)
            st = self._by_slot.get(slot)
            if st is None or not st.spec:
                continue
            spec = st.spec
            for k in keys:
                e = spec.get(k)
                if e is not None and e <= now:  # a later re-insert keeps it alive
                    self._drop_spec_key(st, k)

    # ---------------------------------------------------------------- lookup
    def overlaps(
        self, keys: Sequence[int], workers: Iterable[str], now: float | None = None
    ) -> dict[str, int]:
        """For each worker, the length of the longest leading run of ``keys`` it holds
        (real or unexpired speculative). Unknown workers get 0."""
        result: dict[str, int] = {}
        mask = 0
        for w in workers:
            result[w] = 0
            st = self._workers.get(w)
            if st is not None:
                mask |= st.bit
        if not mask or not keys:
            return result
        if self._spec_heap:
            self._prune_spec(time.monotonic() if now is None else now)
        holders = self._holders
        smask = self._spec_mask
        by_slot = self._by_slot
        i = 0
        for i, k in enumerate(keys):
            m = holders.get(k, 0)
            if smask:
                m |= smask.get(k, 0)
            new = mask & m
            if new != mask:
                self._record(mask & ~new, i, result, by_slot)
                mask = new
                if not mask:
                    return result
        self._record(mask, len(keys), result, by_slot)
        return result

    @staticmethod
    def _record(bits: int, n: int, result: dict[str, int], by_slot: dict[int, _WorkerState]) -> None:
        if not n:
            return
        while bits:
            low = bits & -bits
            result[by_slot[low.bit_length() - 1].worker_id] = n
            bits ^= low

    def holds(self, worker_id: str, key: int) -> bool:
        """Really held (not speculative)."""
        st = self._workers.get(worker_id)
        return st is not None and key in st.refs

    # ---------------------------------------------------------------- stats
    def block_count(self, worker_id: str) -> int:
        """Distinct router keys the worker really holds (all ranks and groups)."""
        st = self._workers.get(worker_id)
        return len(st.refs) if st is not None else 0

    def speculative_count(self, worker_id: str, now: float | None = None) -> int:
        st = self._workers.get(worker_id)
        if st is None:
            return 0
        if now is not None:
            self._prune_spec(now)
        return len(st.spec)

    def unknown_parent(self, worker_id: str) -> int:
        st = self._workers.get(worker_id)
        return st.unknown_parent if st is not None else 0

    def counters(self, worker_id: str) -> dict[tuple[str, str], int]:
        """(event type, status) -> count, shaped like ``metrics.kv_events`` labels."""
        st = self._workers.get(worker_id)
        return dict(st.counters) if st is not None else {}

    def status(self) -> dict[str, int]:
        """Totals by status over all workers and event types."""
        out: Counter[str] = Counter()
        for st in self._workers.values():
            for (_, status), n in st.counters.items():
                out[status] += n
        return dict(out)

    @property
    def total_keys(self) -> int:
        """Distinct router keys held by at least one worker."""
        return len(self._holders)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for ``/router/workers``."""
        workers: dict[str, Any] = {}
        for w, st in self._workers.items():
            ranks = sorted({k[1] for k in self._maps if k[0] == w})
            workers[w] = {
                "blocks": len(st.refs),
                "engine_hashes": sum(len(gm.keys) for k, gm in self._maps.items() if k[0] == w),
                "speculative": len(st.spec),
                "dp_ranks": ranks,
                "unknown_parent": st.unknown_parent,
                "events": {f"{t}:{s}": n for (t, s), n in sorted(st.counters.items())},
            }
        return {"block_size": self.block_size, "distinct_keys": len(self._holders), "workers": workers}
