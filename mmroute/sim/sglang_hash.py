"""SGLang's page hash and multimodal pad values, computed the engine's way.

Page hash (SGLang ``mem_cache/radix_cache.py::compute_node_hash_values`` with
``hicache_storage.get_hash_str`` / ``hash_str_to_int64``; ENGINES.md §3.2)::

    digest_i = sha256(digest_{i-1} + b"".join(u32le(t) for t in page_i))

chained over the full 32-byte parent digest (no prefix for a child of the root);
a "wide" page (any id > 2**32-1, i.e. every image page under the 0.5.23 pad scheme)
is ``sha256(parent + b"\\xff" + u64le tokens)`` (0.5.23 ``cpp_utils/hash_binding.cpp``).
The wire value is the high 64 bits as a signed int64.

Pad values (``srt/managers/schedule_batch.py``; ENGINES.md §3.3): SGLang swaps each
image's placeholder positions for values derived from the item's 64-bit hash.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

MM_PAD_SHIFT_VALUE = 1_000_000
_U32_MAX = (1 << 32) - 1
_MASK62 = (1 << 62) - 1
_WIDE_PAD_DOMAIN = b"sglang-mm-wide-pad-v1"
# Releases whose pad values are the 4 cycled "wide" ones (0.5.23 and later).
WIDE_PAD_SINCE = (0, 5, 23)


def page_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    h = hashlib.sha256()
    if parent:
        h.update(parent)
    if any(t > _U32_MAX for t in tokens):
        h.update(b"\xff")
        h.update(struct.pack(f"<{len(tokens)}Q", *tokens))
    else:
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


def wire_int64(digest: bytes) -> int:
    """hash_str_to_int64: the first 16 hex digits as a signed 64-bit integer."""
    return int.from_bytes(digest[:8], "big", signed=True)


def chain_pages(tokens: Sequence[int], page_size: int, parent: bytes | None = None) -> list[bytes]:
    """Digests of the full pages of ``tokens`` chained from ``parent`` (None: root)."""
    out: list[bytes] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_digest(parent, tokens[start : start + page_size])
        out.append(parent)
    return out


def parse_version(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def uses_wide_pads(version: str) -> bool:
    return parse_version(version) >= WIDE_PAD_SINCE


def pad_values(mm_hash: int, version: str) -> list[int]:
    """The pad values one image's span cycles through, for the emulated release."""
    h = mm_hash & ((1 << 64) - 1)
    if uses_wide_pads(version):
        d = hashlib.sha256(_WIDE_PAD_DOMAIN + h.to_bytes(8, "big")).digest()
        return [MM_PAD_SHIFT_VALUE + (int.from_bytes(d[8 * k : 8 * k + 8], "big") & _MASK62) for k in range(4)]
    # 0.5.18 - 0.5.22: one value, only the low 30 bits of the hash count.
    return [MM_PAD_SHIFT_VALUE + (h % (1 << 30))]


def fill_span(values: list[int], length: int) -> list[int]:
    """The span's ids: ``values`` repeated cyclically from the span's first position."""
    n = len(values)
    return [values[i % n] for i in range(length)]


def parse_mm_hash(text: str) -> int | None:
    """``int(s, 16)`` over the whole string, masked to 64 bits; None when unparsable
    (SGLang then falls back to its own content hash for that item)."""
    try:
        return int(text, 16) & ((1 << 64) - 1)
    except (TypeError, ValueError):
        return None
