"""Tolerant decoder for the KV-event wire of every vLLM and SGLang era (ENGINES.md §1.7).

Live PUB message: ``[topic, seq u64be, msgpack([ts, events, dp_rank?, ...])]``.
Events are positional arrays (vLLM 0.11-0.23, SGLang <= 0.5.19: tag at index 0, fields
in declaration order, ENGINES.md §1.4) or tagged maps (vLLM >= 0.24, SGLang >= 0.5.20:
tag under ``"type"``). One generic msgpack decode, then per-event shape checks, so that
hashes may be uint64 (vLLM), negative int64 (SGLang) or ``bin`` (vLLM with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) and token ids may be 64-bit (SGLang pad values).

A malformed *message* raises ``WireError``; a malformed or unknown *event* is skipped and
counted in ``EventBatch.skipped`` -- one bad event never costs the rest of its batch.
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence

import msgspec

from mmroute.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch, KVMessage

__all__ = [
    "END_SEQ",
    "WireError",
    "decode_event",
    "decode_message",
    "decode_payload",
    "decode_replay",
    "decode_replay_frames",
    "replay_request",
    "u64be",
]

# Replay end marker: seq -1 as signed 8 bytes (vLLM ``zmq_publisher``; SGLang ``kv_events.py``).
END_SEQ = b"\xff" * 8

# Generic decoder: arrays -> list, maps -> dict, bin -> bytes, ints exact up to 2**64-1.
_decode = msgspec.msgpack.Decoder().decode


class WireError(ValueError):
    """A ZMQ message that is not a KV-event message (bad framing or payload)."""


def u64be(n: int) -> bytes:
    return n.to_bytes(8, "big")


def replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to a replay ROUTER: ``[b"", start_seq u64be]`` (ENGINES.md §1.6).

    The ROUTER ignores (no reply at all) any other shape, e.g. a REQ envelope.
    """
    if not 0 <= start_seq < 1 << 64:
        raise ValueError(f"replay start seq out of range: {start_seq}")
    return [b"", u64be(start_seq)]


def _seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"seq frame must be 8 bytes (u64 big-endian), got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_message(frames: Sequence[bytes]) -> KVMessage:
    """Decode one live PUB message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise WireError(f"KV-event message must have 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    return KVMessage(topic=bytes(topic), seq=_seq(seq), batch=decode_payload(payload))


def decode_replay(frames: Sequence[bytes]) -> KVMessage | None:
    """Decode one replay reply as a DEALER receives it; ``None`` is the end marker.

    Layouts (ENGINES.md §1.6, §3.1): ``[b"", seq, payload]`` (vLLM <= 0.25) and
    ``[b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang). The seq is always the
    8-byte frame just before the payload.
    """
    n = len(frames)
    if n not in (3, 4):
        raise WireError(f"replay reply must have 3 or 4 frames, got {n}")
    if len(frames[0]) != 0:
        raise WireError("replay reply must start with an empty delimiter frame")
    seq_frame = frames[-2]
    if len(seq_frame) == 8 and bytes(seq_frame) == END_SEQ:
        return None
    topic = bytes(frames[1]) if n == 4 else b""
    return KVMessage(topic=topic, seq=_seq(seq_frame), batch=decode_payload(frames[-1]))


# Name used in docs/architecture.md.
decode_replay_frames = decode_replay


def decode_payload(payload: bytes) -> EventBatch:
    """Decode the msgpack ``[ts, events, dp_rank?, ...ignored]`` batch."""
    try:
        obj = _decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError) as e:
        raise WireError(f"payload is not valid msgpack: {e}") from None
    if type(obj) is dict and "events" in obj:
        # Some vLLM builds declared EventBatch without array_like (a map on the wire):
        # read it by field name, in declaration order.
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank", obj.get("attn_dp_rank"))]
    if type(obj) is not list or len(obj) < 2:
        raise WireError(f"payload must be an array [ts, events, dp_rank?], got {type(obj).__name__}")
    ts, raw_events = obj[0], obj[1]
    if type(ts) not in (float, int):
        raise WireError(f"batch ts must be a number, got {type(ts).__name__}")
    if type(raw_events) is not list:
        raise WireError(f"batch events must be an array, got {type(raw_events).__name__}")
    dp_rank = obj[2] if len(obj) > 2 else None
    if type(dp_rank) is not int:  # absent (pre attn_dp_rank SGLang), nil, or nonsense
        dp_rank = None
    events: list[Event] = []
    skipped = 0
    for raw in raw_events:
        ev = decode_event(raw)
        if ev is None:
            skipped += 1
        else:
            events.append(ev)
    return EventBatch(ts=float(ts), events=events, dp_rank=dp_rank, skipped=skipped)


# ---- events ---------------------------------------------------------------------------------

# Positional indexes (ENGINES.md §1.4; declaration order of vLLM's msgspec structs, which
# SGLang's match for 0-6). Index 5 (lora_id) is deprecated and not kept.
_S_HASHES, _S_PARENT, _S_TOKENS, _S_BS, _S_MEDIUM, _S_LORA, _S_EXTRA, _S_GROUP, _S_KIND = 1, 2, 3, 4, 6, 7, 8, 9, 10
_R_HASHES, _R_MEDIUM, _R_GROUP = 1, 2, 3


def decode_event(raw: Any) -> Event | None:
    """One decoded msgpack event (list or map) -> event struct, or None (skip it)."""
    t = type(raw)
    if t is list:
        if not raw:
            return None
        tag = raw[0]
        n = len(raw)

        def at(i: int) -> Any:
            return raw[i] if i < n else None

        if tag == "BlockStored":
            if n <= _S_BS:  # the 4 required fields must be there
                return None
            return _stored(
                raw[_S_HASHES], raw[_S_PARENT], raw[_S_TOKENS], raw[_S_BS],
                at(_S_LORA), at(_S_MEDIUM), at(_S_EXTRA), at(_S_GROUP), at(_S_KIND),
            )
        if tag == "BlockRemoved":
            if n <= _R_HASHES:
                return None
            return _removed(raw[_R_HASHES], at(_R_MEDIUM), at(_R_GROUP))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if t is dict:
        tag = raw.get("type")
        g = raw.get
        if tag == "BlockStored":
            return _stored(
                g("block_hashes"), g("parent_block_hash"), g("token_ids"), g("block_size"),
                g("lora_name"), g("medium"), g("extra_keys"), g("group_idx"), g("kv_cache_spec_kind"),
            )
        if tag == "BlockRemoved":
            return _removed(g("block_hashes"), g("medium"), g("group_idx"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    return None


def _is_hash(h: Any) -> bool:
    t = type(h)
    return t is int or t is bytes


def _hashes_ok(hashes: Any) -> bool:
    if type(hashes) is not list:
        return False
    for h in hashes:
        t = type(h)
        if t is not int and t is not bytes:
            return False
    return True


def _tokens_ok(tokens: Any) -> bool:
    if type(tokens) is not list:
        return False
    try:
        # C-speed check: every item an int in [0, 2**64). Nested lists (SGLang EAGLE bigram
        # pairs), floats, strings or nil raise TypeError; negatives raise OverflowError.
        array("Q", tokens)
    except (TypeError, OverflowError):
        return False
    return True


def _opt(v: Any, t: type) -> bool:
    return v is None or type(v) is t


def _stored(
    hashes: Any, parent: Any, tokens: Any, block_size: Any,
    lora_name: Any, medium: Any, extra_keys: Any, group_idx: Any, kind: Any,
) -> BlockStored | None:
    if not _hashes_ok(hashes) or not (parent is None or _is_hash(parent)) or not _tokens_ok(tokens):
        return None
    if type(block_size) is not int or block_size <= 0:
        return None
    if not (_opt(lora_name, str) and _opt(medium, str) and _opt(extra_keys, list) and _opt(group_idx, int) and _opt(kind, str)):
        return None
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_name=lora_name,
        medium=medium,
        extra_keys=extra_keys,
        group_idx=group_idx,
        kv_cache_spec_kind=kind,
    )


def _removed(hashes: Any, medium: Any, group_idx: Any) -> BlockRemoved | None:
    if not _hashes_ok(hashes) or not (_opt(medium, str) and _opt(group_idx, int)):
        return None
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx)
