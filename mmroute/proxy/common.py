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
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from mmroute.errors import RouterError

if TYPE_CHECKING:
    from mmroute.proxy.upstream import Upstream
    from mmroute.workers.registry import Worker

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
    return Usage(int_or_none(u.get("prompt_tokens")), int_or_none(u.get("completion_tokens")), int_or_none(cached))


def int_or_none(v: Any) -> int | None:
    """``v`` when it is a JSON integer (not a bool), else None."""
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


# ---- one upstream call, relayed ------------------------------------------------------------


def timed_out(worker: Worker, out_headers: dict[str, str], hooks: ProxyHooks) -> web.Response:
    """The 504 for a worker that went silent before anything was sent to the client."""
    hooks.complete("timeout")
    return error_response(504, f"worker {worker.id} did not answer in time", headers=out_headers)


async def post_and_relay(
    request: web.Request,
    upstream: Upstream,
    worker: Worker,
    path: str,
    data: bytes,
    *,
    request_id: str,
    hooks: ProxyHooks,
    headers: dict[str, str] | None,
    relay: Callable[[aiohttp.ClientResponse, dict[str, str]], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """POST ``data`` to ``worker.url + path``; ``relay(resp, out_headers)`` answers the client
    from any response below 500.

    The contract both proxies share: ``RetryableUpstreamError`` when the worker was
    unreachable or answered 5xx (nothing sent yet); a 504 when it stayed silent; on client
    disconnect the upstream response is closed (the worker sees the cancellation) and
    ``asyncio.CancelledError`` propagates.
    """
    out_headers = response_headers(worker.id, request_id)
    watch = ClientWatch(request)
    resp: aiohttp.ClientResponse | None = None
    try:
        try:
            resp = await upstream.session(worker).post(
                worker.url + path, data=data, headers=upstream_headers(request, request_id, headers)
            )
        except CONNECT_ERRORS as exc:
            raise RetryableUpstreamError(f"{worker.id}: {type(exc).__name__}: {exc}") from exc
        except asyncio.TimeoutError:
            return timed_out(worker, out_headers, hooks)
        if resp.status >= 500:
            err = await read_error_body(resp)
            raise RetryableUpstreamError(
                f"{worker.id} answered {resp.status}", status=resp.status, body=err, content_type=resp.content_type
            )
        return await relay(resp, out_headers)
    except asyncio.CancelledError:
        if resp is not None:
            resp.close()  # drop the connection: the worker aborts the request
        hooks.complete("client_disconnect" if watch.fired or client_gone(request) else "cancelled")
        raise
    finally:
        watch.stop()
        if resp is not None:
            resp.release()


async def read_whole(resp: aiohttp.ClientResponse, worker: Worker) -> bytes | None:
    """A non-streamed answer's body; None when the worker went silent (answer ``timed_out``).

    A broken connection raises ``RetryableUpstreamError``: nothing went to the client yet,
    so another worker may still answer.
    """
    try:
        return await resp.read()
    except asyncio.TimeoutError:
        return None
    except (aiohttp.ClientError, OSError) as exc:
        raise RetryableUpstreamError(f"{worker.id}: response broken: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class StreamFailure:
    """Why a relayed stream ended badly: hook outcome, HTTP-like status, message."""

    outcome: str  # "timeout" | "upstream_error"
    status: int
    message: str


class UpstreamChunks:
    """``async for chunk in UpstreamChunks(resp, worker)``: a streamed answer's raw chunks
    until EOF. A silent worker or a broken connection ends the iteration and is kept in
    ``failure`` (a timeout with ``timeout_status``)."""

    __slots__ = ("_resp", "_worker", "_timeout_status", "failure")

    def __init__(self, resp: aiohttp.ClientResponse, worker: Worker, *, timeout_status: int = 504) -> None:
        self._resp = resp
        self._worker = worker
        self._timeout_status = timeout_status
        self.failure: StreamFailure | None = None

    def __aiter__(self) -> UpstreamChunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._resp.content.readany()
        except asyncio.TimeoutError:
            self.failure = StreamFailure(
                "timeout", self._timeout_status, f"worker {self._worker.id} stopped streaming (timeout)"
            )
            raise StopAsyncIteration from None
        except (aiohttp.ClientError, OSError) as exc:
            self.failure = StreamFailure(
                "upstream_error", 502, f"worker {self._worker.id} stream broke: {type(exc).__name__}: {exc}"
            )
            raise StopAsyncIteration from None
        if not chunk:
            raise StopAsyncIteration
        return chunk


class ClientStream:
    """The SSE answer to the client while relaying from ``upstream``.

    When the client goes away (``open``/``send`` return False) the upstream response is
    closed, so the worker aborts the request, and the outcome is ``client_disconnect``.
    """

    __slots__ = ("out", "_request", "_hooks", "_upstream")

    def __init__(
        self,
        request: web.Request,
        hooks: ProxyHooks,
        out_headers: dict[str, str],
        upstream: aiohttp.ClientResponse | None,
        status: int = 200,
    ) -> None:
        self.out = web.StreamResponse(status=status, headers={**SSE_HEADERS, **out_headers})
        self._request = request
        self._hooks = hooks
        self._upstream = upstream

    def _client_gone(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
        self._hooks.complete("client_disconnect")

    async def open(self) -> bool:
        try:
            await self.out.prepare(self._request)
            return True
        except (ConnectionError, aiohttp.ClientConnectionError):
            self._client_gone()
            return False

    async def send(self, data: bytes) -> bool:
        if await client_write(self.out, data):
            return True
        self._client_gone()
        return False

    async def finish(self, failure: StreamFailure | None, tail: bytes = b"") -> web.StreamResponse:
        """End the stream: a failure becomes an error event and ``[DONE]``; else ``tail``."""
        if failure is not None:
            if self._upstream is not None:
                self._upstream.close()
            event = error_event(failure.status, failure.message, code="upstream_stream_error")
            await client_write(self.out, event + DONE_EVENT)
            await client_eof(self.out)
            self._hooks.complete(failure.outcome)
            return self.out
        if tail:
            await client_write(self.out, tail)
        await client_eof(self.out)
        self._hooks.complete("ok")
        return self.out
