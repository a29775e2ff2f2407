"""Engine hash vectors: the simulator hashes blocks the engines' way (ENGINES.md §1.8 C, §3.2, §3.3)."""

from __future__ import annotations

from mmroute.sim import sglang_hash as sh
from mmroute.sim.vllm_hash import LoraRef, MMSpan, VllmBlockHasher, none_hash, wire_hash


def test_vllm_none_hash_vectors():
    assert none_hash("sha256_cbor").hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    assert none_hash("sha256").hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"


def test_vllm_sha256_block_vectors():
    h = VllmBlockHasher("sha256")
    b0 = h.block_hash(None, range(100, 116), None)
    b1 = h.block_hash(b0, range(116, 132), None)
    assert b0.hex() == "605fd9e311c0890137f4c7df65be59449fb378632eecf434d1ecdf87c874fd55"
    assert b1.hex() == "f1a08810157991d5280c49952540afc2feab260cd65a24bb2e94951059393917"
    assert wire_hash(b0, True) == 15126711022707342677
    assert wire_hash(b1, True) == 3356471519746799895
    assert wire_hash(b1, False) == b1
    mm = h.block_hash(None, range(100, 116), (("mm", "80e27f48ed47d57aaa7ebece92b8809cce9f23b1bbbea0064aaa63cd2a524396", 0),))
    assert mm.hex() == "4d5c968cc851fa1cfb193d0f64ab9bf00858eb76d1e5ee1be2794d88cfc744a4"


def test_vllm_sha256_cbor_chain_differs_from_pickle_and_is_deterministic():
    cbor = VllmBlockHasher("sha256_cbor")
    a = cbor.block_hash(None, range(16), None)
    assert a == VllmBlockHasher("sha256_cbor").block_hash(None, list(range(16)), None)
    assert a != VllmBlockHasher("sha256").block_hash(None, range(16), None)
    assert len(a) == 32


def test_vllm_extra_keys_tagged_and_plain_eras():
    mm = [MMSpan("img", 15, 391)]
    lora = LoraRef("sql", 1, "/adapters/sql")
    tagged = VllmBlockHasher("sha256", "tagged")
    hs, ev = tagged.extra_keys(0, 16, mm, lora, "salt")
    assert hs == (("lora", "sql", "/adapters/sql"), ("mm", "img", 15), ("cache_salt", "salt"))
    assert ev == ["sql", ["img", 15], "salt"]
    hs, ev = tagged.extra_keys(32, 48, mm, None, "salt")  # salt only on block 0
    assert hs == (("mm", "img", -17),) and ev == [["img", -17]]
    assert tagged.extra_keys(416, 432, mm, None, None) == (None, None)  # past the image
    plain = VllmBlockHasher("sha256", "plain")
    hs, ev = plain.extra_keys(16, 32, mm, lora, None)
    assert hs == ("sql", ("img", -1)) and ev == ["sql", ["img", -1]]


def test_vllm_extra_keys_several_items_in_one_block():
    h = VllmBlockHasher()
    mm = [MMSpan("a", 2, 4), MMSpan("b", 8, 20)]
    assert h.extra_keys(0, 16, mm, None, None)[1] == [["a", 2], ["b", 8]]
    assert h.extra_keys(16, 32, mm, None, None)[1] == [["b", -8]]


def test_sglang_golden_vectors():
    assert [sh.wire_int64(d) for d in sh.chain_pages([1, 2, 3, 4], 4)] == [-3488128144981237669]
    assert [sh.wire_int64(d) for d in sh.chain_pages([10, 20, 30, 40, 50, 60, 70, 80], 2)] == [
        978178666101069530,
        -895308556211281782,
        -8033692805846017938,
        835415944263129316,
    ]
    # Only full pages are hashed.
    assert len(sh.chain_pages(list(range(9)), 4)) == 2


def test_sglang_wide_page_hash_uses_u64_and_marker():
    import hashlib
    import struct

    wide = [1, 2, 1 << 40, 3]
    expect = hashlib.sha256(b"\xff" + struct.pack("<4Q", *wide)).digest()
    assert sh.page_digest(None, wide) == expect
    narrow = [1, 2, 3, 4]
    assert sh.page_digest(None, narrow) == hashlib.sha256(struct.pack("<4I", *narrow)).digest()


def test_sglang_pad_values_by_release():
    h = 0xDEADBEEFCAFE1234
    assert sh.pad_values(h, "0.5.23") == [1992249758279980980, 773853780254441655, 2744024205482971523, 2413635698734676528]
    assert sh.pad_values(h, "0.5.22") == [185422964]
    assert sh.pad_values(0x0123456789ABCDEF, "0.5.22") == [163254319]
    assert sh.fill_span([7, 8, 9], 5) == [7, 8, 9, 7, 8]
    assert sh.uses_wide_pads("0.5.24rc1") and not sh.uses_wide_pads("0.5.19")
    assert sh.parse_mm_hash("deadbeefcafe1234") == h
    assert sh.parse_mm_hash("zz") is None
