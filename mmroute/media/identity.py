"""An image's identifier: the blake3 hex digest of its *encoded* bytes.

Hashing the bytes as received (not the URL, not decoded pixels) gives the same id to
the same file whether it came as a data: URL or over http(s), and matches vLLM's own
default content hash input (ENGINES.md §2.3: "URL/base64/file images hash the
original encoded bytes"). The id is forwarded as the content part's ``uuid``.
"""

from __future__ import annotations

from blake3 import blake3

_PARALLEL_FROM = 1 << 20  # blake3's multithreaded mode pays off on large inputs only


def image_identifier(data: bytes) -> str:
    if len(data) >= _PARALLEL_FROM:
        return blake3(data, max_threads=blake3.AUTO).hexdigest()
    return blake3(data).hexdigest()
