"""Pieces shared by the OpenAI pass-through and the SGLang translator.

``RetryableUpstreamError`` is the proxy's one signal to the api's retry loop: the worker
could not be reached, or failed (5xx) before a single byte went to the client, so the
request can go to the next-best worker. Everything after the first byte is the proxy's
own business (clean SSE error event, never a hang).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
from aiohttp import web

from mmroute.errors import RouterError

log = logging.getLogger("mmroute.proxy")

SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}
DONE_EVENT = b"data: [DONE]\n\n"

# Client-disconnect poll: aiohttp only cancels handlers on disconnect with
# handler_cancellation=True (off by default since 3.9); this catches it either way.
DISCONNECT_POLL_S = 0.25

# Connect-level failures: the request never reached a worker that answered.
_CONNECT_TIMEOUT = getattr(aiohttp, "ConnectionTimeoutError", ())
CONNECT_ERRORS: tuple[type[BaseException], ...] = tuple(
    t
    for t in (
        aiohttp.ClientConnectorError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
        _CONNECT_TIMEOUT,
    )
    if isinstance(t, type)
)


class RetryableUpstreamError(Exception):
    """Nothing was sent to the client; the request may be retried on another worker.

    ``status``/``body``/``content_type`` hold the worker's 5xx answer (None for connection
    failures), so the api can return the last one when it runs out of workers.
    """

    def __init__(
        self, reason: str, *, status: int | None = None, body: bytes | None = None, content_type: str | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body
        self.content_type = content_type

    @property
    def connect_failure(self) -> bool:
        """True when the worker was not reached at all (mark it unhealthy)."""
        return self.status is None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # None: the worker did not report prompt_tokens_details


@dataclass
class ProxyHooks:
    """Callbacks from the proxy into the api (booking release, metrics)."""

    on_first_token: Callable[[], Any] | None = None  # first streamed event / the full answer
    on_usage: Callable[[Usage], Any] | None = None
    # Called once when a response was produced: "ok", "error" (worker 4xx passed through),
    # "upstream_error" / "timeout" (after bytes went out), "client_disconnect".
    on_complete: Callable[[str], Any] | None = None

    def first_token(self) -> None:
        _call(self.on_first_token)

    def usage(self, u: Usage) -> None:
        _call(self.on_usage, u)

    def complete(self, outcome: str) -> None:
        _call(self.on_complete, outcome)


def _call(cb: Callable[..., Any] | None, *args: Any) -> None:
    if cb is None:
        return
    try:
        cb(*args)
    except Exception:  # a metrics bug must not break a response
        log.exception("proxy hook %r failed", cb)


def usage_from(obj: Any) -> Usage | None:
    """``usage`` of an OpenAI response/chunk (ENGINES.md §2.5), or None."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(_int(u.get("prompt_tokens")), _int(u.get("completion_tokens")), _int(cached))


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# ---- SSE ------------------------------------------------------------------------------------

_EVENT_END = re.compile(rb"\r?\n\r?\n")


class SSESplitter:
    """Splits a byte stream into complete SSE events (each with its terminator, byte-exact)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        start = max(0, len(self._buf) - 3)  # a terminator may straddle the previous chunk
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos = 0
        while True:
            m = _EVENT_END.search(buf, max(pos, start))
            if m is None:
                break
            out.append(buf[pos:m.end()])
            pos = m.end()
        self._buf = buf[pos:]
        return out

    def rest(self) -> bytes:
        r, self._buf = self._buf, b""
        return r


def sse_data(event: bytes) -> bytes | None:
    """The ``data`` of one SSE event (multi-line data joined by ``\\n``); None for comments."""
    parts: list[bytes] = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            v = line[5:]
            parts.append(v[1:] if v.startswith(b" ") else v)
    return b"\n".join(parts) if parts else None


def sse_event(obj: Any) -> bytes:
    try:
        raw = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate from upstream JSON: escape it instead
        raw = json.dumps(obj, separators=(",", ":")).encode()
    return b"data: " + raw + b"\n\n"


def client_gone(request: web.Request) -> bool:
    tr = request.transport
    return tr is None or tr.is_closing()


def error_event(status: int, message: str, code: str | None = None) -> bytes:
    return sse_event(RouterError(status, message, code=code).body())


def error_response(status: int, message: str, *, headers: dict[str, str] | None = None, code: str | None = None) -> web.Response:
    err = RouterError(status, message, code=code)
    return web.json_response(err.body(), status=status, headers=headers)


def response_headers(worker_id: str, request_id: str) -> dict[str, str]:
    return {"x-mmroute-worker": worker_id, "x-request-id": request_id}


def upstream_headers(request: web.Request, request_id: str, extra: dict[str, str] | None) -> dict[str, str]:
    h = {"content-type": "application/json", "x-request-id": request_id}
    auth = request.headers.get("authorization")
    if auth:  # workers started with --api-key need the client's key
        h["authorization"] = auth
    if extra:
        h.update(extra)
    return h


async def read_error_body(resp: aiohttp.ClientResponse, limit: int = 64 * 1024) -> bytes:
    """A worker's error body, bounded, never raising."""
    try:
        return await asyncio.wait_for(resp.content.read(limit), 5.0)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return b""


async def client_write(out: web.StreamResponse, data: bytes) -> bool:
    """Write to the client; False when the client is gone."""
    try:
        await out.write(data)
        return True
    except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError):
        return False


async def client_eof(out: web.StreamResponse) -> None:
    try:
        await out.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError):
        pass


class ClientWatch:
    """Cancels the handler task when the client's connection goes away.

    Needed because aiohttp's default (``handler_cancellation=False``) lets a handler wait
    on a silent upstream forever after the client left; cancelling makes the proxy close
    the upstream response, which is how the worker learns to abort the request.
    """

    __slots__ = ("_request", "_task", "_handle", "fired")

    def __init__(self, request: web.Request, interval: float = DISCONNECT_POLL_S) -> None:
        self._request = request
        self._task = asyncio.current_task()
        self.fired = False
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(interval, self._check, interval)

    def _check(self, interval: float) -> None:
        if client_gone(self._request):
            self.fired = True
            self._handle = None
            if self._task is not None:
                self._task.cancel()
            return
        self._handle = asyncio.get_running_loop().call_later(interval, self._check, interval)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
