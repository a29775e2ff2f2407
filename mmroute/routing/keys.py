"""Router block keys: one chained 64-bit key per full KV block.

The dual-key design (DESIGN.md "Block keys", ENGINES.md §1.5): the router never
recomputes an engine's own block hash (vLLM's is pickle/CBOR + seed dependent,
SGLang's changed across releases). Both sides -- the request being routed and the
``BlockStored`` events a worker publishes -- go through ``chain_keys`` below, so a
block's key depends only on (parent key, the block's token ids, the block's extra
keys as the engine publishes them). Equal inputs, equal keys, on every replica.
"""

from __future__ import annotations

from array import array
from typing import Any, Iterable, Sequence

import msgspec
import xxhash

# Fixed seed: keys must be equal across router replicas and restarts.
ROOT_KEY = 0x6D6D726F75746521  # b"mmroute!"
_SEED = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

_encode = msgspec.msgpack.Encoder().encode


def canon_extra(entry: Any) -> bytes:
    """Canonical bytes of one block's extra-keys entry (b"" when it has none).

    The entry is taken exactly as vLLM >= 0.19 publishes it in ``BlockStored.extra_keys``
    (a list of bare strings -- LoRA name, cache salt -- and ``[identifier, offset]``
    pairs); the request side builds the identical list (``vllm_block_extras``).
    """
    if not entry:
        return b""
    return _encode(entry)


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    # u64 little-endian: SGLang 0.5.23 pad values reach 2**62, so 32 bits are not enough.
    try:
        return array("Q", token_ids).tobytes()
    except OverflowError:
        # Negative or > 2**64 ids never come from an engine; fold them so the key is
        # still deterministic rather than raising on a hostile event.
        return array("Q", [t & _MASK64 for t in token_ids]).tobytes()


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    extras: Sequence[bytes] | None = None,
    parent: int = ROOT_KEY,
) -> list[int]:
    """Keys of the *full* blocks of ``token_ids``, chained from ``parent``.

    ``extras[i]`` is ``canon_extra`` of block i's entry (b"" or missing: none).
    A trailing partial block gets no key: engines never hash it either.
    """
    n = len(token_ids) // block_size
    if n == 0:
        return []
    packed = _pack_tokens(token_ids[: n * block_size])
    step = 8 * block_size
    h = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    for i in range(n):
        extra = extras[i] if extras is not None and i < len(extras) else b""
        data = parent.to_bytes(8, "little") + packed[i * step : (i + 1) * step]
        if extra:
            # Length-prefix the extra so (tokens, extra) splits are unambiguous.
            data += len(extra).to_bytes(4, "little") + extra
        parent = h(data, _SEED)
        keys.append(parent)
    return keys


def vllm_block_extras(
    num_blocks: int,
    block_size: int,
    mm_spans: Iterable[tuple[str, int, int]] = (),
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Per-block extra keys exactly as vLLM publishes them (ENGINES.md §1.5, §2.2).

    Order inside a block: LoRA name, then every image whose placeholder span
    ``[offset, offset+length)`` overlaps the block as ``[identifier, offset - block_start]``
    (negative for blocks that continue an image), then the cache salt on block 0 only.
    Mirrors vLLM 0.33 ``vllm/v1/core/kv_cache_utils.py::generate_block_hash_extra_keys``
    and ``to_event_extra_keys`` (tags stripped, LoRA path dropped).
    """
    # Only the blocks an image touches need a walk; the rest share one entry.
    entries: list[list[Any]] = [[lora_name] if lora_name else [] for _ in range(num_blocks)]
    for ident, off, length in sorted(mm_spans, key=lambda s: s[1]):
        first, last = max(0, off // block_size), min(num_blocks - 1, (off + length - 1) // block_size)
        for b in range(first, last + 1):
            entries[b].append([ident, off - b * block_size])
    if cache_salt is not None and num_blocks:
        entries[0].append(cache_salt)
    plain = canon_extra([lora_name] if lora_name else [])
    return [canon_extra(e) if len(e) > (1 if lora_name else 0) else plain for e in entries]
