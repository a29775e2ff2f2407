"""vLLM's paged prefix cache, emulated at token level (no model, no GPU).

Mirrors vLLM 0.33 ``vllm/v1/core/block_pool.py`` / ``kv_cache_utils.py`` closely
enough that, fed the same token ids, it publishes the same event stream (hashes,
parents, order; tests replay ``tests/fixtures/kv_events/vllm-0.33.0_events.jsonl``):

* ``num_blocks`` physical blocks; block 0 is the null block, never used.
* A free queue in eviction order (initially by block id). A request's blocks are
  freed *in reverse* (tail first), so the LRU head evicts chain tails first; since
  0.24 freed blocks without a hash (partial tails) go to the head instead.
* Cached full blocks stay in the hash map while free; allocating a free block that
  still carries a hash evicts it: one ``BlockRemoved`` per hash.
* Physical blocks are not de-duplicated: two requests computing the same block both
  store it (duplicate ``BlockStored``, later two removes).
* Prefix hits are capped at ``P - 1`` tokens (the last prompt token is always
  recomputed), block-aligned: a full repeat reports ``floor((P-1)/bs)*bs``.
* Only full blocks are hashed and stored: the prompt's at prefill, then one store per
  decode step that fills a block. The last sampled token is never computed, so at
  most ``P + n_out - 1`` tokens are cached.
* Events of one step form one batch, removes (allocation) before stores.

Single-threaded: call it from one thread (the sim server's event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from mmroute.sim.engine_common import CapacityError, Emit, EngineCore
from mmroute.sim.vllm_hash import LoraRef, MMSpan, VllmBlockHasher, wire_hash
from mmroute.sim.wire import Cleared, Removed, Stored

__all__ = ["CapacityError", "VllmEngine", "VllmSeq"]


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass
class VllmSeq:
    """One request's state in the engine."""

    request_id: str
    prompt_ids: list[int]
    mm: list[MMSpan] = field(default_factory=list)
    lora: LoraRef | None = None
    cache_salt: str | None = None
    # filled by the engine
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    block_extras: list[list | None] = field(default_factory=list)
    blocks: list[_Block] = field(default_factory=list)
    num_cached_blocks: int = 0
    reserved: int = 0  # blocks promised at admission, not yet allocated
    num_cached_tokens: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        self.mm = sorted(self.mm, key=lambda m: m.offset)
        self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)


class VllmEngine(EngineCore):
    """Block pool + per-request bookkeeping; publishes through ``emit``."""

    UNIT, POOL = "blocks", "cache"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hasher: VllmBlockHasher | None = None,
        *,
        int_hashes: bool = True,
        hashless_first: bool = True,
        emit: Emit | None = None,
    ):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        super().__init__(emit)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.hasher = hasher or VllmBlockHasher()
        self.int_hashes = int_hashes
        # False: vLLM <= 0.23, where every freed block goes to the tail.
        self.hashless_first = hashless_first
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free queue, head = next to allocate/evict. Block 0 is the null block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, dict[int, _Block]] = {}

    # --- pool ------------------------------------------------------------------------

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def unit_tokens(self) -> int:
        return self.block_size

    @property
    def capacity(self) -> int:
        return self.usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """vllm:kv_cache_usage_perc: 1 - free/usable."""
        return 1.0 - self.num_free_blocks / self.usable_blocks

    def _wire(self, digest: bytes) -> int | bytes:
        return wire_hash(digest, self.int_hashes)

    def _cached_block(self, h: bytes) -> _Block | None:
        # block_pool.get_cached_block: the first physical block carrying the hash.
        blocks = self._cached.get(h)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def _evict_if_cached(self, blk: _Block) -> None:
        h = blk.block_hash
        if h is None:
            return
        holders = self._cached.get(h)
        if holders is not None and holders.pop(blk.block_id, None) is not None:
            if not holders:
                del self._cached[h]
            self._pending.append(Removed([self._wire(h)]))
        blk.block_hash = None

    def _allocate(self, n: int) -> list[_Block]:
        if n > len(self._free):
            raise CapacityError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            blk = self._blocks[bid]
            self._evict_if_cached(blk)
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def _touch(self, blocks: Sequence[_Block]) -> None:
        for blk in blocks:
            if blk.ref_cnt == 0:
                self._free.pop(blk.block_id, None)
            blk.ref_cnt += 1

    def _free_blocks(self, ordered: Sequence[_Block]) -> None:
        without_hash: list[_Block] = []
        for blk in ordered:
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is None and self.hashless_first:
                    without_hash.append(blk)
                else:
                    self._free[blk.block_id] = None
        # vLLM >= 0.24 block_pool.free_blocks: blocks without a hash have no cache
        # value, so they go to the head (prepend_n keeps their order) and are reused first.
        for blk in reversed(without_hash):
            self._free[blk.block_id] = None
            self._free.move_to_end(blk.block_id, last=False)

    # --- hashing -----------------------------------------------------------------------

    def _update_hashes(self, seq: VllmSeq) -> None:
        """Hash every newly full block of ``seq.token_ids`` (request_block_hasher)."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= len(seq.token_ids):
            i = len(seq.block_hashes)
            start, end = i * bs, (i + 1) * bs
            hash_extra, event_extra = self.hasher.extra_keys(start, end, seq.mm, seq.lora, seq.cache_salt)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(self.hasher.block_hash(parent, seq.token_ids[start:end], hash_extra))
            seq.block_extras.append(event_extra)

    def _cache_full_blocks(self, seq: VllmSeq, num_tokens: int) -> None:
        """block_pool.cache_full_blocks: store blocks [num_cached, num_tokens // bs)."""
        bs = self.block_size
        num_full = min(num_tokens, len(seq.token_ids)) // bs
        start = seq.num_cached_blocks
        if num_full <= start:
            return
        self._update_hashes(seq)
        parent = seq.block_hashes[start - 1] if start > 0 else None
        new_hashes = []
        for i in range(start, num_full):
            blk = seq.blocks[i]
            h = seq.block_hashes[i]
            blk.block_hash = h
            self._cached.setdefault(h, {})[blk.block_id] = blk
            new_hashes.append(self._wire(h))
        seq.num_cached_blocks = num_full
        lora = seq.lora
        self._pending.append(
            Stored(
                block_hashes=new_hashes,
                parent_block_hash=self._wire(parent) if parent is not None else None,
                token_ids=seq.token_ids[start * bs : num_full * bs],
                block_size=bs,
                lora_id=lora.int_id if lora else None,
                lora_name=lora.name if lora else None,
                extra_keys=seq.block_extras[start:num_full],
            )
        )

    # --- request lifecycle ----------------------------------------------------------------

    def _hit_blocks(self, seq: VllmSeq) -> list[_Block]:
        """find_longest_cache_hit over at most P-1 tokens."""
        self._update_hashes(seq)
        max_blocks = (seq.num_prompt - 1) // self.block_size
        hits: list[_Block] = []
        for h in seq.block_hashes[:max_blocks]:
            blk = self._cached_block(h)
            if blk is None:
                break
            hits.append(blk)
        return hits

    def try_prefill(self, seq: VllmSeq, max_new_tokens: int) -> int | None:
        """Admit ``seq`` and run its prefill step if its whole lifetime fits in the free
        blocks not promised to running requests; return its ``cached_tokens``, or None
        (still waiting: nothing changed). Publishes the step's batch."""
        self._check_new(seq, max_new_tokens)
        hits = self._hit_blocks(seq)
        lifetime_new = self._lifetime(seq, max_new_tokens) - len(hits)
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if self.num_free_blocks - self._reserved_total < lifetime_new + free_hits:
            return None
        self._count_prefill(seq.num_prompt, len(hits) * self.block_size)
        self._touch(hits)
        prompt_blocks = -(-seq.num_prompt // self.block_size)
        seq.blocks = list(hits) + self._allocate(prompt_blocks - len(hits))
        seq.num_cached_blocks = len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        self._start(seq, lifetime_new - (prompt_blocks - len(hits)))
        self._cache_full_blocks(seq, seq.num_prompt)
        self._flush()
        return seq.num_cached_tokens

    def append_token(self, seq: VllmSeq, token_id: int, *, compute: bool) -> None:
        """A token was sampled. ``compute``: the request continues, so the next step
        computes this token (allocate its slot, store blocks it fills)."""
        self._add_token(seq, token_id)
        if not compute:
            return
        needed = -(-len(seq.token_ids) // self.block_size) - len(seq.blocks)
        if needed > 0:
            self._take_reserved(seq, needed)
            seq.blocks.extend(self._allocate(needed))
        self._cache_full_blocks(seq, len(seq.token_ids))
        self._flush()

    def finish(self, seq: VllmSeq) -> None:
        """Free the request's blocks, tail first (SingleTypeKVCacheManager.free)."""
        if not self._retire(seq):
            return
        self._free_blocks(list(reversed(seq.blocks)))
        seq.blocks = []
        self._flush()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash if no request holds a block; AllBlocksCleared."""
        if self.num_free_blocks != self.usable_blocks:
            return False
        for blk in self._blocks:
            blk.block_hash = None
        self._cached.clear()
        self._pending.append(Cleared())
        self._flush()
        return True

    def num_cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())
