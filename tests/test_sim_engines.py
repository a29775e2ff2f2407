"""Cache semantics of the simulated engines.

The strongest checks replay the scenario behind a real capture through the simulated
engine and require the *same payload bytes* (timestamps taken from the capture): the
vLLM 0.33.0 stream (prefix hits, decode blocks, duplicate stores, LRU eviction order,
reset) and the SGLang 0.5.22/0.5.23 streams (radix splits, coalesced stores/removes,
wide and legacy pad values).
"""

from __future__ import annotations

import msgspec
import pytest

from mmroute.sim.sglang_engine import SglangEngine, SglangSeq
from mmroute.sim.sglang_hash import fill_span, pad_values
from mmroute.sim.vllm_engine import CapacityError, VllmEngine, VllmSeq
from mmroute.sim.vllm_hash import LoraRef, MMSpan, VllmBlockHasher
from mmroute.sim.wire import Cleared, Removed, Stored, WireEncoder
from sim_helpers import load_capture, stored_tokens

# --- vLLM ---------------------------------------------------------------------------------


def _vllm(num_blocks=64, bs=16, algo="sha256", **kw):
    batches: list = []
    eng = VllmEngine(num_blocks, bs, VllmBlockHasher(algo), emit=batches.append, **kw)
    return eng, batches


def _run_vllm(eng, rid, prompt, outputs, **seq_kw):
    seq = VllmSeq(rid, prompt, **seq_kw)
    cached = eng.try_prefill(seq, len(outputs))
    assert cached is not None
    for i, tok in enumerate(outputs):
        eng.append_token(seq, tok, compute=i < len(outputs) - 1)
    eng.finish(seq)
    return cached


def test_vllm_replays_real_0_33_capture_byte_for_byte():
    lines = load_capture("vllm-0.33.0_events.jsonl")
    text = stored_tokens(lines[0]) + stored_tokens(lines[1])[:12]  # the 44-token chat
    outputs = stored_tokens(lines[1])[12:] + stored_tokens(lines[2]) + [1, 2, 3, 4]
    p32 = stored_tokens(lines[0])[:16] + stored_tokens(lines[3])
    image = stored_tokens(lines[5]) + [151644, 77091, 198]
    image_no_uuid = stored_tokens(lines[8]) + [77091, 198]
    blake = lines[8]["decoded"][1][-1]["extra_keys"][0][0][0]
    eng, batches = _vllm()
    cached = [
        _run_vllm(eng, "r1", text, outputs[:4]),
        _run_vllm(eng, "r2", text, outputs[:24]),
        _run_vllm(eng, "r3", p32, outputs[:4]),
        _run_vllm(eng, "r4", p32, outputs[:4]),
        _run_vllm(eng, "r5", image, outputs[:4], mm=[MMSpan("img-A", 15, 391)]),
        _run_vllm(eng, "r6", text, outputs[:4], cache_salt="tenant-42"),
        _run_vllm(eng, "r7", image, outputs[:4], mm=[MMSpan("img-B", 15, 391)]),
        _run_vllm(eng, "r8", image_no_uuid, outputs[:4], mm=[MMSpan(blake, 15, 391)]),
    ]
    # usage.prompt_tokens_details.cached_tokens the real server reported
    assert cached == [0, 32, 16, 16, 0, 0, 0, 0]
    assert eng.reset_prefix_cache()
    enc = WireEncoder("vllm-map")
    assert len(batches) == len(lines)
    for records, line in zip(batches, lines):
        assert enc.encode(line["decoded"][0], records).hex() == line["frames_hex"][-1], line["note"]


def test_vllm_bytes_hashes_replay_matches_capture():
    lines = load_capture("vllm-0.33.0_bytes-hashes_events.jsonl")
    text = stored_tokens(lines[0]) + stored_tokens(lines[1])[:12]
    outputs = stored_tokens(lines[1])[12:] + stored_tokens(lines[2]) + [1, 2, 3, 4]
    eng, batches = _vllm(int_hashes=False)
    _run_vllm(eng, "r1", text, outputs[:4])
    _run_vllm(eng, "r2", text, outputs[:24])
    enc = WireEncoder("vllm-map")
    for records, line in zip(batches, lines[:3]):
        assert enc.encode(line["decoded"][0], records).hex() == line["frames_hex"][-1]


def test_vllm_0_23_capture_same_shape_and_eviction_pattern():
    """0.23 seeded NONE_HASH randomly, so compare modulo a consistent renaming of hashes."""
    lines = load_capture("vllm-0.23.0_events.jsonl")
    r1 = stored_tokens(lines[0]) + [1, 2, 3, 4]
    r2 = stored_tokens(lines[1]) + [5, 6, 7, 8]
    r3 = stored_tokens(lines[2]) + list(range(11))
    eng, batches = _vllm(num_blocks=9, hashless_first=False)
    eng.hasher = VllmBlockHasher("sha256", "plain")
    lora = LoraRef("sql-adapter", 7, "/adapters/sql")
    _run_vllm(eng, "r1", r1, [9], mm=[MMSpan("img-A", 15, 40)], lora=lora)
    _run_vllm(eng, "r2", r2, [9], cache_salt="tenant-42")
    _run_vllm(eng, "r3", r3, [9])
    assert eng.reset_prefix_cache()
    rename: dict = {}
    enc = WireEncoder("vllm-array")
    assert len(batches) == len(lines)
    for records, line in zip(batches, lines):
        theirs = line["decoded"][1]
        assert len(records) == len(theirs)
        for mine, their in zip(records, theirs):
            assert type(mine).__name__ == {"BlockStored": "Stored", "BlockRemoved": "Removed", "AllBlocksCleared": "Cleared"}[their[0]]
            if isinstance(mine, Stored):
                assert mine.token_ids == their[3] and mine.extra_keys == their[8]
                assert (mine.lora_id, mine.lora_name) == (their[5], their[7])
                for a, b in zip(mine.block_hashes, their[1]):
                    assert rename.setdefault(a, b) == b
                assert (mine.parent_block_hash is None) == (their[2] is None)
            elif isinstance(mine, Removed):
                assert [rename[a] for a in mine.block_hashes] == their[1]
        mine_encoded = msgspec.msgpack.decode(enc.encode(0.0, records))[1]
        assert [len(e) for e in mine_encoded] == [len(e) for e in theirs]  # 12 / 4 / 1 positions


def test_vllm_cached_tokens_full_repeat_is_floor_p_minus_1():
    for P in (16, 17, 31, 32, 33, 47):
        eng, _ = _vllm(algo="sha256_cbor")
        prompt = list(range(1000, 1000 + P))
        assert _run_vllm(eng, "a", prompt, [1, 2]) == 0
        assert _run_vllm(eng, "b", prompt, [1, 2]) == (P - 1) // 16 * 16


def test_vllm_lru_eviction_emits_one_remove_per_hash_before_stores():
    eng, batches = _vllm(num_blocks=5, algo="sha256_cbor")  # 4 usable
    _run_vllm(eng, "a", list(range(32)), [1])  # 2 full blocks cached
    first = batches[-1][0]
    assert isinstance(first, Stored) and first.parent_block_hash is None and len(first.block_hashes) == 2
    _run_vllm(eng, "b", list(range(100, 164)), [1])  # needs all 4 blocks
    last = batches[-1]
    assert [type(r) for r in last] == [Removed, Removed, Stored]
    # tail of the chain is evicted first (blocks are freed in reverse order)
    assert [r.block_hashes[0] for r in last[:2]] == list(reversed(first.block_hashes))
    assert eng.num_cached_blocks() == 4


def test_vllm_decode_blocks_stored_one_batch_per_filled_block():
    eng, batches = _vllm(algo="sha256_cbor")
    _run_vllm(eng, "a", list(range(20)), list(range(500, 530)))  # 20 + 29 computed = 49 -> 3 blocks
    assert [len(b) for b in batches] == [1, 1, 1]
    s0, s1, s2 = (b[0] for b in batches)
    assert len(s0.block_hashes) == 1 and s0.parent_block_hash is None
    assert s1.parent_block_hash == s0.block_hashes[0] and s2.parent_block_hash == s1.block_hashes[0]
    assert s1.token_ids == list(range(16, 20)) + list(range(500, 512))


def test_vllm_lora_and_salt_key_blocks():
    eng, batches = _vllm(algo="sha256_cbor")
    prompt = list(range(40))
    _run_vllm(eng, "a", prompt, [1])
    _run_vllm(eng, "b", prompt, [1], lora=LoraRef("ad", 1, "/p"))
    _run_vllm(eng, "c", prompt, [1], cache_salt="s")
    plain, lora, salt = (b[0] for b in batches)
    assert lora.extra_keys == [["ad"], ["ad"]] and (lora.lora_id, lora.lora_name) == (1, "ad")
    assert salt.extra_keys == [["s"], None]
    assert len({plain.block_hashes[0], lora.block_hashes[0], salt.block_hashes[0]}) == 3
    # the salt only keys block 0, but block 1 chains from it, so it differs too
    assert salt.block_hashes[1] != plain.block_hashes[1]


def test_vllm_concurrent_duplicates_and_admission():
    eng, batches = _vllm(num_blocks=9, algo="sha256_cbor")  # 8 usable
    a, b = VllmSeq("a", list(range(40))), VllmSeq("b", list(range(40)))
    assert eng.try_prefill(a, 8) == 0
    assert eng.try_prefill(b, 8) == 32  # a's blocks are already in the hash map
    c = VllmSeq("c", list(range(100, 140)))
    assert eng.try_prefill(c, 30) is None  # would not fit next to a and b: waits
    assert c.request_id not in eng.running
    with pytest.raises(CapacityError):
        eng.try_prefill(VllmSeq("d", list(range(200))), 1)
    eng.finish(a)
    eng.finish(b)
    assert eng.try_prefill(c, 30) == 0
    eng.finish(c)
    assert eng.num_free_blocks == 8
    assert not eng.reset_prefix_cache() or eng.num_cached_blocks() == 0


def test_vllm_reset_refused_while_running():
    eng, batches = _vllm(algo="sha256_cbor")
    s = VllmSeq("a", list(range(40)))
    eng.try_prefill(s, 4)
    assert eng.reset_prefix_cache() is False
    eng.finish(s)
    assert eng.reset_prefix_cache() is True
    assert batches[-1] == [Cleared()]
    assert _run_vllm(eng, "b", list(range(40)), [1]) == 0


# --- SGLang -------------------------------------------------------------------------------


def _run_sglang(eng, rid, prompt, n=8, extra_key=None):
    outs = [1986, 374, 264, 72349, 9851, 1, 2, 3]
    seq = SglangSeq(rid, prompt, extra_key=extra_key)
    cached = eng.try_prefill(seq, n)
    assert cached is not None
    for k in range(n):
        eng.append_token(seq, outs[k % len(outs)], compute=k < n - 1)
    eng.finish(seq)
    return cached


def test_sglang_replays_real_0_5_23_capture_byte_for_byte():
    lines = [ln for ln in load_capture("sglang-0.5.23_replay.jsonl") if ln["decoded"] is not None]
    text = stored_tokens(lines[1]) + stored_tokens(lines[2])[:12]
    img1 = stored_tokens(lines[3]) + stored_tokens(lines[4])[:11]
    img2 = stored_tokens(lines[3])[:32] + stored_tokens(lines[5]) + stored_tokens(lines[6])[:11]
    img3 = stored_tokens(lines[3])[:32] + stored_tokens(lines[7]) + stored_tokens(lines[8])[:11]
    # the image spans really are the wide pad values of the mm_hashes sent
    assert img1[46:94] == fill_span(pad_values(0xDEADBEEFCAFE1234, "0.5.23"), 48)
    assert img2[46:94] == fill_span(pad_values(0x0123456789ABCDEF, "0.5.23"), 48)
    batches: list = []
    eng = SglangEngine(16, 16, emit=batches.append)
    cached = [_run_sglang(eng, r, p) for r, p in [("a", text), ("b", text), ("c", img1), ("d", img1), ("e", img2), ("f", img3)]]
    assert cached == [0, 32, 0, 96, 32, 32]
    assert eng.flush_cache()
    enc = WireEncoder("sglang-map")
    assert len(batches) == len(lines)  # includes the start-up AllBlocksCleared (seq 0)
    for records, line in zip(batches, lines):
        assert enc.encode(line["decoded"][0], records).hex() == line["frames_hex"][-1], line["note"]


def test_sglang_replays_real_0_5_22_capture_byte_for_byte():
    lines = [ln for ln in load_capture("sglang-0.5.22_replay.jsonl") if ln["decoded"] is not None]
    img1 = stored_tokens(lines[1]) + stored_tokens(lines[2])[:11]
    img2 = stored_tokens(lines[1])[:32] + stored_tokens(lines[3]) + stored_tokens(lines[4])[:11]
    assert set(img1[46:94]) == {185422964} and set(img2[46:94]) == {163254319}
    batches: list = []
    eng = SglangEngine(16, 16, emit=batches.append)
    assert [_run_sglang(eng, "a", img1), _run_sglang(eng, "b", img2)] == [0, 32]
    enc = WireEncoder("sglang-map")
    for records, line in zip(batches, lines):
        assert enc.encode(line["decoded"][0], records).hex() == line["frames_hex"][-1]


def test_sglang_cached_tokens_cap_and_namespaces():
    for L in (16, 17, 32, 33):
        batches: list = []
        eng = SglangEngine(64, 16, emit=batches.append)
        prompt = list(range(2000, 2000 + L))
        assert _run_sglang(eng, "a", prompt, n=2) == 0
        assert _run_sglang(eng, "b", prompt, n=2) == (L - 1) // 16 * 16
    batches = []
    eng = SglangEngine(64, 16, emit=batches.append)
    _run_sglang(eng, "a", list(range(40)), n=1)
    assert _run_sglang(eng, "b", list(range(40)), n=1, extra_key="salt") == 0  # separate namespace
    stores = [r for b in batches for r in b if isinstance(r, Stored)]
    # the namespace is not hashed: identical events for the salted request
    assert stores[0].block_hashes == stores[1].block_hashes


def test_sglang_eviction_is_lru_leaf_first_and_coalesced():
    batches: list = []
    eng = SglangEngine(6, 4, emit=batches.append)
    _run_sglang(eng, "a", list(range(9)), n=1)  # 2 pages cached (one node)
    _run_sglang(eng, "b", list(range(100, 109)), n=1)  # 2 more
    a_hashes, b_hashes = batches[1][0].block_hashes, batches[2][0].block_hashes
    # extend 9 + one page over-estimate = 13 tokens > 2 free pages: evict >= 13 tokens
    _run_sglang(eng, "c", list(range(200, 209)), n=1)
    last = batches[-1]
    assert [type(r) for r in last] == [Removed, Stored]
    assert last[0].block_hashes == a_hashes + b_hashes  # LRU first, page order, one event
    assert eng.num_cached_pages() == 2  # c's 2 pages; its unaligned tail page was freed at finish


def test_sglang_flush_refused_while_running():
    batches: list = []
    eng = SglangEngine(8, 4, emit=batches.append)
    assert batches == [[Cleared()]]  # start-up reset
    s = SglangSeq("a", list(range(9)))
    eng.try_prefill(s, 2)
    assert eng.flush_cache() is False
    eng.finish(s)
    assert eng.flush_cache() is True
    assert batches[-1] == [Cleared()]
    assert eng.free_pages == 8
