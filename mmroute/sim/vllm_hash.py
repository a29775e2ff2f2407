"""vLLM's prefix-cache block hash, computed the engine's way (not the router's).

Mirrors vLLM ``vllm/v1/core/kv_cache_utils.py::hash_block_tokens`` and
``vllm/utils/hashing.py`` (0.33.0): ``h_i = H((h_{i-1} or NONE_HASH, tuple(tokens_i),
extra_i or None))`` with ``H`` = sha256 over pickle protocol 5 (vLLM's default
``--prefix-caching-hash-algo sha256``) or sha256 over canonical CBOR (``sha256_cbor``).
``NONE_HASH = H("vllm-none-hash")`` (the >= 0.29 seed when PYTHONHASHSEED is unset;
ENGINES.md §1.5, vectors §1.8 C).

Extra keys per block (``generate_block_hash_extra_keys``), in order: LoRA, the MM
items overlapping the block with their offset relative to the block start, the cache
salt on the block starting at token 0. Two eras:

* ``"tagged"`` (vLLM >= 0.31, what 0.33 hashes): ``("lora", name, path)``,
  ``("mm", id, off)``, ``("cache_salt", salt)``; the event side strips the tags
  (``to_event_extra_keys``): name, ``(id, off)``, salt.
* ``"plain"`` (vLLM 0.19-0.30, e.g. 0.23): name, ``(id, off)``, salt, hashed and
  published as-is.

Deliberately independent of ``mmroute.routing.keys`` (the router's side).
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import cbor2

HASH_ALGOS = ("sha256", "sha256_cbor")
EXTRA_ERAS = ("tagged", "plain")
NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


def sha256_pickle(obj: Any) -> bytes:
    # vllm.utils.hashing.sha256: pickle protocol 5, HIGHEST_PROTOCOL at the time.
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def sha256_cbor(obj: Any) -> bytes:
    # vllm.utils.hashing.sha256_cbor: canonical CBOR so equal values hash equally.
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_fn(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return sha256_pickle
    if algo == "sha256_cbor":
        return sha256_cbor
    raise ValueError(f"unsupported prefix-caching hash algorithm {algo!r} (one of {', '.join(HASH_ALGOS)})")


def none_hash(algo: str) -> bytes:
    return hash_fn(algo)(NONE_HASH_SEED)


def wire_hash(digest: bytes, int_hashes: bool) -> int | bytes:
    """The form a hash takes in events: low 64 bits unsigned (the default,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the raw digest."""
    if not int_hashes:
        return digest
    return int.from_bytes(digest, "big") & _MASK64


@dataclass(frozen=True)
class MMSpan:
    """One multimodal item's placeholder span in the expanded prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class LoraRef:
    name: str
    int_id: int
    path: str


class VllmBlockHasher:
    """Computes the chain of full-block hashes of one request's token ids."""

    def __init__(self, algo: str = "sha256_cbor", extra_era: str = "tagged"):
        if extra_era not in EXTRA_ERAS:
            raise ValueError(f"unknown extra-keys era {extra_era!r}")
        self.algo = algo
        self.extra_era = extra_era
        self._h = hash_fn(algo)
        self.none_hash = self._h(NONE_HASH_SEED)

    def block_hash(self, parent: bytes | None, tokens: Sequence[int], extra: tuple | None) -> bytes:
        # kv_cache_utils.hash_block_tokens: a falsy parent means "first block".
        return self._h((parent or self.none_hash, tuple(tokens), extra))

    def extra_keys(
        self,
        start: int,
        end: int,
        mm: Sequence[MMSpan],
        lora: LoraRef | None,
        cache_salt: str | None,
    ) -> tuple[tuple | None, list | None]:
        """(hash-side tuple or None, event-side list or None) for block [start, end).

        ``mm`` must be sorted by offset (vLLM assumes the same)."""
        hash_side: list[Any] = []
        event_side: list[Any] = []
        tagged = self.extra_era == "tagged"
        if lora is not None:
            hash_side.append(("lora", lora.name, lora.path) if tagged else lora.name)
            event_side.append(lora.name)
        for item in mm:
            if item.offset + item.length <= start:
                continue
            if item.offset >= end:
                break
            rel = item.offset - start
            hash_side.append(("mm", item.identifier, rel) if tagged else (item.identifier, rel))
            event_side.append([item.identifier, rel])
        if start == 0 and cache_salt:
            hash_side.append(("cache_salt", cache_salt) if tagged else cache_salt)
            event_side.append(cache_salt)
        if not hash_side:
            return None, None
        return tuple(hash_side), event_side
