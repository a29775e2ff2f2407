"""The simulated engines' KV events and their msgpack encoding, shaped like the engines'.

The engines emit engine-neutral ``Stored`` / ``Removed`` / ``Cleared`` records; a
``WireEncoder`` turns a batch of them into the exact payload bytes of one emulated
flavour (msgspec Structs declared like the engines' own, so msgspec produces the
same bytes -- checked against the real captures in ``tests/fixtures/kv_events``):

* ``vllm-map``  -- vLLM 0.24-0.33 (``vllm/distributed/kv_events.py``): tagged maps,
  ``omit_defaults``: None-default fields absent, fields without default always present.
* ``vllm-array`` -- vLLM 0.22-0.23: positional ``array_like`` structs, 12 positions for
  BlockStored (every field written, nulls included), 4 for BlockRemoved.
* ``sglang-map`` -- SGLang >= 0.5.20 (``disaggregation/kv_events.py``): tagged maps
  without ``extra_keys``/``lora_name``/``group_idx``.
* ``sglang-array`` -- SGLang <= 0.5.19: positional, 7 positions for BlockStored.

The batch is always positional: ``[ts, events, dp_rank]``. This module never uses
``mmroute.kv`` (the router's decoder): the two sides only meet on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgspec

FLAVORS = ("vllm-map", "vllm-array", "sglang-map", "sglang-array")
MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"

WireHash = Union[int, bytes]


# --- engine-neutral records ---------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    # vLLM only: one entry per block (None or the event-side list).
    extra_keys: list[Any] | None = None


@dataclass(frozen=True)
class Removed:
    block_hashes: list[WireHash]


@dataclass(frozen=True)
class Cleared:
    pass


Record = Union[Stored, Removed, Cleared]


# --- vLLM >= 0.24 (map era), as of 0.33.0 -----------------------------------------------


class _VMap(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class VMapBlockStored(_VMap, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: Any
    medium: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: Any = None


class VMapBlockRemoved(_VMap, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: Any
    group_idx: Any = None
    locality: Any = None
    ownership: Any = None


class VMapAllBlocksCleared(_VMap, tag="AllBlocksCleared"):
    pass


# --- vLLM 0.22-0.23 (positional era) -------------------------------------------------------


class _VArr(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    pass


class VArrBlockStored(_VArr, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: Any
    medium: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None


class VArrBlockRemoved(_VArr, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: Any
    group_idx: Any = None


class VArrAllBlocksCleared(_VArr, tag="AllBlocksCleared"):
    pass


# --- SGLang ----------------------------------------------------------------------------


class _SMap(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class SMapBlockStored(_SMap, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: Any
    medium: Any


class SMapBlockRemoved(_SMap, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Any


class SMapAllBlocksCleared(_SMap, tag="AllBlocksCleared"):
    pass


class _SArr(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class SArrBlockStored(_SArr, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: Any
    medium: Any


class SArrBlockRemoved(_SArr, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Any


class SArrAllBlocksCleared(_SArr, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, gc=False):
    """``[ts, events, dp_rank]`` -- vLLM's ``KVEventBatch``, SGLang's ``KVEventBatch``."""

    ts: float
    events: list[Any]
    dp_rank: int = 0


# --- encoding --------------------------------------------------------------------------


class WireEncoder:
    """Encodes batches of records as one emulated engine flavour."""

    def __init__(self, flavor: str):
        if flavor not in FLAVORS:
            raise ValueError(f"unknown wire flavor {flavor!r} (one of {', '.join(FLAVORS)})")
        self.flavor = flavor
        self._enc = msgspec.msgpack.Encoder()

    def to_struct(self, rec: Record) -> msgspec.Struct:
        f = self.flavor
        if isinstance(rec, Stored):
            if f == "vllm-map" or f == "vllm-array":
                cls = VMapBlockStored if f == "vllm-map" else VArrBlockStored
                n = len(rec.block_hashes)
                return cls(
                    block_hashes=list(rec.block_hashes),
                    parent_block_hash=rec.parent_block_hash,
                    token_ids=list(rec.token_ids),
                    block_size=rec.block_size,
                    lora_id=rec.lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=rec.lora_name,
                    extra_keys=list(rec.extra_keys) if rec.extra_keys is not None else [None] * n,
                    group_idx=0,
                    kv_cache_spec_kind=FULL_ATTENTION,
                )
            cls = SMapBlockStored if f == "sglang-map" else SArrBlockStored
            return cls(
                block_hashes=list(rec.block_hashes),
                parent_block_hash=rec.parent_block_hash,
                token_ids=list(rec.token_ids),
                block_size=rec.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
            )
        if isinstance(rec, Removed):
            if f == "vllm-map":
                return VMapBlockRemoved(block_hashes=list(rec.block_hashes), medium=MEDIUM_GPU, group_idx=0)
            if f == "vllm-array":
                return VArrBlockRemoved(block_hashes=list(rec.block_hashes), medium=MEDIUM_GPU, group_idx=0)
            cls = SMapBlockRemoved if f == "sglang-map" else SArrBlockRemoved
            return cls(block_hashes=list(rec.block_hashes), medium=MEDIUM_GPU)
        if isinstance(rec, Cleared):
            return {
                "vllm-map": VMapAllBlocksCleared,
                "vllm-array": VArrAllBlocksCleared,
                "sglang-map": SMapAllBlocksCleared,
                "sglang-array": SArrAllBlocksCleared,
            }[f]()
        raise TypeError(f"not an event record: {rec!r}")

    def encode(self, ts: float, records: list[Record], dp_rank: int = 0) -> bytes:
        return self._enc.encode(Batch(ts=float(ts), events=[self.to_struct(r) for r in records], dp_rank=dp_rank))
