"""PrefixIndex semantics, on the real engine captures where they show the behaviour."""

from __future__ import annotations

import pytest
from routing_helpers import load_capture, stores

from mmroute.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from mmroute.routing.index import PrefixIndex
from mmroute.routing.keys import ROOT_KEY, canon_extra, chain_keys

DUP_HASH = 17354731589568048877  # stored at seq 3 and 4, removed twice at seq 8


def batch(*events, dp_rank=0) -> EventBatch:
    return EventBatch(ts=0.0, events=list(events), dp_rank=dp_rank)


def stored(hashes, tokens, parent=None, bs=4, **kw) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens), block_size=bs, **kw)


TOKS = list(range(100, 116))  # 4 blocks of 4
KEYS = chain_keys(TOKS, 4)


def chain4(idx: PrefixIndex, worker="w", rank=0, hashes=(1, 2, 3, 4), **kw) -> None:
    idx.apply(worker, rank, batch(stored(hashes, TOKS, **kw)))


# ---------------------------------------------------------------- real vLLM 0.33 capture
def test_vllm_033_capture_block_counts_and_refcounted_duplicate():
    cap = load_capture("vllm-0.33.0_events.jsonl")
    assert [s for s, _ in cap] == list(range(10))
    idx = PrefixIndex()
    counts = []
    for seq, b in cap[:8]:
        idx.apply("w", 0, b)
        counts.append(idx.block_count("w"))
    # text 2, +decode 1, +decode 1, +32-token prompt 1, duplicate +0, image 26, salted 2, img-B 26
    assert counts == [2, 3, 4, 5, 5, 31, 33, 59]
    assert idx.block_size == 16

    # The duplicate's router key: block 1 of the 32-token prompt (parent = block 0 of seq 0).
    s0, s3 = stores(cap[0][1])[0], stores(cap[3][1])[0]
    prompt32 = s0.token_ids[:16] + s3.token_ids
    keys32 = chain_keys(prompt32, 16)
    assert idx.overlaps(keys32, ["w"]) == {"w": 2}

    ev8 = cap[8][1].events
    removes = [e for e in ev8 if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in removes].count(DUP_HASH) == 2
    first_dup = next(i for i, e in enumerate(ev8) if isinstance(e, BlockRemoved) and e.block_hashes == [DUP_HASH])
    # Up to and including the first remove of the duplicate: still held (refcount 2 -> 1).
    idx.apply("w", 0, batch(*ev8[: first_dup + 1]))
    assert idx.overlaps(keys32, ["w"]) == {"w": 2}
    assert idx.holds("w", keys32[1])
    # The second remove drops it.
    idx.apply("w", 0, batch(ev8[first_dup + 1]))
    assert not idx.holds("w", keys32[1])
    assert idx.overlaps(keys32, ["w"]) == {"w": 1}
    idx.apply("w", 0, batch(*ev8[first_dup + 2 :]))
    assert idx.block_count("w") == 59 - 5 - 18 + 26
    assert idx.counters("w").get(("BlockRemoved", "unknown_hash"), 0) == 0
    idx.apply("w", 0, cap[9][1])  # AllBlocksCleared
    assert idx.block_count("w") == 0
    assert idx.total_keys == 0
    assert idx.overlaps(keys32, ["w"]) == {"w": 0}
    st = idx.status()
    assert st["applied"] == 9 + 24 + 1
    assert st.get("unknown_parent", 0) == 0


def test_decode_blocks_chain_through_parent_map():
    cap = load_capture("vllm-0.33.0_events.jsonl")
    idx = PrefixIndex()
    for _, b in cap[:3]:
        idx.apply("w", 0, b)
    s0, s1, s2 = (stores(cap[i][1])[0] for i in range(3))
    # The decode blocks' keys chain from the prompt's: the concatenation keys equal.
    full = s0.token_ids + s1.token_ids + s2.token_ids
    assert idx.overlaps(chain_keys(full, 16), ["w"]) == {"w": 4}


def test_unknown_parent_counted_not_indexed_and_callback():
    cap = load_capture("vllm-0.33.0_events.jsonl")
    calls = []
    idx = PrefixIndex(on_unknown_parent=lambda w, r: calls.append((w, r)))
    idx.apply("w", 3, cap[1][1])  # decode block whose parent (seq 0) we never saw
    assert idx.block_count("w") == 0
    assert idx.unknown_parent("w") == 1
    assert calls == [("w", 3)]
    assert idx.counters("w") == {("BlockStored", "unknown_parent"): 1}
    # A replay from seq 0 then fixes it.
    for _, b in cap[:3]:
        idx.apply("w", 3, b)
    assert idx.block_count("w") == 4
    assert idx.unknown_parent("w") == 1


def test_parent_resolution_is_per_rank():
    idx = PrefixIndex()
    idx.apply("w", 0, batch(stored([1, 2], TOKS[:8])))
    idx.apply("w", 1, batch(stored([3, 4], TOKS[8:], parent=2)))  # parent only on rank 0
    assert idx.unknown_parent("w") == 1
    idx.apply("w", 0, batch(stored([3, 4], TOKS[8:], parent=2)))
    assert idx.overlaps(KEYS, ["w"]) == {"w": 4}


# ---------------------------------------------------------------- filters
def test_block_size_configured_mismatch_rejected():
    cap = load_capture("vllm-0.33.0_events.jsonl")
    idx = PrefixIndex(block_size=32)
    idx.apply("w", 0, cap[0][1])
    assert idx.block_count("w") == 0
    assert idx.counters("w") == {("BlockStored", "bad_block_size"): 1}


def test_block_size_learned_then_mismatch_rejected():
    idx = PrefixIndex()
    chain4(idx)
    assert idx.block_size == 4
    idx.apply("w", 0, batch(stored([9], range(8), bs=8)))
    assert idx.block_count("w") == 4
    assert idx.counters("w")[("BlockStored", "bad_block_size")] == 1
    with pytest.raises(ValueError):
        PrefixIndex(block_size=0)


def test_bad_shape_counted():
    idx = PrefixIndex(block_size=4)
    idx.apply("w", 0, batch(stored([1, 2], range(6))))  # 6 tokens for 2 hashes
    idx.apply("w", 0, batch(stored([1], range(8))))  # fewer hashes than blocks (sliding window)
    idx.apply("w", 0, batch(stored([], [])))
    assert idx.block_count("w") == 0
    assert idx.counters("w") == {("BlockStored", "bad_shape"): 3}


def test_medium_tiers_cpu_store_ignored_gpu_remove_only():
    idx = PrefixIndex()
    chain4(idx, medium="GPU")
    idx.apply("w", 0, batch(stored([11, 12], range(8), medium="CPU_PINNED")))
    assert idx.block_count("w") == 4
    # A host-tier remove of a device-held hash leaves the device copy.
    idx.apply("w", 0, batch(BlockRemoved([3, 4], medium="CPU")))
    assert idx.overlaps(KEYS, ["w"]) == {"w": 4}
    idx.apply("w", 0, batch(BlockRemoved([3, 4], medium="GPU")))
    assert idx.overlaps(KEYS, ["w"]) == {"w": 2}
    c = idx.counters("w")
    assert c[("BlockStored", "skipped_medium")] == 1
    assert c[("BlockRemoved", "skipped_medium")] == 1
    # medium None (older engines) is a device hit too.
    idx.apply("v", 0, batch(stored([1], TOKS[:4], medium=None)))
    assert idx.block_count("v") == 1


def test_only_full_attention_groups():
    idx = PrefixIndex()
    chain4(idx, hashes=(1, 2, 3, 4), kv_cache_spec_kind="sliding_window", group_idx=1)
    chain4(idx, hashes=(5, 6, 7, 8), kv_cache_spec_kind=None, group_idx=2)  # no kind: group 0 only
    assert idx.block_count("w") == 0
    assert idx.counters("w") == {("BlockStored", "skipped_group"): 2}
    chain4(idx, hashes=(1, 2, 3, 4), kv_cache_spec_kind="full_attention", group_idx=1)
    assert idx.block_count("w") == 4
    # Removes are resolved in their own group's map.
    idx.apply("w", 0, batch(BlockRemoved([1, 2, 3, 4], medium="GPU", group_idx=0)))
    assert idx.block_count("w") == 4
    idx.apply("w", 0, batch(BlockRemoved([1, 2, 3, 4], medium="GPU", group_idx=1)))
    assert idx.block_count("w") == 0


def test_unknown_remove_ignored_and_counted():
    idx = PrefixIndex()
    chain4(idx)
    idx.apply("w", 0, batch(BlockRemoved([99, 98, 1])))
    assert idx.block_count("w") == 3
    assert idx.counters("w")[("BlockRemoved", "unknown_hash")] == 2


def test_hostile_tokens_do_not_raise():
    idx = PrefixIndex(block_size=2)
    idx.apply("w", 0, batch(stored([1], ["a", "b"], bs=2)))
    assert idx.counters("w") == {("BlockStored", "bad_shape"): 1}


# ---------------------------------------------------------------- clears and ranks
def test_all_blocks_cleared_only_that_rank():
    idx = PrefixIndex()
    chain4(idx, rank=0)
    chain4(idx, rank=1, hashes=(5, 6, 7, 8))
    chain4(idx, worker="x")
    assert idx.block_count("w") == 4  # same keys on two ranks: distinct keys
    idx.apply("w", 0, batch(AllBlocksCleared()))
    assert idx.overlaps(KEYS, ["w", "x"]) == {"w": 4, "x": 4}  # rank 1 still holds them
    idx.apply("w", 1, batch(AllBlocksCleared()))
    assert idx.overlaps(KEYS, ["w", "x"]) == {"w": 0, "x": 4}
    assert idx.block_count("x") == 4


def test_clear_rank_and_all():
    idx = PrefixIndex()
    chain4(idx, rank=0)
    chain4(idx, rank=1, hashes=(5, 6, 7, 8))
    idx.clear("w", 1)
    assert idx.block_count("w") == 4
    chain4(idx, rank=1, hashes=(5, 6, 7, 8))
    idx.clear("w", None)
    assert idx.block_count("w") == 0
    assert idx.total_keys == 0
    idx.clear("nobody", None)  # unknown worker: no-op
    # The maps are gone too: a later remove of a cleared hash is unknown.
    idx.apply("w", 0, batch(BlockRemoved([1])))
    assert idx.counters("w")[("BlockRemoved", "unknown_hash")] == 1


def test_remove_worker_frees_slot_without_leaking_bits():
    idx = PrefixIndex()
    chain4(idx, worker="a")
    chain4(idx, worker="b")
    idx.remove_worker("a")
    assert "a" not in idx.workers
    idx.apply("c", 0, batch(stored([1], TOKS[:4])))  # reuses a's slot
    assert idx.overlaps(KEYS, ["a", "b", "c"]) == {"a": 0, "b": 4, "c": 1}


# ---------------------------------------------------------------- lookup
def test_overlap_longest_leading_run_stops_at_gap():
    idx = PrefixIndex()
    chain4(idx, worker="a")
    chain4(idx, worker="b")
    idx.apply("b", 0, batch(BlockRemoved([2])))  # b keeps blocks 0, 2, 3
    idx.apply("c", 0, batch(stored([1, 2], TOKS[:8])))
    assert idx.holds("b", KEYS[2]) and idx.holds("b", KEYS[3])
    assert idx.overlaps(KEYS, ["a", "b", "c", "d"]) == {"a": 4, "b": 1, "c": 2, "d": 0}
    # Keys are plain lookups: a run starting mid-chain counts, b's gap at key 1 stops it.
    assert idx.overlaps(KEYS[1:], ["a", "b"]) == {"a": 3, "b": 0}
    assert idx.overlaps(KEYS[2:], ["a", "b"]) == {"a": 2, "b": 2}
    assert idx.overlaps([], ["a"]) == {"a": 0}
    assert idx.overlaps(KEYS, []) == {}


def test_many_workers_bitmask():
    idx = PrefixIndex()
    for i in range(100):
        n = i % 5
        if n:
            idx.apply(f"w{i}", 0, batch(stored(range(1, n + 1), TOKS[: 4 * n])))
    got = idx.overlaps(KEYS, [f"w{i}" for i in range(100)])
    assert got == {f"w{i}": i % 5 for i in range(100)}


def test_extra_keys_enter_router_key():
    idx = PrefixIndex()
    ek = [[["img", 1]], [["img", -3]], None, None]
    chain4(idx, extra_keys=ek)
    plain = KEYS
    withimg = chain_keys(TOKS, 4, [canon_extra(e) for e in ek])
    assert idx.overlaps(plain, ["w"]) == {"w": 0}
    assert idx.overlaps(withimg, ["w"]) == {"w": 4}


# ---------------------------------------------------------------- speculative
def test_speculative_ttl_expiry_with_injected_time():
    idx = PrefixIndex()
    idx.insert_speculative("w", KEYS[:3], ttl_s=2.0, now=100.0)
    assert idx.overlaps(KEYS, ["w"], now=100.0) == {"w": 3}
    assert idx.overlaps(KEYS, ["w"], now=101.999) == {"w": 3}
    assert idx.speculative_count("w") == 3
    assert idx.overlaps(KEYS, ["w"], now=102.0) == {"w": 0}
    assert idx.speculative_count("w") == 0
    assert idx.block_count("w") == 0


def test_speculative_reinsert_extends_and_combines_with_real():
    idx = PrefixIndex()
    idx.apply("w", 0, batch(stored([1, 2], TOKS[:8])))
    idx.insert_speculative("w", KEYS, ttl_s=2.0, now=100.0)
    # Really held keys are not duplicated as speculative ones.
    assert idx.speculative_count("w") == 2
    idx.insert_speculative("w", KEYS[2:3], ttl_s=2.0, now=101.0)
    assert idx.overlaps(KEYS, ["w"], now=102.5) == {"w": 3}
    assert idx.overlaps(KEYS, ["w"], now=103.0) == {"w": 2}
    assert idx.block_count("w") == 2
    assert idx.total_keys == 2


def test_speculative_confirmed_by_real_store_then_evicted():
    idx = PrefixIndex()
    idx.insert_speculative("w", KEYS, ttl_s=10.0, now=100.0)
    chain4(idx)  # the real store confirms all four
    assert idx.speculative_count("w") == 0
    idx.apply("w", 0, batch(BlockRemoved([1, 2, 3, 4])))
    # Evicted for real before the TTL: the (dropped) speculative entry does not resurrect it.
    assert idx.overlaps(KEYS, ["w"], now=101.0) == {"w": 0}
    assert idx.total_keys == 0


def test_speculative_does_not_corrupt_refcounts_or_other_workers():
    idx = PrefixIndex()
    chain4(idx, worker="a")
    idx.insert_speculative("b", KEYS, ttl_s=1.0, now=0.0)
    idx.insert_speculative("a", KEYS, ttl_s=1.0, now=0.0)  # a holds them: no-op
    assert idx.overlaps(KEYS, ["a", "b"], now=0.5) == {"a": 4, "b": 4}
    idx.apply("a", 0, batch(BlockRemoved([1, 2, 3, 4])))
    assert idx.overlaps(KEYS, ["a", "b"], now=0.5) == {"a": 0, "b": 4}
    assert idx.overlaps(KEYS, ["a", "b"], now=1.0) == {"a": 0, "b": 0}
    idx.insert_speculative("b", KEYS, ttl_s=1.0, now=5.0)
    idx.clear("b", None)  # a clear drops speculative entries too
    assert idx.overlaps(KEYS, ["b"], now=5.1) == {"b": 0}
    assert idx.snapshot()["workers"]["b"]["speculative"] == 0


# ---------------------------------------------------------------- SGLang coalesced stores
def test_sglang_0523_coalesced_stores_and_removes():
    cap = load_capture("sglang-0.5.23_events.jsonl")
    assert [s for s, _ in cap] == list(range(1, 10))
    idx = PrefixIndex()
    counts = []
    for _, b in cap:
        idx.apply("s", 0, b)
        counts.append(idx.block_count("s"))
    assert counts == [2, 3, 9, 10, 14, 15, 11, 12, 0]
    assert idx.block_size == 16
    c = idx.counters("s")
    assert c[("BlockStored", "applied")] == 8
    assert c[("BlockRemoved", "applied")] == 1
    assert c.get(("BlockRemoved", "unknown_hash"), 0) == 0
    assert idx.unknown_parent("s") == 0


def test_sglang_coalesced_store_keys_equal_per_page_stores():
    # One coalesced store of N pages == N chained single-page stores (older builds).
    cap = load_capture("sglang-0.5.23_events.jsonl")
    big = stores(cap[2][1])[0]
    assert len(big.block_hashes) == 6 and len(big.token_ids) == 96
    a, b = PrefixIndex(), PrefixIndex()
    a.apply("s", 0, batch(big))
    parent = None
    for i, h in enumerate(big.block_hashes):
        b.apply("s", 0, batch(stored([h], big.token_ids[16 * i : 16 * i + 16], parent=parent, bs=16)))
        parent = h
    keys = chain_keys(big.token_ids, 16)
    assert a.overlaps(keys, ["s"]) == b.overlaps(keys, ["s"]) == {"s": 6}


def test_snapshot_shape():
    idx = PrefixIndex()
    chain4(idx)
    snap = idx.snapshot()
    assert snap["block_size"] == 4
    assert snap["distinct_keys"] == 4
    w = snap["workers"]["w"]
    assert w["blocks"] == 4 and w["engine_hashes"] == 4 and w["dp_ranks"] == [0]
    assert w["events"] == {"BlockStored:applied": 1}
    assert ROOT_KEY not in idx._holders


def test_drop_speculative_leaves_real_stores():
    from mmroute.kv.events import BlockStored, EventBatch
    from mmroute.routing.keys import chain_keys

    idx = PrefixIndex(block_size=4)
    toks = list(range(16))
    keys = chain_keys(toks, 4)
    idx.apply("w", 0, EventBatch(0.0, [BlockStored([1, 2], None, toks[:8], 4)]))
    idx.insert_speculative("w", keys, ttl_s=60, now=0.0)
    assert idx.overlaps(keys, ["w"], now=1.0) == {"w": 4}
    idx.drop_speculative("w", keys)
    assert idx.overlaps(keys, ["w"], now=1.0) == {"w": 2}  # the two stored blocks stay
    assert idx.speculative_count("w", now=1.0) == 0
    idx.drop_speculative("nobody", keys)  # unknown worker: no-op
