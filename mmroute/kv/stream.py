"""Per-worker event stream: sequence tracking, replay, delivery to the sink.

One ``WorkerStream`` per worker (publisher); seq state per dp rank (each rank has its own
publisher and seq space, ENGINES.md §1.2). Rules (ENGINES.md §1.2, §1.6):

* first message of a rank with ``seq > first_seq``: the slow-joiner window lost the
  start, so replay from ``first_seq`` when a replay endpoint is known;
* gap (``seq > last + 1``): replay from ``last + 1``; without a replay endpoint, or when
  the replay cannot fill the hole, clear that (worker, rank) -- the index cannot be trusted;
* seq below the last *live* seq: the publisher restarted (seq restarts at 0): clear the
  rank and start over as if freshly joined;
* seq equal to the last live seq, or already applied by a replay: duplicate, ignored.

Live and replayed messages are told apart: after a replay, live messages that were
queued meanwhile carry seqs the replay already applied; they are higher than the last
*live* seq, so they are duplicates, not a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

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
    last_seq: int | None = None  # last applied seq (any rank)
    last_event_time: float | None = None  # time.monotonic() of the last applied message
    seq_by_rank: dict[int, int] = field(default_factory=dict)


class _RankState:
    __slots__ = ("last_live", "last_applied", "dirty")

    def __init__(self) -> None:
        self.last_live: int | None = None  # highest seq received live
        self.last_applied: int | None = None  # highest seq delivered (live or replay)
        self.dirty = False  # something applied since the last clear


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
        self.metrics = metrics
        self.stats = StreamStats()
        self._ranks: dict[int, _RankState] = {}
        self._on_change = on_change or (lambda: None)

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

    async def on_live(self, msg: KVMessage) -> None:
        rank = self._rank_of(msg)
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = _RankState()
        seq = msg.seq
        if st.last_live is not None:
            if seq == st.last_live:
                self._duplicate(msg)
                return
            if seq < st.last_live:
                # seq restarts at 0 with the publisher process (ENGINES.md §1.2).
                log.warning("kv[%s] rank %d: seq went back %d -> %d: restart", self.worker_id, rank, st.last_live, seq)
                self.stats.restarts += 1
                if self.metrics is not None:
                    self.metrics.kv_restarts.labels(self.worker_id).inc()
                self._invalidate(rank, st, force=True)
                st = self._ranks[rank] = _RankState()
        st.last_live = seq
        if st.last_applied is not None and seq <= st.last_applied:
            self._duplicate(msg)  # already delivered by a replay
            return
        fresh = st.last_applied is None
        expected = self.first_seq if fresh else st.last_applied + 1
        if seq > expected:
            if not fresh:
                self.stats.gaps += 1
                if self.metrics is not None:
                    self.metrics.kv_seq_gaps.labels(self.worker_id).inc()
                log.info("kv[%s] rank %d: seq gap %d -> %d", self.worker_id, rank, expected - 1, seq)
            if self.replay_endpoint:
                await self._replay(rank, st, expected)
                if st.last_applied is not None and seq <= st.last_applied:
                    self._duplicate(msg)
                    return
            expected = self.first_seq if st.last_applied is None else st.last_applied + 1
            if seq > expected:
                # Lost messages nobody can give back: what we hold for this rank is stale.
                # (No-op when nothing was applied yet, e.g. a join without replay.)
                self._invalidate(rank, st)
        self._deliver(rank, st, msg)

    def reset(self) -> None:
        """Forget seq state (e.g. the socket was re-created); the next message is a join."""
        self._ranks.clear()

    # ---- internals -------------------------------------------------------------------------

    def _rank_of(self, msg: KVMessage) -> int:
        r = msg.batch.dp_rank
        return self.dp_rank if r is None else r

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

    def _deliver(self, rank: int, st: _RankState, msg: KVMessage) -> None:
        batch = msg.batch
        status = "applied"
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
        st.last_applied = msg.seq
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

    async def _replay(self, rank: int, st: _RankState, start: int) -> None:
        """Ask the replay ROUTER for every batch from ``start`` and deliver them in order.

        Live messages arriving meanwhile wait in the SUB socket's queue (RCVHWM) and are
        processed afterwards; those the replay covered are then dropped as duplicates.
        """
        self.stats.replays += 1
        # A fresh DEALER per replay: replies of an earlier, timed-out replay must not be
        # mistaken for this one's.
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Unbounded receive queue: the ROUTER drops replies beyond the pipe's HWM.
        sock.setsockopt(zmq.RCVHWM, 0)
        outcome = REPLAY_OK
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
                    break
                if self._rank_of(msg) != rank:
                    continue
                expected = self.first_seq if st.last_applied is None else st.last_applied + 1
                if msg.seq < expected:
                    continue  # already have it
                if msg.seq > expected:
                    # The buffer no longer holds `expected` (a start older than the buffer
                    # is not an error, ENGINES.md §1.6): the hole stays, so clear.
                    outcome = REPLAY_PARTIAL
                    self._invalidate(rank, st)
                self._deliver(rank, st, msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            outcome = REPLAY_ERROR
            log.exception("kv[%s] rank %d: replay from %d failed", self.worker_id, rank, start)
        finally:
            sock.close(linger=0)
        self._count_replay(outcome)
