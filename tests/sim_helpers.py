"""Shared helpers for the simulator tests: the vendored KV-event captures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import zmq

from mmroute.sim.publisher import END_SEQ
from mmroute.sim.wire import Cleared, Record, Removed, Stored

CAPTURES = Path(__file__).parent / "fixtures" / "kv_events"

_POSITIONAL_STORED = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"]


def load_capture(name: str) -> list[dict[str, Any]]:
    with open(CAPTURES / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def as_map(event: Any) -> dict[str, Any]:
    """A decoded capture event as a dict, whichever era it is."""
    if isinstance(event, dict):
        return event
    tag = event[0]
    if tag == "BlockStored":
        return {"type": tag, **dict(zip(_POSITIONAL_STORED, event[1:]))}
    if tag == "BlockRemoved":
        return {"type": tag, "block_hashes": event[1], "medium": event[2]}
    return {"type": tag}


def records_of(decoded_events: list[Any], *, bytes_hashes: bool = False) -> list[Record]:
    """Rebuild the engine-neutral records behind one decoded capture batch."""

    def h(x: Any) -> Any:
        return bytes.fromhex(x) if bytes_hashes and x is not None else x

    out: list[Record] = []
    for raw in decoded_events:
        e = as_map(raw)
        if e["type"] == "BlockStored":
            out.append(
                Stored(
                    block_hashes=[h(x) for x in e["block_hashes"]],
                    parent_block_hash=h(e["parent_block_hash"]),
                    token_ids=e["token_ids"],
                    block_size=e["block_size"],
                    lora_id=e.get("lora_id"),
                    lora_name=e.get("lora_name"),
                    extra_keys=e.get("extra_keys"),
                )
            )
        elif e["type"] == "BlockRemoved":
            out.append(Removed([h(x) for x in e["block_hashes"]]))
        else:
            out.append(Cleared())
    return out


def stored_tokens(line: dict[str, Any], index: int = 0) -> list[int]:
    events = [as_map(e) for e in line["decoded"][1]]
    return [e for e in events if e["type"] == "BlockStored"][index]["token_ids"]


def replay_frames(
    ctx: zmq.Context, endpoint: str, start: int, frames: list[bytes] | None = None, before: Any = ()
) -> list[list[bytes]]:
    """Ask a replay ROUTER for every batch from ``start`` (after sending the raw requests in
    ``before``; ``frames`` replaces the request); every reply up to the END_SEQ one."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    for bad in before:
        dealer.send_multipart(bad)
    dealer.send_multipart(frames or [b"", start.to_bytes(8, "big")])
    out = []
    while True:
        msg = dealer.recv_multipart()
        out.append(msg)
        if END_SEQ in msg:
            break
    dealer.close()
    return out
