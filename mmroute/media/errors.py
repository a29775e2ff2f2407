"""The media layer's error: a RouterError (400 by default) with a stable code."""

from __future__ import annotations

from mmroute.errors import RouterError


class MediaError(RouterError):
    """``MediaError(400, "invalid_image", "…")``: bad or unreachable media. ``code`` is a
    short machine label (``invalid_image``, ``image_too_large``, ``image_unreachable``, …)."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None):
        super().__init__(status, message, code=code, param=param)
