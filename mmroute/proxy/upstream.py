"""Per-worker pooled HTTP clients (keep-alive connections to each worker).

One ``ClientSession`` (and connector) per worker so one slow or saturated worker never
starves the pool of another. Timeouts: ``connect_timeout`` bounds the TCP connect (a
connect failure is retryable on another worker); ``request_timeout`` is the longest
*silence* allowed while waiting for the worker's answer or between streamed chunks, so
long generations that keep streaming are never cut.
"""

from __future__ import annotations

import aiohttp

from mmroute.workers.registry import Worker


class Upstream:
    def __init__(self, connect_timeout: float = 5.0, request_timeout: float = 600.0, limit_per_worker: int = 1024) -> None:
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.limit_per_worker = limit_per_worker
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout, sock_read=request_timeout
        )

    def session(self, worker: Worker) -> aiohttp.ClientSession:
        """The pooled session for a worker (created on first use, inside the event loop)."""
        s = self._sessions.get(worker.url)
        if s is None or s.closed:
            s = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limit_per_worker, limit_per_host=0, keepalive_timeout=30.0),
                timeout=self.timeout,
                skip_auto_headers=("Accept-Encoding",),  # ask for identity: bytes pass through as sent
                trust_env=False,
            )
            self._sessions[worker.url] = s
        return s

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            await s.close()
