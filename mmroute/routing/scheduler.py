"""Worker choice and load bookkeeping (DESIGN.md "Load and scoring").

``Scheduler.choose`` scores the candidates of one request and returns the winner
plus every candidate's cost breakdown (``/router/explain``). ``Scheduler.book``
records the routed request's load until its first token (prefill share) and its
completion (the rest); stale bookings expire lazily after ``booking_ttl``.

kv cost, in block units:
    w_prefill * (uncached prompt + booked prefill + reported queue beyond our own)
  + w_decode * booked decode tokens
The worker's own waiting-queue gauge is the truth several router replicas share;
requests it reports beyond those we still count as prefilling are priced at the
average prefill size we book.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Sequence

from mmroute.config import POLICIES

_EPS = 1e-9


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    overlap_blocks: int = 0  # leading request blocks the worker holds (index.overlaps)
    indexed_blocks: int = 0  # blocks the worker holds in total (tie-break: emptier wins)
    healthy: bool = True
    queued_reqs_reported: int | None = None  # vllm:num_requests_waiting / sglang:num_queue_reqs


@dataclass(frozen=True)
class RequestSize:
    prompt_tokens: int
    block_size: int
    decode_tokens: int = 0  # expected output (e.g. max_tokens, capped by the caller)


@dataclass(frozen=True)
class Cost:
    """One candidate's score; block units. ``eligible`` False: unhealthy or excluded."""

    worker_id: str
    eligible: bool
    overlap_blocks: int
    uncached_blocks: float
    booked_prefill_blocks: float
    reported_queue_blocks: float
    decode_blocks: float
    in_flight: int
    cost: float
    probability: float | None = None  # softmax share when temperature > 0


@dataclass(frozen=True)
class Decision:
    worker_id: str
    policy: str
    costs: list[Cost]
    reason: str  # "lowest_cost", "tie_indexed", "tie_random", "softmax", "round_robin", ...


class NoEligibleWorker(Exception):
    """Every candidate is unhealthy or excluded."""


@dataclass
class WorkerLoad:
    requests: int = 0
    prefill_requests: int = 0  # bookings whose first token has not come yet
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def is_idle(self) -> bool:
        return not (self.requests or self.prefill_requests or self.prefill_tokens or self.decode_tokens)


@dataclass(eq=False)
class Booking:
    """One routed request's share of a worker's load. ``release_prefill()`` at the
    first token; ``release()`` at completion or disconnect (idempotent, releases the
    prefill share too if still held)."""

    _scheduler: "Scheduler" = field(repr=False)
    id: int
    worker_id: str
    prefill_tokens: int
    decode_tokens: int
    expires_at: float
    prefill_open: bool = True
    open: bool = True
    expired: bool = False

    def release_prefill(self) -> None:
        if self.open and self.prefill_open:
            self._scheduler._release_prefill(self)

    def release(self) -> None:
        if self.open:
            self._scheduler._release(self)


class Scheduler:
    def __init__(
        self,
        policy: str = "kv",
        w_prefill: float = 1.0,
        w_decode: float = 0.1,
        temperature: float = 0.0,
        booking_ttl: float = 600.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_booking_expired: Callable[[str], None] | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if temperature < 0 or booking_ttl <= 0:
            raise ValueError("temperature must be >= 0 and booking_ttl > 0")
        self.policy = policy
        self.w_prefill = w_prefill
        self.w_decode = w_decode
        self.temperature = temperature
        self.booking_ttl = booking_ttl
        self.rng = rng or random.Random()
        self.clock = clock
        self.on_booking_expired = on_booking_expired
        self._loads: dict[str, WorkerLoad] = {}
        self._active: OrderedDict[int, Booking] = OrderedDict()  # creation = expiry order
        self._next_id = 0
        self._rr = 0
        # Average booked prefill tokens per request: prices a reported queue entry.
        self._avg_prefill: float | None = None
        self.expired_total = 0

    # ---------------------------------------------------------------- load
    def load(self, worker_id: str) -> WorkerLoad:
        """Current booked load (a copy) after expiring stale bookings."""
        self.sweep()
        ld = self._loads.get(worker_id)
        return WorkerLoad(**vars(ld)) if ld is not None else WorkerLoad()

    def loads(self) -> dict[str, WorkerLoad]:
        self.sweep()
        return {w: WorkerLoad(**vars(ld)) for w, ld in self._loads.items()}

    @property
    def active_bookings(self) -> int:
        return len(self._active)

    def book(self, worker_id: str, prefill_tokens: int, decode_tokens: int) -> Booking:
        """Book a routed request: ``prefill_tokens`` = its uncached prompt tokens."""
        now = self.clock()
        self._sweep(now)
        prefill_tokens = max(0, int(prefill_tokens))
        decode_tokens = max(0, int(decode_tokens))
        self._next_id += 1
        b = Booking(self, self._next_id, worker_id, prefill_tokens, decode_tokens, now + self.booking_ttl)
        ld = self._loads.setdefault(worker_id, WorkerLoad())
        ld.requests += 1
        ld.prefill_requests += 1
        ld.prefill_tokens += prefill_tokens
        ld.decode_tokens += decode_tokens
        self._active[b.id] = b
        a = self._avg_prefill
        self._avg_prefill = float(prefill_tokens) if a is None else 0.9 * a + 0.1 * prefill_tokens
        return b

    def _release_prefill(self, b: Booking) -> None:
        ld = self._loads[b.worker_id]
        ld.prefill_requests -= 1
        ld.prefill_tokens -= b.prefill_tokens
        b.prefill_open = False

    def _release(self, b: Booking) -> None:
        if b.prefill_open:
            self._release_prefill(b)
        ld = self._loads[b.worker_id]
        ld.requests -= 1
        ld.decode_tokens -= b.decode_tokens
        b.open = False
        self._active.pop(b.id, None)
        if ld.is_idle():
            del self._loads[b.worker_id]

    def sweep(self) -> int:
        return self._sweep(self.clock())

    def _sweep(self, now: float) -> int:
        n = 0
        active = self._active
        while active:
            b = next(iter(active.values()))
            if b.expires_at > now:
                break
            b.expired = True
            self._release(b)
            n += 1
            self.expired_total += 1
            if self.on_booking_expired is not None:
                self.on_booking_expired(b.worker_id)
        return n

    # ---------------------------------------------------------------- scoring
    def costs(self, candidates: Sequence[Candidate], req: RequestSize, exclude: Collection[str] = ()) -> list[Cost]:
        self._sweep(self.clock())
        bs = max(1, req.block_size)
        avg = self._avg_prefill if self._avg_prefill is not None else float(req.prompt_tokens)
        out = []
        for c in candidates:
            ld = self._loads.get(c.worker_id) or WorkerLoad()
            cached = min(req.prompt_tokens, c.overlap_blocks * bs)
            uncached = (req.prompt_tokens - cached) / bs
            booked = ld.prefill_tokens / bs
            extra_reqs = 0
            if c.queued_reqs_reported is not None:
                extra_reqs = max(0, c.queued_reqs_reported - ld.prefill_requests)
            queued = extra_reqs * avg / bs
            decode = ld.decode_tokens / bs
            cost = self.w_prefill * (uncached + booked + queued) + self.w_decode * decode
            out.append(
                Cost(
                    worker_id=c.worker_id,
                    eligible=c.healthy and c.worker_id not in exclude,
                    overlap_blocks=c.overlap_blocks,
                    uncached_blocks=uncached,
                    booked_prefill_blocks=booked,
                    reported_queue_blocks=queued,
                    decode_blocks=decode,
                    in_flight=ld.requests,
                    cost=cost,
                )
            )
        return out

    def choose(
        self, candidates: Sequence[Candidate], req: RequestSize, exclude: Collection[str] = ()
    ) -> Decision:
        """Pick a worker. Unhealthy and ``exclude``d workers are never chosen; raises
        ``NoEligibleWorker`` when none is left."""
        costs = self.costs(candidates, req, exclude)
        elig = [(c, k) for c, k in zip(candidates, costs) if k.eligible]
        if not elig:
            raise NoEligibleWorker("no healthy worker left to route to")
        policy = self.policy
        if policy == "round-robin":
            c, _ = elig[self._rr % len(elig)]
            self._rr += 1
            return Decision(c.worker_id, policy, costs, "round_robin")
        if policy == "random":
            c, _ = self.rng.choice(elig)
            return Decision(c.worker_id, policy, costs, "random")
        if policy == "least-loaded":
            def load_of(item: tuple[Candidate, Cost]) -> tuple[int, float]:
                k = item[1]
                return (k.in_flight, k.booked_prefill_blocks + k.decode_blocks)

            best = min(load_of(e) for e in elig)
            pool = [e for e in elig if load_of(e) == best]
            c, _ = pool[0] if len(pool) == 1 else self.rng.choice(pool)
            return Decision(c.worker_id, policy, costs, "least_loaded" if len(pool) == 1 else "tie_random")
        # kv
        if self.temperature > 0 and len(elig) > 1:
            return self._softmax(elig, costs)
        low = min(k.cost for _, k in elig)
        pool = [e for e in elig if e[1].cost <= low + _EPS]
        reason = "lowest_cost"
        if len(pool) > 1:
            fewest = min(c.indexed_blocks for c, _ in pool)
            pool = [e for e in pool if e[0].indexed_blocks == fewest]
            reason = "tie_indexed"
            if len(pool) > 1:
                reason = "tie_random"
        c, _ = pool[0] if len(pool) == 1 else self.rng.choice(pool)
        return Decision(c.worker_id, policy, costs, reason)

    def _softmax(self, elig: list[tuple[Candidate, Cost]], costs: list[Cost]) -> Decision:
        t = self.temperature
        low = min(k.cost for _, k in elig)
        weights = [math.exp(-(k.cost - low) / t) for _, k in elig]
        total = sum(weights)
        probs = {k.worker_id: w / total for (_, k), w in zip(elig, weights)}
        r = self.rng.random() * total
        chosen = elig[-1][0]
        for (c, _), w in zip(elig, weights):
            r -= w
            if r < 0:
                chosen = c
                break
        costs = [replace(k, probability=probs[k.worker_id]) if k.eligible else k for k in costs]
        return Decision(chosen.worker_id, "kv", costs, "softmax")
