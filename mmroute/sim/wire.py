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


# --- the engines' event structs ------------------------------------------------------------
# Field lists in the engines' declaration order (the array flavours write them by position);
# each flavour's BlockStored / BlockRemoved / AllBlocksCleared is built from one of them.

# vLLM 0.22-0.23 (``vllm/distributed/kv_events.py``); the map era appends fields at the end.
_VLLM_STORED: list[tuple[Any, ...]] = [
    ("block_hashes", list[Any]),
    ("parent_block_hash", Any),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", Any),
    ("medium", Any),
    ("lora_name", Any),
    ("extra_keys", Any, None),
    ("group_idx", Any, None),
    ("kv_cache_spec_kind", Any, None),
    ("kv_cache_spec_sliding_window", Any, None),
]
_VLLM_REMOVED: list[tuple[Any, ...]] = [("block_hashes", list[Any]), ("medium", Any), ("group_idx", Any, None)]
# Added by vLLM >= 0.24 (map era), as of 0.33.0.
_VLLM_MAP_STORED = _VLLM_STORED + [
    ("locality", Any, None),
    ("ownership", Any, None),
    ("session_id", Any, None),
    ("lookahead_token_ids", Any, None),
]
_VLLM_MAP_REMOVED = _VLLM_REMOVED + [("locality", Any, None), ("ownership", Any, None)]

# SGLang: the same fields in both eras, only the encoding changed.
_SGLANG_STORED: list[tuple[Any, ...]] = [
    ("block_hashes", list[int]),
    ("parent_block_hash", Any),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", Any),
    ("medium", Any),
]
_SGLANG_REMOVED: list[tuple[Any, ...]] = [("block_hashes", list[int]), ("medium", Any)]


def _event_structs(
    prefix: str, stored: list[tuple[Any, ...]], removed: list[tuple[Any, ...]], **config: Any
) -> tuple[type[msgspec.Struct], type[msgspec.Struct], type[msgspec.Struct]]:
    """One flavour's (BlockStored, BlockRemoved, AllBlocksCleared), tagged with the engines'
    class names; ``config`` is the msgspec encoding (``array_like``, ``omit_defaults``)."""
    stored_cls, removed_cls, cleared_cls = (
        msgspec.defstruct(prefix + tag, fields, tag=tag, gc=False, module=__name__, **config)
        for tag, fields in (("BlockStored", stored), ("BlockRemoved", removed), ("AllBlocksCleared", []))
    )
    return stored_cls, removed_cls, cleared_cls


VMapBlockStored, VMapBlockRemoved, VMapAllBlocksCleared = _event_structs(
    "VMap", _VLLM_MAP_STORED, _VLLM_MAP_REMOVED, omit_defaults=True
)
VArrBlockStored, VArrBlockRemoved, VArrAllBlocksCleared = _event_structs(
    "VArr", _VLLM_STORED, _VLLM_REMOVED, array_like=True, omit_defaults=True
)
SMapBlockStored, SMapBlockRemoved, SMapAllBlocksCleared = _event_structs(
    "SMap", _SGLANG_STORED, _SGLANG_REMOVED, omit_defaults=True
)
SArrBlockStored, SArrBlockRemoved, SArrAllBlocksCleared = _event_structs(
    "SArr", _SGLANG_STORED, _SGLANG_REMOVED, array_like=True
)

_STRUCTS = {
    "vllm-map": (VMapBlockStored, VMapBlockRemoved, VMapAllBlocksCleared),
    "vllm-array": (VArrBlockStored, VArrBlockRemoved, VArrAllBlocksCleared),
    "sglang-map": (SMapBlockStored, SMapBlockRemoved, SMapAllBlocksCleared),
    "sglang-array": (SArrBlockStored, SArrBlockRemoved, SArrAllBlocksCleared),
}
FLAVORS = tuple(_STRUCTS)


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
        self._vllm = flavor.startswith("vllm")
        self._stored, self._removed, self._cleared = _STRUCTS[flavor]
        self._enc = msgspec.msgpack.Encoder()

    def to_struct(self, rec: Record) -> msgspec.Struct:
        if isinstance(rec, Stored):
            if self._vllm:
                return self._stored(
                    block_hashes=list(rec.block_hashes),
                    parent_block_hash=rec.parent_block_hash,
                    token_ids=list(rec.token_ids),
                    block_size=rec.block_size,
                    lora_id=rec.lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=rec.lora_name,
                    extra_keys=list(rec.extra_keys) if rec.extra_keys is not None else [None] * len(rec.block_hashes),
                    group_idx=0,
                    kv_cache_spec_kind=FULL_ATTENTION,
                )
            return self._stored(
                block_hashes=list(rec.block_hashes),
                parent_block_hash=rec.parent_block_hash,
                token_ids=list(rec.token_ids),
                block_size=rec.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
            )
        if isinstance(rec, Removed):
            if self._vllm:
                return self._removed(block_hashes=list(rec.block_hashes), medium=MEDIUM_GPU, group_idx=0)
            return self._removed(block_hashes=list(rec.block_hashes), medium=MEDIUM_GPU)
        if isinstance(rec, Cleared):
            return self._cleared()
        raise TypeError(f"not an event record: {rec!r}")

    def encode(self, ts: float, records: list[Record], dp_rank: int = 0) -> bytes:
        return self._enc.encode(Batch(ts=float(ts), events=[self.to_struct(r) for r in records], dp_rank=dp_rank))
