"""Per-worker event stream: sequence tracking, restart detection, replay, delivery.

One ``WorkerStream`` per worker (publisher); seq state per dp rank (each rank has its own
publisher and seq space, ENGINES.md §1.2). Seq starts at 0 per *process*, so a seq alone
cannot tell a restarted publisher from the old one when the new process's first messages
were lost (slow joiner on reconnect). Each rank therefore also keeps an xxh3-64 digest of
the raw payload of the messages it applied: the engines replay the very bytes they
published (ENGINES.md §1.6), so "same seq, same digest" means "same process".

Rules for a live message with seq ``s`` (``L`` = last applied seq of its rank):

* first message of a rank with ``s > first_seq``: the slow-joiner window lost the start,
  so replay from ``first_seq`` when a replay endpoint is known;
* ``s`` below the last *live* seq: restart (seq restarts at 0): clear the rank, count it,
  start over as a fresh join (replay from ``first_seq`` when possible);
* ``s <= L``: a duplicate if its digest equals the one stored for ``s`` (or none is
  stored, e.g. an older seq applied by a replay), else a restart as above;
* ``s > L + 1`` (gap): with a replay endpoint, replay from ``L`` and check that the
  replayed ``L`` has the stored digest: equal -> apply what follows; different -> restart;
  ``L`` no longer buffered -> apply what is there and clear (the hole stays, "partial");
  without a replay endpoint, clear the rank;
* ``s == L + 1``: a continuation. Without a replay endpoint a restart whose first
  ``L + 1`` messages were all lost looks exactly like this and cannot be detected here
  (an unknown parent in the index then asks for a resync, see ``request_resync``).

After the socket reconnected (``mark_reconnected``: the publisher went away and came
back) every rank is verified before anything else is trusted: replay from ``L`` and
compare the digest of ``L``: equal -> same process, apply the missed messages; different,
or ``L`` not in the buffer -> restart: clear, count, replay the new process from
``first_seq``. Verification runs right away (a task) and, if that did not happen yet or
timed out, before the rank's next live message.

``request_resync`` (the index met a store with an unknown parent) clears a rank and
replays it from ``first_seq``; it is scheduled, never run inline, and rate-limited.

All processing of one stream (live messages, replays, verification, resyncs) is
serialised by one lock; live messages arriving meanwhile wait in the SUB socket's queue.
A replay reply is collected first and delivered in one synchronous step, so routing
never sees a half-replayed rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Protocol

import xxhash
import zmq
import zmq.asyncio

from mmroute.kv.events import EventBatch, KVMessage
from mmroute.kv.wire import WireError, decode_replay, replay_request

log = logging.getLogger(__name__)

# kv_replays{outcome}
REPLAY_OK = "ok"
REPLAY_PARTIAL = "partial"  # buffer no longer held the start: a hole remains (cleared)
REPLAY_TIMEOUT = "timeout"
REPLAY_ERROR = "error"
REPLAY_RESTART = "restart"  # the replayed anchor seq had another payload: a new process

# Resync rate limit: at most one in flight per rank; after one ends the next may start
# `backoff` later; the backoff doubles per resync (a flood of unknown parents that a
# replay does not cure must not become a replay storm) and resets after a quiet period.
RESYNC_INTERVAL = 5.0
RESYNC_MAX_INTERVAL = 300.0
# Digests kept for seqs a replay applied ahead of the live stream (bounded memory).
MAX_DIGESTS = 65_536


def payload_digest(payload: bytes) -> int:
    """Identity of one published batch (raw payload frame bytes)."""
    return xxhash.xxh3_64_intdigest(payload)


class EventSink(Protocol):
    """Where decoded batches go (``routing.index.PrefixIndex`` in the router)."""

    def apply(self, worker_id: str, dp_rank: int, batch: EventBatch) -> None: ...

    def clear(self, worker_id: str, dp_rank: int | None) -> None: ...


@dataclass
class StreamStats:
    """Plain counters, readable without prometheus (``/router/workers``, tests)."""

    messages_seen: int = 0  # live messages received (decodable or not)
    messages_applied: int = 0  # live + replayed messages delivered to the sink
    events_seen: int = 0  # events delivered to the sink
    events_skipped: int = 0  # events the decoder skipped
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_outcomes: Counter = field(default_factory=Counter)
    restarts: int = 0
    clears: int = 0  # (worker, rank) invalidations by this stream
    decode_errors: int = 0
    sink_errors: int = 0
    reconnects: int = 0  # socket came back after a disconnect
    verifications: int = 0  # continuity checks by replay after a reconnect
    resyncs: int = 0  # resyncs run (clear + replay from first_seq)
    resyncs_suppressed: int = 0  # requests dropped by the rate limit
    resyncs_unavailable: int = 0  # requests without a replay endpoint (nothing to do)
    last_seq: int | None = None  # last applied seq (any rank)
    last_event_time: float | None = None  # time.monotonic() of the last applied message
    seq_by_rank: dict[int, int] = field(default_factory=dict)


class _RankState:
    __slots__ = ("last_live", "last_applied", "dirty", "digests", "verify",
                 "resync_pending", "resync_next", "resync_backoff", "resync_last_end")

    def __init__(self, resync_interval: float) -> None:
        self.resync_pending = False  # a resync task is scheduled or running
        self.resync_next = 0.0  # monotonic time before which requests are dropped
        self.resync_backoff = resync_interval
        self.resync_last_end: float | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the seq space (restart / clear), keep the resync rate limit."""
        self.last_live: int | None = None  # highest seq received live
        self.last_applied: int | None = None  # highest seq delivered (live or replay)
        self.dirty = False  # something applied since the last clear
        # seq -> payload digest of applied seqs from last_live up to last_applied
        # (always holds last_applied when its digest is known).
        self.digests: dict[int, int] = {}
        self.verify = False  # reconnected: check continuity before trusting more

    def seen_live(self, seq: int) -> None:
        self.last_live = seq
        d = self.digests
        while d:
            first = next(iter(d))  # ascending insertion order
            if first >= seq:
                break
            del d[first]


class WorkerStream:
    """Seq tracking + replay for one worker's publisher; delivers to ``sink``."""

    def __init__(
        self,
        worker_id: str,
        sink: EventSink,
        ctx: zmq.asyncio.Context,
        *,
        replay_endpoint: str | None = None,
        dp_rank: int = 0,
        first_seq: int = 0,
        replay_timeout: float = 5.0,
        replay_deadline: float = 60.0,
        resync_interval: float = RESYNC_INTERVAL,
        metrics: Any = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.sink = sink
        self.ctx = ctx
        self.replay_endpoint = replay_endpoint
        self.dp_rank = dp_rank
        self.first_seq = first_seq
        self.replay_timeout = replay_timeout  # max wait for each reply frame set
        self.replay_deadline = replay_deadline  # max total replay duration
        self.resync_interval = resync_interval
        self.metrics = metrics
        self.stats = StreamStats()
        self._ranks: dict[int, _RankState] = {}
        self._on_change = on_change or (lambda: None)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    # ---- entry points ----------------------------------------------------------------------

    def note_received(self) -> None:
        self.stats.messages_seen += 1

    def note_decode_error(self, err: Exception) -> None:
        self.stats.decode_errors += 1
        if self.metrics is not None:
            self.metrics.kv_decode_errors.labels(self.worker_id).inc()
        n = self.stats.decode_errors
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, ...: a garbage stream must not flood the log
            log.warning("kv[%s]: undecodable message (%d so far): %s", self.worker_id, n, err)
        self._on_change()

    async def on_live(self, msg: KVMessage, digest: int | None = None) -> None:
        """One live message; ``digest`` = ``payload_digest(payload frame)`` (None: unknown,
        then same-seq messages are taken for duplicates)."""
        async with self._lock:
            await self._on_live(msg, digest)

    def mark_reconnected(self) -> None:
        """The socket reconnected: verify every rank's continuity (module docstring)."""
        self.stats.reconnects += 1
        pending = False
        for st in self._ranks.values():
            if st.last_applied is not None:
                st.verify = pending = True
        if pending and self.replay_endpoint:
            self._spawn(self._verify_flagged(), "kv-verify")
        self._on_change()

    def request_resync(self, dp_rank: int | None = None) -> bool:
        """Schedule a resync of ``dp_rank`` (None: every known rank): clear it and replay
        from ``first_seq``. Safe to call from inside ``sink.apply`` (never runs inline).
        Rate-limited per rank; returns whether a resync was scheduled."""
        now = time.monotonic()
        ranks = [dp_rank] if dp_rank is not None else list(self._ranks)
        chosen = []
        for rank in ranks:
            st = self._state(rank)
            if st.resync_pending or now < st.resync_next:
                self.stats.resyncs_suppressed += 1
                continue
            if not self.replay_endpoint:
                # Nothing can refill the rank; counting it makes the problem visible.
                self.stats.resyncs_unavailable += 1
                st.resync_next = now + self.resync_interval
                continue
            st.resync_pending = True
            chosen.append(rank)
        if chosen and not self._spawn(self._resync(chosen), "kv-resync"):
            for rank in chosen:
                self._ranks[rank].resync_pending = False
            chosen = []
        self._on_change()
        return bool(chosen)

    def reset(self) -> None:
        """Forget seq state (e.g. the socket was re-created); the next message is a join."""
        self._ranks.clear()

    async def aclose(self) -> None:
        """Cancel pending verification / resync tasks (the owner stopped receiving)."""
        tasks, self._tasks = self._tasks, set()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- live path -------------------------------------------------------------------------

    async def _on_live(self, msg: KVMessage, digest: int | None) -> None:
        rank = self._rank_of(msg)
        st = self._state(rank)
        seq = msg.seq
        if st.verify:
            st.verify = False
            if self.replay_endpoint and st.last_applied is not None:
                await self._verify(rank, st)
        restart = None
        if st.last_live is not None and seq < st.last_live:
            # seq restarts at 0 with the publisher process (ENGINES.md §1.2).
            restart = f"seq went back {st.last_live} -> {seq}"
        elif st.last_applied is not None and seq <= st.last_applied:
            known = st.digests.get(seq)
            if digest is not None and known is not None and known != digest:
                restart = f"seq {seq} arrived again with another payload"
            else:
                st.seen_live(seq)  # seq >= last_live here
                self._duplicate(msg)
                return
        if restart is not None:
            self._restart(rank, st, restart)
        fresh = st.last_applied is None
        expected = self.first_seq if fresh else st.last_applied + 1
        if seq > expected:
            if not fresh:
                self.stats.gaps += 1
                if self.metrics is not None:
                    self.metrics.kv_seq_gaps.labels(self.worker_id).inc()
                log.info("kv[%s] rank %d: seq gap %d -> %d", self.worker_id, rank, expected - 1, seq)
            if self.replay_endpoint:
                anchor = None if fresh else st.digests.get(st.last_applied)
                if anchor is None:
                    await self._replay(rank, st, expected)
                else:
                    # Replay from L itself: its digest tells a restart from a plain gap.
                    last = st.last_applied
                    if await self._replay(rank, st, last, anchor=anchor) == REPLAY_RESTART:
                        self._restart(rank, st, f"replayed seq {last} has another payload")
                        await self._replay(rank, st, self.first_seq)
                if st.last_applied is not None and seq <= st.last_applied:
                    st.seen_live(seq)
                    self._duplicate(msg)
                    return
            expected = self.first_seq if st.last_applied is None else st.last_applied + 1
            if seq > expected:
                # Lost messages nobody can give back: what we hold for this rank is stale.
                # (No-op when nothing was applied yet, e.g. a join without replay.)
                self._invalidate(rank, st)
        self._deliver(rank, st, msg, digest)
        st.seen_live(seq)

    async def _verify(self, rank: int, st: _RankState) -> str:
        """After a reconnect: is the publisher still the process we applied ``L`` from?"""
        last = st.last_applied
        assert last is not None
        self.stats.verifications += 1
        anchor = st.digests.get(last)
        if anchor is None:  # no digest known (caller gave none): catch up, can't verify
            return await self._replay(rank, st, last + 1)
        outcome = await self._replay(rank, st, last, anchor=anchor, strict=True)
        if outcome == REPLAY_RESTART:
            self._restart(rank, st, f"after reconnect, seq {last} is not the one applied")
            outcome = await self._replay(rank, st, self.first_seq)
        return outcome

    async def _verify_flagged(self) -> None:
        async with self._lock:
            for rank, st in list(self._ranks.items()):
                if not st.verify:
                    continue  # a live message got there first
                st.verify = False
                if st.last_applied is None:
                    continue
                if await self._verify(rank, st) in (REPLAY_TIMEOUT, REPLAY_ERROR):
                    st.verify = True  # endpoint not back yet: retry before the next message

    async def _resync(self, ranks: list[int]) -> None:
        async with self._lock:
            for rank in ranks:
                st = self._state(rank)
                start = time.monotonic()
                if st.resync_last_end is not None and start - st.resync_last_end > 4 * st.resync_backoff:
                    st.resync_backoff = self.resync_interval  # quiet for long: back to normal
                try:
                    self.stats.resyncs += 1
                    log.info("kv[%s] rank %d: resync (clear + replay from %d)", self.worker_id, rank, self.first_seq)
                    await self._replay(rank, st, self.first_seq, reset=True)
                finally:
                    end = time.monotonic()
                    st.resync_pending = False
                    st.resync_last_end = end
                    st.resync_next = end + st.resync_backoff
                    st.resync_backoff = min(2 * st.resync_backoff, RESYNC_MAX_INTERVAL)
                    self._on_change()

    # ---- internals -------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> bool:
        try:
            task = asyncio.get_running_loop().create_task(coro, name=f"{name}:{self.worker_id}")
        except RuntimeError:  # no running loop (called from outside asyncio)
            coro.close()
            log.warning("kv[%s]: %s requested outside the event loop; ignored", self.worker_id, name)
            return False
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return True

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("kv[%s]: %s failed", self.worker_id, task.get_name(), exc_info=task.exception())

    def _state(self, rank: int) -> _RankState:
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = _RankState(self.resync_interval)
        return st

    def _rank_of(self, msg: KVMessage) -> int:
        r = msg.batch.dp_rank
        return self.dp_rank if r is None else r

    def _restart(self, rank: int, st: _RankState, why: str) -> None:
        log.warning("kv[%s] rank %d: publisher restarted (%s)", self.worker_id, rank, why)
        self.stats.restarts += 1
        if self.metrics is not None:
            self.metrics.kv_restarts.labels(self.worker_id).inc()
        self._invalidate(rank, st, force=True)
        st.reset()

    def _duplicate(self, msg: KVMessage) -> None:
        self.stats.duplicates += 1
        if self.metrics is not None and msg.batch.events:
            self._count_events(msg.batch, "skipped")
        self._on_change()

    def _invalidate(self, rank: int, st: _RankState, force: bool = False) -> None:
        if not (st.dirty or force):
            return
        st.dirty = False
        self.stats.clears += 1
        try:
            self.sink.clear(self.worker_id, rank)
        except Exception:
            log.exception("kv[%s]: sink.clear failed", self.worker_id)
        self._on_change()

    def _deliver(self, rank: int, st: _RankState, msg: KVMessage, digest: int | None) -> None:
        batch = msg.batch
        status = "applied"
        # Recorded before apply: the sink may call request_resync (which only schedules).
        st.last_applied = msg.seq
        if digest is not None:
            if len(st.digests) >= MAX_DIGESTS:
                del st.digests[next(iter(st.digests))]
            st.digests[msg.seq] = digest
        try:
            self.sink.apply(self.worker_id, rank, batch)
        except Exception:
            # A half-applied batch leaves the index inconsistent for this rank.
            log.exception("kv[%s]: sink.apply failed for seq %d", self.worker_id, msg.seq)
            self.stats.sink_errors += 1
            status = "error"
            st.dirty = True
            self._invalidate(rank, st)
        else:
            st.dirty = True
        s = self.stats
        s.messages_applied += 1
        s.events_seen += len(batch.events)
        s.events_skipped += batch.skipped
        s.last_seq = msg.seq
        s.seq_by_rank[rank] = msg.seq
        s.last_event_time = time.monotonic()
        if self.metrics is not None:
            self._count_events(batch, status)
            if batch.skipped:
                self.metrics.kv_events.labels(self.worker_id, "unknown", "skipped").inc(batch.skipped)
        self._on_change()

    def _count_events(self, batch: EventBatch, status: str) -> None:
        by_type = Counter(type(e).__name__ for e in batch.events)
        for typ, n in by_type.items():
            self.metrics.kv_events.labels(self.worker_id, typ, status).inc(n)

    def _count_replay(self, outcome: str) -> None:
        self.stats.replay_outcomes[outcome] += 1
        if self.metrics is not None:
            self.metrics.kv_replays.labels(self.worker_id, outcome).inc()
        self._on_change()

    async def _replay(self, rank: int, st: _RankState, start: int, *,
                      anchor: int | None = None, strict: bool = False, reset: bool = False) -> str:
        """Ask the replay ROUTER for every batch from ``start`` and deliver them in order.

        ``anchor``: the digest already applied for seq ``start``; the replayed ``start``
        must match it, else nothing is delivered and ``REPLAY_RESTART`` is returned. When
        ``start`` is no longer buffered: ``strict`` -> ``REPLAY_RESTART`` too (after a
        reconnect, a missing seq means another process), otherwise apply what follows
        (partial, cleared). ``reset``: clear the rank and forget its seq state right
        before delivering (a resync), unless nothing at all came back.

        The reply is collected first and delivered in one synchronous step: routing never
        sees a half-replayed index (a replay from 0 passes through old states, e.g. blocks
        a later AllBlocksCleared wipes). Live messages arriving meanwhile wait in the SUB
        socket's queue; those the replay covered are dropped as duplicates afterwards.
        """
        outcome, msgs = await self._fetch_replay(rank, start, anchor, strict)
        if outcome == REPLAY_RESTART:
            self._count_replay(outcome)
            return outcome
        if reset and (msgs or outcome == REPLAY_OK):
            last_live = st.last_live
            self._invalidate(rank, st, force=True)
            st.reset()
            st.last_live = last_live  # same process: its older live seqs are not a restart
        for msg, digest in msgs:
            expected = self.first_seq if st.last_applied is None else st.last_applied + 1
            if msg.seq < expected:
                continue  # already have it
            if msg.seq > expected:
                # The buffer no longer holds `expected` (a start older than the buffer is
                # not an error, ENGINES.md §1.6): the hole stays, so clear.
                if outcome == REPLAY_OK:
                    outcome = REPLAY_PARTIAL
                self._invalidate(rank, st)
            self._deliver(rank, st, msg, digest)
        self._count_replay(outcome)
        return outcome

    async def _fetch_replay(self, rank: int, start: int, anchor: int | None,
                            strict: bool) -> tuple[str, list[tuple[KVMessage, int]]]:
        """The replayed messages of ``rank`` from ``start`` (anchor excluded) and the outcome."""
        self.stats.replays += 1
        # A fresh DEALER per replay: replies of an earlier, timed-out or abandoned replay
        # must not be mistaken for this one's.
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Unbounded receive queue: the ROUTER drops replies beyond the pipe's HWM.
        sock.setsockopt(zmq.RCVHWM, 0)
        outcome = REPLAY_OK
        msgs: list[tuple[KVMessage, int]] = []
        anchored = anchor is None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_deadline
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart(replay_request(start))
            while True:
                wait = min(self.replay_timeout, deadline - loop.time())
                if wait <= 0 or not await sock.poll(int(wait * 1000), zmq.POLLIN):
                    outcome = REPLAY_TIMEOUT
                    log.warning("kv[%s] rank %d: replay from %d timed out", self.worker_id, rank, start)
                    break
                frames = await sock.recv_multipart()
                try:
                    msg = decode_replay(frames)
                except WireError as e:
                    self.note_decode_error(e)
                    continue
                if msg is None:  # end marker
                    if not anchored and strict:
                        outcome = REPLAY_RESTART  # the buffer ends before `start`
                    break
                if self._rank_of(msg) != rank:
                    continue
                digest = payload_digest(frames[-1])
                if not anchored:
                    if msg.seq < start:
                        continue
                    if msg.seq == start:
                        if digest != anchor:
                            outcome = REPLAY_RESTART
                            break
                        anchored = True
                        continue  # already applied
                    if strict:
                        outcome = REPLAY_RESTART
                        break
                    anchored = True  # `start` no longer buffered: partial, when applied
                msgs.append((msg, digest))
        except asyncio.CancelledError:
            raise
        except Exception:
            outcome = REPLAY_ERROR
            log.exception("kv[%s] rank %d: replay from %d failed", self.worker_id, rank, start)
        finally:
            sock.close(linger=0)
        return outcome, msgs
