"""Token views: request-side keys equal the keys the index derives from real engine events."""

from __future__ import annotations

import pytest
import xxhash
from routing_helpers import QWEN_IMAGE_TOKEN, QWEN_VISION_END, QWEN_VISION_START, load_capture, stores

from mmroute.models.base import MMItem
from mmroute.routing.index import PrefixIndex
from mmroute.routing.keys import chain_keys
from mmroute.routing.views import (
    mm_hash_hex16,
    mm_hash_u64,
    sglang_pad_values,
    sglang_scheme_for_version,
    sglang_view,
    sglang_view_keys,
    vllm_view_keys,
)

H = 0xDEADBEEFCAFE1234
WIDE_H = [1992249758279980980, 773853780254441655, 2744024205482971523, 2413635698734676528]


# ---------------------------------------------------------------- pad values and hashes
def test_pad_values_engines_table():
    assert sglang_pad_values(H, "wide") == WIDE_H
    assert sglang_pad_values(H, "legacy") == [185422964]
    assert sglang_pad_values(0x0123456789ABCDEF, "legacy") == [163254319]
    assert sglang_pad_values(0x0123456789ABCDEF, "wide") == [
        23533869762612420, 1115227388442326932, 406705440234023321, 2100304651902599146,
    ]
    assert sglang_pad_values(0xFF, "wide") == [
        3506592709626997851, 1848558698201215555, 409263026673638374, 483950647774003467,
    ]
    with pytest.raises(ValueError):
        sglang_pad_values(H, "bogus")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "version,scheme",
    [
        ("0.5.23", "wide"), ("0.5.23.post1", "wide"), ("0.5.24rc0", "wide"), ("0.6.0", "wide"), ("v0.5.30", "wide"),
        ("0.5.22", "legacy"), ("0.5.18", "legacy"), ("0.5.20.post2", "legacy"),
        ("0.5.17", None), ("0.4.10", None), ("", None), ("main", None),
    ],
)
def test_scheme_for_version(version, scheme):
    assert sglang_scheme_for_version(version) == scheme


def test_mm_hash_from_identifier():
    blake = "80e27f48ed47d57aaa7ebece92b8809cce9f23b1bbbea0064aaa63cd2a524396"
    assert mm_hash_u64(blake) == 0x80E27F48ED47D57A
    assert mm_hash_hex16(blake) == "80e27f48ed47d57a"
    assert mm_hash_u64("deadbeefcafe1234" + "0" * 48) == H
    assert mm_hash_u64("img-A") == xxhash.xxh3_64_intdigest(b"img-A")
    assert mm_hash_u64("abc") == xxhash.xxh3_64_intdigest(b"abc")  # too short to be a content hash
    for ident in (blake, "img-A", "x" * 100):
        s = mm_hash_hex16(ident)
        # SGLang parses the full string with int(s, 16): 16 hex digits, same u64.
        assert len(s) == 16 and int(s, 16) == mm_hash_u64(ident)


def test_sglang_view_fills_span_cyclically_keeps_delimiters():
    ids = [1, QWEN_VISION_START] + [QWEN_IMAGE_TOKEN] * 6 + [QWEN_VISION_END, 2]
    ident = "deadbeefcafe1234" + "0" * 48
    v = sglang_view(ids, [MMItem(ident, 2, 6)], "wide")
    assert v == [1, QWEN_VISION_START] + WIDE_H + WIDE_H[:2] + [QWEN_VISION_END, 2]
    assert sglang_view(ids, [MMItem(ident, 2, 6)], "legacy")[2:8] == [185422964] * 6
    assert ids[2] == QWEN_IMAGE_TOKEN  # input not mutated
    assert sglang_view(ids, [], None) == ids
    with pytest.raises(ValueError):
        sglang_view(ids, [MMItem(ident, 2, 6)], None)
    with pytest.raises(ValueError):
        sglang_view(ids, [MMItem(ident, 8, 6)], "wide")


# ---------------------------------------------------------------- SGLang captures
SGL_SPAN = (46, 48)  # image span in every captured SGLang image request (offset, length)


def _vllm_ids_from_sglang(tokens: list[int]) -> list[int]:
    # The renderer's view: image span filled with the image token; text ids are the capture's.
    off, n = SGL_SPAN
    ids = list(tokens)
    ids[off : off + n] = [QWEN_IMAGE_TOKEN] * n
    return ids


@pytest.mark.parametrize(
    "name,scheme,hashes",
    [
        ("sglang-0.5.23_events.jsonl", "wide", ["deadbeefcafe1234", "0123456789abcdef", "00000000000000ff"]),
        ("sglang-0.5.22_events.jsonl", "legacy", ["deadbeefcafe1234", "0123456789abcdef"]),
    ],
)
def test_sglang_capture_views_and_overlap(name, scheme, hashes):
    cap = load_capture(name)
    # The prefill store of each image request holds the vision_start token.
    image_stores = [(i, s) for i, (_, b) in enumerate(cap) for s in stores(b) if QWEN_VISION_START in s.token_ids]
    assert len(image_stores) == len(hashes)
    full = None  # the 96 prompt ids of the first image request (tokens 0..95)
    idx = PrefixIndex()
    applied = 0
    for (i, st), hx in zip(image_stores, hashes):
        ident = hx + "0" * 48  # a content id whose first 16 hex digits are the forwarded hash
        assert mm_hash_hex16(ident) == hx
        if st.parent_block_hash is None:
            full = list(st.token_ids)
        assert full is not None and len(full) == 96
        start = 96 - len(st.token_ids)  # later requests share the first text pages
        assert full[SGL_SPAN[0] - 1] == QWEN_VISION_START and full[sum(SGL_SPAN)] == QWEN_VISION_END
        ids = _vllm_ids_from_sglang(full)
        view = sglang_view(ids, [MMItem(ident, *SGL_SPAN)], scheme)
        assert view[start:] == st.token_ids  # byte-exact with what the engine cached
        # Apply the capture up to and including this request's prefill batch.
        while applied <= i:
            idx.apply("s", 0, cap[applied][1])
            applied += 1
        keys = sglang_view_keys(ids, [MMItem(ident, *SGL_SPAN)], 16, scheme)
        assert len(keys) == 6
        assert idx.overlaps(keys, ["s"]) == {"s": 6}
        # The wrong scheme or another image only shares the two text pages before the image.
        other = "wide" if scheme == "legacy" else "legacy"
        assert idx.overlaps(sglang_view_keys(ids, [MMItem(ident, *SGL_SPAN)], 16, other), ["s"]) == {"s": 2}
        assert idx.overlaps(sglang_view_keys(ids, [MMItem("img-Z", *SGL_SPAN)], 16, scheme), ["s"]) == {"s": 2}
    assert idx.unknown_parent("s") == 0


# ---------------------------------------------------------------- vLLM captures (dual keys)
def _span_from_extra(st) -> tuple[str, int, int]:
    ident, off = st.extra_keys[0][-1]
    n = sum(1 for t in st.token_ids if t == QWEN_IMAGE_TOKEN)
    return ident, off, n


def test_vllm_033_request_keys_equal_event_keys():
    cap = load_capture("vllm-0.33.0_events.jsonl")
    idx = PrefixIndex()
    for _, b in cap[:9]:
        idx.apply("w", 0, b)
    s0, s5, s6, s7 = (stores(cap[i][1])[-1] for i in (0, 5, 6, 7))
    s8 = stores(cap[8][1])[-1]

    # Text chat (2 blocks) was evicted at seq 8; check it on a fresh index below.
    for st in (s7, s8):
        ident, off, n = _span_from_extra(st)
        assert off == 15 and n == 391
        keys = vllm_view_keys(st.token_ids, [MMItem(ident, off, n)], 16)
        assert len(keys) == len(st.block_hashes) == 26
        assert idx.overlaps(keys, ["w"]) == {"w": 26}
    # seq 8 evicted img-A's blocks 25 down to 8 (leaf end first): the leading 8 remain.
    ident, off, n = _span_from_extra(s5)
    assert ident == "img-A"
    keys_a = vllm_view_keys(s5.token_ids, [MMItem(ident, off, n)], 16)
    assert idx.overlaps(keys_a, ["w"]) == {"w": 8}
    # Salted text chat.
    keys_salt = vllm_view_keys(s6.token_ids, [], 16, cache_salt="tenant-42")
    assert idx.overlaps(keys_salt, ["w"]) == {"w": 2}
    assert idx.overlaps(vllm_view_keys(s6.token_ids, [], 16), ["w"]) == {"w": 0}

    fresh = PrefixIndex()
    for _, b in cap[:6]:
        fresh.apply("w", 0, b)
    assert fresh.overlaps(keys_a, ["w"]) == {"w": 26}
    assert fresh.overlaps(vllm_view_keys(s0.token_ids, [], 16), ["w"]) == {"w": 2}
    # Same pixels, another identifier: block 0 already differs.
    assert fresh.overlaps(vllm_view_keys(s5.token_ids, [MMItem("img-B", off, n)], 16), ["w"]) == {"w": 0}


def test_vllm_033_bytes_hashes_give_the_same_router_keys():
    ints = load_capture("vllm-0.33.0_events.jsonl")
    raw = load_capture("vllm-0.33.0_bytes-hashes_events.jsonl")
    st = stores(raw[3][1])[0]
    assert isinstance(st.block_hashes[0], bytes) and len(st.block_hashes[0]) == 32
    idx = PrefixIndex()
    for _, b in ints[:6]:
        idx.apply("int", 0, b)
    for _, b in raw[:4]:
        idx.apply("bytes", 0, b)
    ident, off, n = _span_from_extra(st)
    keys = vllm_view_keys(st.token_ids, [MMItem(ident, off, n)], 16)
    assert idx.overlaps(keys, ["int", "bytes"]) == {"int": 26, "bytes": 26}
    s0, s1, s2 = (stores(raw[i][1])[0] for i in range(3))
    text = chain_keys(s0.token_ids + s1.token_ids + s2.token_ids, 16)
    assert idx.overlaps(text, ["int", "bytes"]) == {"int": 4, "bytes": 4}


def test_vllm_023_lora_and_image_and_salt():
    cap = load_capture("vllm-0.23.0_events.jsonl")
    idx = PrefixIndex()
    idx.apply("w", 0, cap[0][1])
    idx.apply("w", 0, cap[1][1])
    s0, s1 = stores(cap[0][1])[0], stores(cap[1][1])[0]
    ident, off, n = _span_from_extra(s0)
    assert (ident, off, n) == ("img-A", 15, 40)
    items = [MMItem(ident, off, n)]
    keys = vllm_view_keys(s0.token_ids, items, 16, lora_name="sql-adapter")
    assert idx.overlaps(keys, ["w"]) == {"w": 4}
    assert idx.overlaps(vllm_view_keys(s0.token_ids, items, 16), ["w"]) == {"w": 0}
    salt = vllm_view_keys(s1.token_ids, [], 16, cache_salt="tenant-42")
    assert idx.overlaps(salt, ["w"]) == {"w": 2}
    idx.apply("w", 0, cap[2][1])  # evicts blocks 3, 2, 1 of the image request
    assert idx.overlaps(keys, ["w"]) == {"w": 1}
    idx.apply("w", 0, cap[3][1])
    assert idx.overlaps(salt, ["w"]) == {"w": 0}


def test_vllm_view_keys_plain_and_bad_span():
    ids = list(range(40))
    assert vllm_view_keys(ids, [], 16) == chain_keys(ids, 16)
    with pytest.raises(ValueError):
        vllm_view_keys(ids, [MMItem("x", 30, 20)], 16)
