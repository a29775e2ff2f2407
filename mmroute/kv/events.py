"""Decoded KV-cache events: the engine-neutral shape every wire era decodes into.

vLLM (0.11-0.33+) and SGLang (0.5.x) publish the same three event kinds
(ENGINES.md §1.3-1.4, §3.1). The decoder (``kv.wire``) fills these; the index
(``routing.index``) consumes them. Engine hashes stay opaque: ``int`` (vLLM's low
64 bits unsigned, SGLang's high 64 bits signed) or ``bytes`` (vLLM with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); they are only ever dictionary keys.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

EngineHash = Union[int, bytes]


class BlockStored(msgspec.Struct, frozen=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    # One entry per block, exactly as received (None, or a list mixing bare strings
    # -- LoRA name, cache salt -- and [identifier, offset] pairs). None: no keys at all.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, frozen=True):
    ts: float
    events: list[Event]
    dp_rank: int | None = None
    # Events the decoder skipped (unknown tag, malformed); counted, never fatal.
    skipped: int = 0


class KVMessage(msgspec.Struct, frozen=True):
    """One ZMQ message (live or replayed): topic, sequence number, decoded batch."""

    topic: bytes
    seq: int
    batch: EventBatch


# Media values that are device (GPU) hits; others are host/disk tiers (ENGINES.md §1.4, §3.1).
DEVICE_MEDIA = (None, "GPU")
