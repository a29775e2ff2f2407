"""The simulator's own event Structs encode byte-for-byte like the engines (real captures)."""

from __future__ import annotations

import msgspec
import pytest

from mmroute.sim.wire import Cleared, Removed, Stored, WireEncoder
from sim_helpers import load_capture, records_of

CASES = [
    ("vllm-0.33.0_events.jsonl", "vllm-map", False),
    ("vllm-0.33.0_bytes-hashes_events.jsonl", "vllm-map", True),
    ("vllm-0.23.0_events.jsonl", "vllm-array", False),
    ("sglang-0.5.23_events.jsonl", "sglang-map", False),
    ("sglang-0.5.22_events.jsonl", "sglang-map", False),
]


@pytest.mark.parametrize("name,flavor,bytes_hashes", CASES)
def test_encoding_is_byte_identical_to_capture(name, flavor, bytes_hashes):
    enc = WireEncoder(flavor)
    lines = load_capture(name)
    assert lines
    for line in lines:
        ts, events, rank = line["decoded"]
        payload = enc.encode(ts, records_of(events, bytes_hashes=bytes_hashes), rank)
        assert payload.hex() == line["frames_hex"][-1], line["note"]


def _stored():
    return Stored(block_hashes=[(1 << 64) - 1, 5], parent_block_hash=None, token_ids=list(range(32)), block_size=16)


def test_vllm_map_structure_keys_in_order_and_uint64():
    raw = WireEncoder("vllm-map").encode(1.5, [Removed([(1 << 63) + 1]), _stored(), Cleared()])
    assert raw[:1] == b"\x93" and raw[1:2] == b"\xcb"  # [ts float64, events, rank]
    assert b"\xcf\x80\x00\x00\x00\x00\x00\x00\x01" in raw  # uint64 hash as msgpack cf
    ts, events, rank = msgspec.msgpack.decode(raw)
    assert (ts, rank) == (1.5, 0)
    assert list(events[0]) == ["type", "block_hashes", "medium", "group_idx"]
    assert list(events[1]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]
    assert events[1]["extra_keys"] == [None, None]
    assert events[1]["parent_block_hash"] is None and events[1]["lora_name"] is None
    assert events[2] == {"type": "AllBlocksCleared"}


def test_vllm_array_structure_has_12_positions():
    raw = WireEncoder("vllm-array").encode(1.0, [_stored(), Removed([3]), Cleared()])
    _, events, _ = msgspec.msgpack.decode(raw)
    assert events[0][0] == "BlockStored" and len(events[0]) == 12
    assert events[0][6] == "GPU" and events[0][10] == "full_attention" and events[0][11] is None
    assert events[1] == ["BlockRemoved", [3], "GPU", 0]
    assert events[2] == ["AllBlocksCleared"]


def test_sglang_map_has_no_vllm_only_fields():
    raw = WireEncoder("sglang-map").encode(1.0, [Stored([-5], 7, list(range(16)), 16), Removed([-5, 9])])
    _, events, _ = msgspec.msgpack.decode(raw)
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
    assert events[0]["block_hashes"] == [-5]
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [-5, 9], "medium": "GPU"}
    raw = WireEncoder("sglang-array").encode(1.0, [Stored([-5], None, [1], 1)])
    assert msgspec.msgpack.decode(raw)[1][0] == ["BlockStored", [-5], None, [1], 1, None, "GPU"]


def test_unknown_flavor_is_rejected():
    with pytest.raises(ValueError):
        WireEncoder("vllm-protobuf")
