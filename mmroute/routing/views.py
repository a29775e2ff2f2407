"""Per-backend token views: what each engine puts in ``BlockStored.token_ids``.

The router keys a request with exactly the ids (and per-block extra keys) the
worker's engine will publish for it, so request keys equal event keys:

- vLLM: image spans hold the model's image token id; each block's extra keys carry
  the image identifiers (forwarded as the content part's ``uuid``), LoRA name and
  cache salt (ENGINES.md §1.5, §2.2; DESIGN.md "Multimodal identity").
- SGLang: image spans hold pad values derived from the item's 64-bit hash, which
  the router forwards as ``mm_hashes``; no extra keys (ENGINES.md §3.1, §3.3).

All functions are pure.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Literal, Protocol, Sequence

import xxhash

from mmroute.routing.keys import chain_keys, vllm_block_extras

Scheme = Literal["wide", "legacy"]

# SGLang srt/managers/schedule_batch.py MM_PAD_SHIFT_VALUE.
MM_PAD_SHIFT = 1_000_000
_WIDE_PREFIX = b"sglang-mm-wide-pad-v1"
_MASK62 = (1 << 62) - 1
_MASK64 = (1 << 64) - 1
_HEX = re.compile(r"[0-9a-fA-F]{16,}")
_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


class SpanItem(Protocol):
    """An image placeholder span (``models.base.MMItem`` or anything shaped like it)."""

    identifier: str
    offset: int
    length: int


def _check_spans(n_tokens: int, mm_items: Sequence[SpanItem]) -> None:
    for it in mm_items:
        if it.offset < 0 or it.length < 0 or it.offset + it.length > n_tokens:
            raise ValueError(
                f"image span [{it.offset}, {it.offset + it.length}) outside the prompt ({n_tokens} tokens)"
            )


# ---------------------------------------------------------------- vLLM
def vllm_view_keys(
    token_ids: Sequence[int],
    mm_items: Sequence[SpanItem],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Router keys of a vLLM request: ``token_ids`` already hold the image token in
    every image span (the renderer's view); extras as vLLM >= 0.19 publishes them."""
    n = len(token_ids) // block_size
    if not mm_items and not lora_name and cache_salt is None:
        return chain_keys(token_ids, block_size)
    _check_spans(len(token_ids), mm_items)
    extras = vllm_block_extras(
        n,
        block_size,
        [(it.identifier, it.offset, it.length) for it in mm_items],
        lora_name=lora_name,
        cache_salt=cache_salt,
    )
    return chain_keys(token_ids, block_size, extras)


# ---------------------------------------------------------------- SGLang
def sglang_scheme_for_version(version: str) -> Scheme | None:
    """Pad scheme of an SGLang release (``/server_info`` ``version``): ``"wide"`` from
    0.5.23, ``"legacy"`` for 0.5.18-0.5.22, None (no ``mm_hashes``: image pages are
    unmatchable) before that or when the version cannot be read."""
    m = _VERSION.match(version.strip()) if version else None
    if m is None:
        return None
    v = tuple(int(x) for x in m.groups())
    if v >= (0, 5, 23):
        return "wide"
    if v >= (0, 5, 18):
        return "legacy"
    return None


@lru_cache(maxsize=4096)
def _pad_values(h: int, scheme: str) -> tuple[int, ...]:
    h &= _MASK64
    if scheme == "wide":
        # SGLang 0.5.23 schedule_batch.py::_compute_pad_values (ENGINES.md §3.3).
        d = hashlib.sha256(_WIDE_PREFIX + h.to_bytes(8, "big")).digest()
        return tuple(MM_PAD_SHIFT + (int.from_bytes(d[8 * k : 8 * k + 8], "big") & _MASK62) for k in range(4))
    if scheme == "legacy":
        return (MM_PAD_SHIFT + h % (1 << 30),)
    raise ValueError(f"unknown SGLang pad scheme {scheme!r} (wide or legacy)")


def sglang_pad_values(h: int, scheme: Scheme) -> list[int]:
    """The pad values SGLang writes over an image span for item hash ``h``."""
    return list(_pad_values(h, scheme))


def mm_hash_u64(identifier: str) -> int:
    """The 64-bit item hash the router forwards for an image identifier: the first
    16 hex digits of a hex identifier (our blake3 content ids), else xxh3_64 of the
    string (a client uuid). Never the 64-hex form: its low bits are zero (§3.3)."""
    if _HEX.fullmatch(identifier):
        return int(identifier[:16], 16)
    return xxhash.xxh3_64_intdigest(identifier.encode("utf-8"))


def mm_hash_hex16(identifier: str) -> str:
    """``mm_hash_u64`` as the 16-hex string sent in ``/generate`` ``mm_hashes``."""
    return f"{mm_hash_u64(identifier):016x}"


def sglang_view(token_ids: Sequence[int], mm_items: Sequence[SpanItem], scheme: Scheme | None) -> list[int]:
    """SGLang's cached ids: each image span filled cyclically with that item's pad
    values; the tokens around it (e.g. Qwen's vision_start/end) stay."""
    out = list(token_ids)
    if not mm_items:
        return out
    if scheme is None:
        raise ValueError("this SGLang release has no mm_hashes: image pages cannot be keyed")
    _check_spans(len(out), mm_items)
    for it in mm_items:
        pads = _pad_values(mm_hash_u64(it.identifier), scheme)
        start, length = it.offset, it.length
        if len(pads) == 1:
            out[start : start + length] = pads * length
        else:
            reps = -(-length // len(pads))
            out[start : start + length] = (pads * reps)[:length]
    return out


def sglang_view_keys(
    token_ids: Sequence[int], mm_items: Sequence[SpanItem], block_size: int, scheme: Scheme | None
) -> list[int]:
    """Router keys of an SGLang request (no extra keys: SGLang publishes none)."""
    return chain_keys(sglang_view(token_ids, mm_items, scheme), block_size)
