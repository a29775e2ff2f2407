"""kv.wire against the real captures in tests/fixtures/kv_events (see its README)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgpack
import pytest

from mmroute.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from mmroute.kv.wire import (
    END_SEQ,
    WireError,
    decode_message,
    decode_payload,
    decode_replay,
    replay_request,
)

FIXTURES = Path(__file__).parent / "fixtures" / "kv_events"
FILES = sorted(p.name for p in FIXTURES.glob("*.jsonl"))
ALL_LINES = [(name, i) for name in FILES for i in range(len((FIXTURES / name).read_text().splitlines()))]


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def frames_of(line: dict) -> list[bytes]:
    return [bytes.fromhex(h) for h in line["frames_hex"]]


def decode_line(name: str, line: dict):
    frames = frames_of(line)
    return decode_replay(frames) if name.endswith("_replay.jsonl") else decode_message(frames)


# ---- expected structs from the README's plain `decoded` JSON (bin shown as hex strings) --------

STORED_POS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
              "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
REMOVED_POS = ["type", "block_hashes", "medium", "group_idx"]


def _hash(h):
    return bytes.fromhex(h) if isinstance(h, str) else h


def expected_batch(decoded: list) -> EventBatch:
    events = []
    for e in decoded[1]:
        if isinstance(e, list):
            names = STORED_POS if e[0] == "BlockStored" else REMOVED_POS
            e = dict(zip(names, e))
        tag = e["type"]
        if tag == "BlockStored":
            events.append(BlockStored(
                block_hashes=[_hash(h) for h in e["block_hashes"]],
                parent_block_hash=None if e["parent_block_hash"] is None else _hash(e["parent_block_hash"]),
                token_ids=e["token_ids"], block_size=e["block_size"], lora_name=e.get("lora_name"),
                medium=e.get("medium"), extra_keys=e.get("extra_keys"), group_idx=e.get("group_idx"),
                kv_cache_spec_kind=e.get("kv_cache_spec_kind"),
            ))
        elif tag == "BlockRemoved":
            events.append(BlockRemoved(block_hashes=[_hash(h) for h in e["block_hashes"]],
                                       medium=e.get("medium"), group_idx=e.get("group_idx")))
        else:
            assert tag == "AllBlocksCleared"
            events.append(AllBlocksCleared())
    return EventBatch(ts=decoded[0], events=events, dp_rank=decoded[2], skipped=0)


@pytest.mark.parametrize("name,i", ALL_LINES)
def test_every_capture_line_decodes_to_its_plain_decode(name, i):
    line = load(name)[i]
    msg = decode_line(name, line)
    frames = frames_of(line)
    if line["decoded"] is None:
        assert msg is None, "end marker"
        assert frames[-2] == END_SEQ and frames[-1] == b""
        return
    assert msg is not None
    assert msg.seq == int.from_bytes(frames[-2], "big")
    assert msg.batch == expected_batch(line["decoded"])
    assert msg.batch.skipped == 0
    assert msg.batch.dp_rank == 0


# name -> (messages incl. end marker, seqs, {type: count}); README table.
TABLE = {
    "vllm-0.33.0_events.jsonl": (10, range(0, 10), {"BlockStored": 9, "BlockRemoved": 24, "AllBlocksCleared": 1}),
    "vllm-0.33.0_replay.jsonl": (11, range(0, 10), {"BlockStored": 9, "BlockRemoved": 24, "AllBlocksCleared": 1}),
    "vllm-0.33.0_bytes-hashes_events.jsonl": (5, range(0, 5), {"BlockStored": 4, "AllBlocksCleared": 1}),
    "vllm-0.33.0_bytes-hashes_replay.jsonl": (6, range(0, 5), {"BlockStored": 4, "AllBlocksCleared": 1}),
    "vllm-0.23.0_events.jsonl": (4, range(0, 4), {"BlockStored": 3, "BlockRemoved": 3, "AllBlocksCleared": 1}),
    "vllm-0.23.0_replay.jsonl": (5, range(0, 4), {"BlockStored": 3, "BlockRemoved": 3, "AllBlocksCleared": 1}),
    "sglang-0.5.23_events.jsonl": (9, range(1, 10), {"BlockStored": 8, "BlockRemoved": 1, "AllBlocksCleared": 1}),
    "sglang-0.5.23_replay.jsonl": (11, range(0, 10), {"BlockStored": 8, "BlockRemoved": 1, "AllBlocksCleared": 2}),
    "sglang-0.5.22_events.jsonl": (4, range(1, 5), {"BlockStored": 4}),
    "sglang-0.5.22_replay.jsonl": (6, range(0, 5), {"BlockStored": 4, "AllBlocksCleared": 1}),
}


def decoded_file(name: str):
    return [decode_line(name, line) for line in load(name)]


@pytest.mark.parametrize("name", sorted(TABLE))
def test_file_counts_match_readme(name):
    n, seqs, by_type = TABLE[name]
    msgs = decoded_file(name)
    assert len(msgs) == n
    if name.endswith("_replay.jsonl"):
        assert msgs[-1] is None and all(m is not None for m in msgs[:-1])
        msgs = msgs[:-1]
    assert [m.seq for m in msgs] == list(seqs)
    assert Counter(type(e).__name__ for m in msgs for e in m.batch.events) == by_type


def test_fixture_set_is_complete():
    assert set(FILES) == set(TABLE)


def _all_events(name):
    return [(m.seq, e) for m in decoded_file(name) if m is not None for e in m.batch.events]


def test_vllm033_unsigned_hashes_above_2_63_preserved():
    hashes = []
    for _, e in _all_events("vllm-0.33.0_events.jsonl"):
        if isinstance(e, BlockStored):
            hashes += e.block_hashes
            if e.parent_block_hash is not None:
                hashes.append(e.parent_block_hash)
        elif isinstance(e, BlockRemoved):
            hashes += e.block_hashes
    assert len(hashes) == 114
    assert all(type(h) is int and 0 <= h < 2**64 for h in hashes)
    assert sum(h >= 2**63 for h in hashes) == 58


def test_vllm033_extra_keys_duplicates_and_decode_blocks():
    ev = _all_events("vllm-0.33.0_events.jsonl")
    stored = {seq: e for seq, e in ev if isinstance(e, BlockStored)}
    # decode-time blocks: one hash each, parent set
    for seq in (1, 2):
        assert len(stored[seq].block_hashes) == 1 and stored[seq].parent_block_hash is not None
    # duplicate store of one hash at seq 3 and 4 -> two removals at seq 8, before the store
    dup = 17354731589568048877
    assert stored[3].block_hashes == [dup] and stored[4].block_hashes == [dup]
    seq8 = [e for seq, e in ev if seq == 8]
    removed = [e for e in seq8 if isinstance(e, BlockRemoved)]
    assert len(removed) == 24 and all(len(e.block_hashes) == 1 for e in removed)
    assert sum(e.block_hashes == [dup] for e in removed) == 2
    assert isinstance(seq8[-1], BlockStored) and all(isinstance(e, BlockRemoved) for e in seq8[:-1])
    # MM extra keys: [identifier, offset] per block, offset negative after the start block
    img_a = stored[5].extra_keys
    assert len(img_a) == len(stored[5].block_hashes) == 26
    assert img_a[0] == [["img-A", 15]] and img_a[1] == [["img-A", -1]] and img_a[2] == [["img-A", -17]]
    assert img_a[25] == [["img-A", -385]]
    assert stored[6].extra_keys == [["tenant-42"], None]
    blake = stored[8].extra_keys[0][0][0]
    assert isinstance(blake, str) and len(blake) == 64 and int(blake, 16) >= 0
    assert stored[0].kv_cache_spec_kind == "full_attention" and stored[0].group_idx == 0
    assert stored[0].medium == "GPU" and stored[0].lora_name is None
    assert len(stored[5].token_ids) == 26 * 16


def test_vllm033_bytes_hashes_are_32_byte_bin():
    ev = _all_events("vllm-0.33.0_bytes-hashes_events.jsonl")
    seen = 0
    for _, e in ev:
        if isinstance(e, BlockStored):
            for h in e.block_hashes + ([e.parent_block_hash] if e.parent_block_hash is not None else []):
                assert type(h) is bytes and len(h) == 32
                seen += 1
    assert seen > 4
    # same prompt, same shape as the int-hash run: only the hash representation differs
    first_bytes = ev[0][1]
    first_int = _all_events("vllm-0.33.0_events.jsonl")[0][1]
    assert first_bytes.token_ids == first_int.token_ids
    # int form = low 64 bits of the digest (ENGINES.md §1.5)
    assert [int.from_bytes(h, "big") & (2**64 - 1) for h in first_bytes.block_hashes] == first_int.block_hashes


def test_vllm023_positional_arrays():
    ev = _all_events("vllm-0.23.0_events.jsonl")
    stored = [e for _, e in ev if isinstance(e, BlockStored)]
    lora = stored[0]
    assert lora.lora_name == "sql-adapter" and lora.medium == "GPU"
    assert lora.extra_keys[0] == ["sql-adapter", ["img-A", 15]]
    assert lora.extra_keys[2] == ["sql-adapter", ["img-A", -17]]
    assert lora.kv_cache_spec_kind == "full_attention" and lora.group_idx == 0
    assert len(lora.token_ids) == 64 and len(lora.block_hashes) == 4
    assert stored[1].extra_keys == [["tenant-42"], None] and stored[1].lora_name is None
    hashes = [h for e in stored for h in e.block_hashes]
    hashes += [h for _, e in ev if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(hashes) == 12 and sum(h >= 2**63 for h in hashes) == 4
    assert isinstance(ev[-1][1], AllBlocksCleared)


def test_sglang_0523_signed_hashes_pads_and_coalescing():
    ev = _all_events("sglang-0.5.23_events.jsonl")
    stored = [e for _, e in ev if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert any(h < 0 for h in hashes) and any(h > 0 for h in hashes)
    assert all(-(2**63) <= h < 2**63 for h in hashes)
    for e in stored:
        assert len(e.token_ids) == 16 * len(e.block_hashes)
        assert e.extra_keys is None and e.lora_name is None and e.medium == "GPU"
    assert max(len(e.block_hashes) for e in stored) == 6  # coalesced multi-page store
    pads = {1992249758279980980, 773853780254441655, 2744024205482971523, 2413635698734676528}
    image = [e for e in stored if pads & set(e.token_ids)]
    assert image and pads <= set(image[0].token_ids)
    assert max(max(e.token_ids) for e in stored) > 2**32
    removed = [e for _, e in ev if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 8
    assert removed[0].block_hashes[1] == 7923801449930728686
    assert removed[0].block_hashes[0] == -4097153416989982084


def test_sglang_0522_legacy_pad_values():
    stored = [e for _, e in _all_events("sglang-0.5.22_events.jsonl") if isinstance(e, BlockStored)]
    toks = [t for e in stored for t in e.token_ids]
    assert toks.count(185422964) > 16 and toks.count(163254319) > 16
    assert max(toks) < 2**32
    assert any(h < 0 for e in stored for h in e.block_hashes)


@pytest.mark.parametrize("engine", ["vllm-0.33.0", "vllm-0.33.0_bytes-hashes", "vllm-0.23.0", "sglang-0.5.23", "sglang-0.5.22"])
def test_replay_layouts_match_live(engine):
    live = {m.seq: m for m in decoded_file(f"{engine}_events.jsonl")}
    replay_lines = load(f"{engine}_replay.jsonl")
    n_frames = {len(line["frames_hex"]) for line in replay_lines}
    assert n_frames == ({3} if engine == "vllm-0.23.0" else {4})
    replay = [decode_line(f"{engine}_replay.jsonl", line) for line in replay_lines]
    assert replay[-1] is None
    for m in replay[:-1]:
        expected_topic = b"kv-events" if engine.startswith("vllm-0.33") else b""
        assert m.topic == expected_topic
        if m.seq in live:
            assert m.batch == live[m.seq].batch
        else:  # SGLang's startup clear at seq 0 only shows up in the replay
            assert m.seq == 0 and m.batch.events == [AllBlocksCleared()]


def test_engines_1_8_message_2_exact_vector():
    payload = bytes.fromhex(
        "93cb41d954fc404000009283a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf2e94"
        "951059393917a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400"
    )
    assert len(payload) == 88
    msg = decode_message([b"kv-events", (1).to_bytes(8, "big"), payload])
    assert msg.topic == b"kv-events" and msg.seq == 1
    assert msg.batch == EventBatch(
        ts=1700000001.0,
        events=[BlockRemoved(block_hashes=[3356471519746799895], medium="GPU"), AllBlocksCleared()],
        dp_rank=0,
    )


# ---- tolerance and errors --------------------------------------------------------------------

SEQ0 = (0).to_bytes(8, "big")
STORED_MAP = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
              "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU"}


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("frames,what", [
    ([b"t", SEQ0], "3 frames"),
    ([b"t", SEQ0, pack([1.0, []]), b"x"], "3 frames"),
    ([], "3 frames"),
    ([b"t", b"\x00" * 7, pack([1.0, []])], "8 bytes"),
    ([b"t", SEQ0, b"\xc1"], "not valid msgpack"),
    ([b"t", SEQ0, b"\x93\xcb\x41"], "not valid msgpack"),
    ([b"t", SEQ0, b""], "not valid msgpack"),
    ([b"t", SEQ0, pack({"ts": 1.0, "evts": []})], "must be an array"),
    ([b"t", SEQ0, pack(7)], "must be an array"),
    ([b"t", SEQ0, pack([1.0])], "must be an array"),
    ([b"t", SEQ0, pack(["now", []])], "ts must be a number"),
    ([b"t", SEQ0, pack([1.0, {"a": 1}])], "events must be an array"),
])
def test_malformed_messages_raise_wire_error(frames, what):
    with pytest.raises(WireError, match=what):
        decode_message(frames)
    assert issubclass(WireError, ValueError)


def test_bad_events_are_skipped_not_fatal():
    nested = dict(STORED_MAP, token_ids=[[10, 20], [20, 30]])  # SGLang EAGLE bigram mode
    events = [
        STORED_MAP,
        {"type": "BlockTouched", "block_hashes": [1]},  # unknown tag
        ["SomethingNew", 1, 2],
        {"type": "BlockStored", "parent_block_hash": None, "token_ids": [1] * 16, "block_size": 16},  # no hashes
        {"type": "BlockRemoved"},  # missing hashes
        nested,
        dict(STORED_MAP, block_size="16"),
        dict(STORED_MAP, block_size=0),
        dict(STORED_MAP, block_hashes=["ab"]),  # str is not a hash
        dict(STORED_MAP, token_ids=[1, -2]),
        dict(STORED_MAP, token_ids=[1.5]),
        dict(STORED_MAP, medium=3),
        ["BlockStored", [1]],  # positional, required fields missing
        [],
        42,
        None,
        {"type": "AllBlocksCleared"},
    ]
    batch = decode_payload(pack([2.5, events, 3]))
    assert batch.skipped == 15
    assert batch.dp_rank == 3 and batch.ts == 2.5
    assert batch.events == [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)), block_size=16, medium="GPU"),
        AllBlocksCleared(),
    ]


def test_tolerated_variants():
    # trailing batch elements (vLLM main: publisher_id), unknown map keys, extra positional
    # fields (0.26+ locality, ownership, ...), short positional (SGLang <= 0.5.19, vLLM 0.11).
    big = 2**63  # token ids are 64-bit
    events = [
        dict(STORED_MAP, locality="local", session_id="s", token_ids=[big] * 16, block_hashes=[b"\x01" * 32]),
        ["BlockStored", [-5], 7, list(range(16)), 16, None, "GPU", None, [None], 0, "full_attention", None,
         "local", "own", "sess", [1, 2]],
        ["BlockStored", [-5, 6], None, list(range(32)), 16, None, "CPU_PINNED"],
        ["BlockStored", [9], None, list(range(16)), 16],  # pre-medium SGLang
        ["BlockRemoved", [-5], "GPU", 0, "local", "own"],
        ["BlockRemoved", [b"\x02" * 32]],
        ["AllBlocksCleared", "extra"],
    ]
    batch = decode_payload(pack([1.0, events, 0, b"publisher-id", "more"]))
    assert batch.skipped == 0 and batch.dp_rank == 0
    e = batch.events
    assert e[0].token_ids == [big] * 16 and e[0].block_hashes == [b"\x01" * 32]
    assert e[1] == BlockStored(block_hashes=[-5], parent_block_hash=7, token_ids=list(range(16)), block_size=16,
                               medium="GPU", lora_name=None, extra_keys=[None], group_idx=0,
                               kv_cache_spec_kind="full_attention")
    assert e[2].medium == "CPU_PINNED" and e[2].extra_keys is None and e[2].group_idx is None
    assert e[3].medium is None
    assert e[4] == BlockRemoved(block_hashes=[-5], medium="GPU", group_idx=0)
    assert e[5] == BlockRemoved(block_hashes=[b"\x02" * 32])
    assert e[6] == AllBlocksCleared()
    # no dp_rank (SGLang before attn_dp_rank), or nil
    assert decode_payload(pack([1, []])).dp_rank is None
    assert decode_payload(pack([1.0, [], None])).dp_rank is None


def test_replay_request_and_replay_errors():
    assert replay_request(0) == [b"", b"\x00" * 8]
    assert replay_request(258) == [b"", b"\x00" * 6 + b"\x01\x02"]
    with pytest.raises(ValueError):
        replay_request(-1)
    payload = pack([1.0, [], 0])
    assert decode_replay([b"", SEQ0, payload]).topic == b""
    assert decode_replay([b"", b"kv", SEQ0, payload]).topic == b"kv"
    assert decode_replay([b"", END_SEQ, b""]) is None
    assert decode_replay([b"", b"", END_SEQ, b""]) is None
    with pytest.raises(WireError, match="3 or 4 frames"):
        decode_replay([b"", SEQ0])
    with pytest.raises(WireError, match="3 or 4 frames"):
        decode_replay([b"", b"a", b"b", SEQ0, payload])
    with pytest.raises(WireError, match="delimiter"):
        decode_replay([b"x", SEQ0, payload])
    with pytest.raises(WireError, match="8 bytes"):
        decode_replay([b"", b"kv", b"\x00", payload])
    with pytest.raises(WireError, match="msgpack"):
        decode_replay([b"", SEQ0, b"\xc1"])


def test_map_encoded_batch_is_read_by_field_name():
    """A build that declared EventBatch without array_like sends a map (vLLM commit
    0181ea31 era): read it by name rather than dropping every message."""
    payload = pack({"ts": 5.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 3})
    msg = decode_message([b"t", SEQ0, payload])
    assert msg.batch.ts == 5.0 and msg.batch.dp_rank == 3
    assert [type(e).__name__ for e in msg.batch.events] == ["AllBlocksCleared"]
