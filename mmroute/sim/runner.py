"""Admission, latency and token generation on top of a simulated engine.

The engine is synchronous and owned by the event loop; this module adds what a real
server has around it: a bounded number of running requests (``--max-concurrency``),
a waiting queue (requests whose whole lifetime does not fit in the free KV blocks
wait, as vLLM's scheduler keeps them waiting), a latency model (``prefill_ms`` per
uncached prompt token, ``decode_ms`` per output token) and deterministic filler output.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, AsyncIterator, Protocol, Sequence


class Engine(Protocol):
    running: dict[str, Any]

    def try_prefill(self, seq: Any, max_new_tokens: int) -> int | None: ...

    def append_token(self, seq: Any, token_id: int, *, compute: bool) -> None: ...

    def finish(self, seq: Any) -> None: ...


class Runner:
    def __init__(
        self,
        engine: Engine,
        filler: Sequence[tuple[int, str]],
        *,
        max_concurrency: int = 64,
        prefill_ms_per_token: float = 0.0,
        decode_ms_per_token: float = 0.0,
    ):
        if not filler:
            raise ValueError("filler output needs at least one token")
        self.engine = engine
        self.filler = list(filler)
        self.max_concurrency = max_concurrency
        self.prefill_s = prefill_ms_per_token / 1000.0
        self.decode_s = decode_ms_per_token / 1000.0
        self._prefill_lock = asyncio.Lock()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.waiting = 0
        self.finished_requests = 0

    @property
    def running(self) -> int:
        return len(self.engine.running)

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    async def admit(self, seq: Any, max_new_tokens: int) -> int:
        """Wait for a slot and room in the KV cache; run the prefill; return cached tokens.
        Raises the engine's CapacityError when the request can never fit."""
        self.waiting += 1
        try:
            while True:
                if self.running < self.max_concurrency:
                    cached = self.engine.try_prefill(seq, max_new_tokens)
                    if cached is not None:
                        return cached
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append(fut)
                await fut
        finally:
            self.waiting -= 1

    def release(self, seq: Any) -> None:
        """Free the request's blocks (finish or abort) and let waiters retry."""
        self.engine.finish(seq)
        self.finished_requests += 1
        self._wake()

    async def generate(self, seq: Any, num_prompt: int, cached: int, max_new_tokens: int) -> AsyncIterator[tuple[int, str]]:
        """Yield ``max_new_tokens`` (token id, text) pairs after the prefill latency.
        The caller must ``release(seq)`` afterwards (also when it stops early)."""
        if self.prefill_s:
            # One prefill at a time: a GPU's prefill throughput (tokens/s) is shared by the
            # requests waiting for it, so the time to first token grows with the uncached
            # tokens queued ahead -- the quantity a KV-aware router trades against hits.
            async with self._prefill_lock:
                await asyncio.sleep(self.prefill_s * max(num_prompt - cached, 0))
        n = len(self.filler)
        for i in range(max_new_tokens):
            if i:
                await asyncio.sleep(self.decode_s)
            tok, text = self.filler[i % n]
            # The token continues the request unless it is the last one (never computed).
            self.engine.append_token(seq, tok, compute=i < max_new_tokens - 1)
            yield tok, text
