"""Real aiohttp servers on 127.0.0.1 ephemeral ports for the workers/proxy tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar

from aiohttp import web

from mmroute.config import WorkerSpec
from mmroute.proxy import ProxyHooks, RetryableUpstreamError, Upstream, Usage
from mmroute.workers.registry import Worker


@contextlib.asynccontextmanager
async def serve(app: web.Application, *, port: int = 0, handler_cancellation: bool = True) -> AsyncIterator[str]:
    """Run ``app`` on 127.0.0.1; yields its base URL. ``handler_cancellation=True`` for fake
    workers: like uvicorn-based engines, they notice a dropped client connection."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{bound}"
    finally:
        await runner.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class HookLog:
    first_token: int = 0
    usage: list[Usage] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def hooks(self) -> ProxyHooks:
        def first() -> None:
            self.first_token += 1

        def complete(o: str) -> None:
            self.outcomes.append(o)
            self.done.set()

        return ProxyHooks(on_first_token=first, on_usage=self.usage.append, on_complete=complete)


RETRY_STATUS = 599  # the test router's marker for RetryableUpstreamError


def retry_response(e: RetryableUpstreamError) -> web.Response:
    return web.json_response({"retryable": e.reason, "status": e.status}, status=RETRY_STATUS)


def make_worker(url: str, name: str = "w0", backend: str = "auto") -> Worker:
    return Worker(WorkerSpec.parse(f"{url},name={name},backend={backend}"))


async def read_events(resp: Any) -> list[bytes]:
    """All SSE events of a client response, as raw ``data`` payloads."""
    raw = await resp.read()
    return [e[len(b"data: "):] for e in raw.split(b"\n\n") if e]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def upstream_for_tests(**kw: Any) -> Upstream:
    return Upstream(connect_timeout=kw.pop("connect_timeout", 5.0), request_timeout=kw.pop("request_timeout", 30.0), **kw)


class FakeWorker:
    """A fake engine: one POST route (``path``, set by a subclass) whose behaviour each test
    sets with ``handler(fake, request)``; records what it received and whether the proxy
    cancelled the request."""

    path: ClassVar[str]

    def __init__(self, handler: Callable[[Any, web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.handler = handler
        self.bodies: list[dict] = []
        self.headers: list = []
        self.gate = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.received = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post(self.path, self._route)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.headers.append(request.headers.copy())
        self.received.set()
        try:
            return await self.handler(self, request)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@contextlib.asynccontextmanager
async def mini_router(
    path: str,
    forward: Callable[[web.Request], Awaitable[web.StreamResponse]],
    upstream: Upstream,
    *,
    handler_cancellation: bool = False,
) -> AsyncIterator[str]:
    """A minimal router on ``path``: ``forward`` is the api's handler minus routing, a
    ``RetryableUpstreamError`` answers ``RETRY_STATUS``. Yields the URL; closes ``upstream``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await forward(request)
        except RetryableUpstreamError as e:
            return retry_response(e)

    app = web.Application()
    app.router.add_post(path, handle)
    try:
        async with serve(app, handler_cancellation=handler_cancellation) as url:
            yield url
    finally:
        await upstream.close()
