"""Shared helpers for the routing tests: real KV-event captures and a manual clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from mmroute.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

CAPTURES = Path(__file__).parent / "fixtures" / "kv_events"

# Qwen2.5-VL ids used by the captures.
QWEN_IMAGE_TOKEN = 151655
QWEN_VISION_START = 151652
QWEN_VISION_END = 151653

try:  # the kv package's decoder, when present
    from mmroute.kv.wire import decode_message as _wire_decode
except ImportError:  # pragma: no cover - only while kv/wire.py does not exist
    _wire_decode = None


def _local_event(raw: Any):
    # Minimal stand-in for kv.wire: map or positional event -> struct.
    if isinstance(raw, dict):
        g = raw.get
        tag = g("type")
        if tag == "BlockStored":
            return BlockStored(g("block_hashes"), g("parent_block_hash"), g("token_ids"), g("block_size"),
                               g("lora_name"), g("medium"), g("extra_keys"), g("group_idx"), g("kv_cache_spec_kind"))
        if tag == "BlockRemoved":
            return BlockRemoved(g("block_hashes"), g("medium"), g("group_idx"))
        return AllBlocksCleared()
    at = lambda i: raw[i] if i < len(raw) else None  # noqa: E731
    if raw[0] == "BlockStored":
        return BlockStored(raw[1], raw[2], raw[3], raw[4], at(7), at(6), at(8), at(9), at(10))
    if raw[0] == "BlockRemoved":
        return BlockRemoved(raw[1], at(2), at(3))
    return AllBlocksCleared()


def _decode(frames: list[bytes]) -> tuple[int, EventBatch]:
    if _wire_decode is not None:
        msg = _wire_decode(frames)
        assert msg.batch.skipped == 0
        return msg.seq, msg.batch
    obj = msgspec.msgpack.decode(frames[2])
    return int.from_bytes(frames[1], "big"), EventBatch(obj[0], [_local_event(e) for e in obj[1]], obj[2])


def load_capture(name: str) -> list[tuple[int, EventBatch]]:
    """``(seq, batch)`` of every live message in ``tests/fixtures/kv_events/<name>``."""
    out = []
    with open(CAPTURES / name) as fh:
        for line in fh:
            rec = json.loads(line)
            frames = [bytes.fromhex(f) for f in rec["frames_hex"]]
            out.append(_decode(frames))
    return out


def stores(batch: EventBatch) -> list[BlockStored]:
    return [e for e in batch.events if isinstance(e, BlockStored)]


class ManualClock:
    """Injected time: tests move it explicitly, never sleep."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
