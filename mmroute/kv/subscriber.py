"""ZMQ consumers of KV events: ``KVSubscriber`` (connect to one worker's PUB) and
``KVCollector`` (bind one SUB that workers' publishers connect to, ENGINES.md §1.2).

Both run as an asyncio task on ``zmq.asyncio`` sockets (never block the loop), hand every
message to a ``WorkerStream`` (seq tracking, restart detection, replay, delivery:
``kv.stream``) and never die on bad input: decode errors are counted, unexpected
exceptions logged, the loop goes on.

One task reads both the data socket and its connection monitor, and drains the monitor
before each data message: a reconnect (DISCONNECTED, then CONNECTED/ACCEPTED) is always
seen before the first message that came over the new connection, so the stream can
verify continuity before trusting that message (``WorkerStream.mark_reconnected``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mmroute.kv.stream import RESYNC_INTERVAL, EventSink, StreamStats, WorkerStream, payload_digest
from mmroute.kv.wire import WireError, decode_message

__all__ = ["EventSink", "KVCollector", "KVSubscriber", "StreamStats"]

log = logging.getLogger(__name__)

# Match the engines' publisher HWM (vLLM/SGLang default 100000): ZMQ drops silently beyond.
DEFAULT_RCVHWM = 100_000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5_000

_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_UP = (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED)
# Data messages handled per wake-up before yielding to other tasks.
_BATCH = 256

T = TypeVar("T")


def _as_bytes(topic: str | bytes) -> bytes:
    return topic.encode() if isinstance(topic, str) else bytes(topic)


class _ZmqConsumer:
    """Socket lifecycle, the receive loop, connection monitor and change notification."""

    def __init__(self, ctx: zmq.asyncio.Context | None, rcvhwm: int) -> None:
        # Default: the process-wide asyncio context (one IO thread for all subscribers).
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context.instance()
        self._rcvhwm = rcvhwm
        self._sock: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()
        self.peers = 0  # live TCP connections (monitor)
        self.loop_errors = 0
        self._lost_peer = False  # a DISCONNECTED since the last reconnect notice

    # ---- public ----------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.peers > 0

    @property
    def running(self) -> bool:
        return any(not t.done() for t in self._tasks)

    def start(self) -> None:
        """Create the socket and start the receive task (call inside a running loop)."""
        if self._tasks:
            raise RuntimeError(f"{self!r} already started")
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        # Notice a dead peer (half-open TCP) instead of waiting forever.
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
        # Monitor before connect/bind, or the first CONNECTED/ACCEPTED event is missed.
        mon = sock.get_monitor_socket(_MONITOR_EVENTS)
        try:
            self._setup(sock)
        except (zmq.ZMQError, ValueError) as e:
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close(linger=0)
            raise ValueError(f"{self!r}: {e}") from None
        self._sock, self._mon = sock, mon
        task = asyncio.get_running_loop().create_task(self._run(), name=f"{self!r}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    async def stop(self) -> None:
        """Cancel the tasks and close every socket; idempotent."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for stream in self._streams():
            await stream.aclose()
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            if self._mon is not None:
                self._mon.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._mon = None
        self.peers = 0
        self._lost_peer = False
        self._notify()

    async def wait_for(self: T, predicate: Callable[[T], bool], timeout: float = 10.0) -> bool:
        """Wait until ``predicate(self)`` holds; re-checked on every processed message and
        connection change (no polling). Returns False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            ev = self._changed  # type: ignore[attr-defined]
            try:
                await asyncio.wait_for(ev.wait(), remaining)
            except asyncio.TimeoutError:
                return predicate(self)
        return True

    # ---- subclass hooks --------------------------------------------------------------------

    def _setup(self, sock: zmq.asyncio.Socket) -> None:
        raise NotImplementedError

    async def _handle(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def _streams(self) -> list[WorkerStream]:
        raise NotImplementedError

    def _on_reconnect(self) -> None:
        """A peer came back after a disconnect: every stream verifies continuity."""
        for stream in self._streams():
            stream.mark_reconnected()

    # ---- internals -------------------------------------------------------------------------

    @staticmethod
    async def _deliver(stream: WorkerStream, frames: list[bytes]) -> None:
        """Decode one live message for ``stream`` (an undecodable one is only counted)."""
        stream.note_received()
        try:
            msg = decode_message(frames)
        except WireError as e:
            stream.note_decode_error(e)
            return
        await stream.on_live(msg, payload_digest(frames[2]))

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%r: task ended with an exception", self, exc_info=task.exception())

    async def _run(self) -> None:
        sock, mon = self._sock, self._mon
        assert sock is not None and mon is not None
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        failures = 0
        while True:
            try:
                await poller.poll()
                for _ in range(_BATCH):
                    self._drain_monitor(mon)
                    try:
                        frames = await sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    failures = 0
                    await self._handle_safely(frames)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    log.warning("%r: socket closed (%s); receive loop ends", self, e)
                    return
                failures += 1
                self.loop_errors += 1
                log.exception("%r: receive failed", self)
                # Back off only on repeated socket errors, so the loop can't spin hot.
                await asyncio.sleep(min(0.01 * 2**failures, 1.0))
            # Let other tasks run between batches (NOBLOCK receives never yield).
            await asyncio.sleep(0)

    async def _handle_safely(self, frames: list[bytes]) -> None:
        try:
            await self._handle(frames)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.loop_errors += 1
            log.exception("%r: unexpected error while handling a message", self)
            self._notify()

    def _drain_monitor(self, mon: zmq.asyncio.Socket) -> None:
        """Process every queued connection event (non-blocking)."""
        while True:
            fut = mon.recv_multipart(zmq.NOBLOCK)  # already resolved: no await needed
            try:
                ev = parse_monitor_message(fut.result())
            except zmq.Again:
                return
            except zmq.ZMQError:
                raise
            except Exception:
                log.exception("%r: bad monitor message", self)
                continue
            kind = ev["event"]
            if kind in _UP:
                self.peers += 1
                if self._lost_peer:
                    self._lost_peer = False
                    log.info("%r: reconnected; verifying event continuity", self)
                    self._on_reconnect()
            elif kind == zmq.EVENT_DISCONNECTED:
                self.peers = max(0, self.peers - 1)
                self._lost_peer = True
            self._notify()


class KVSubscriber(_ZmqConsumer):
    """SUB connected to one worker's KV-event PUB (reconnecting), plus replay over DEALER.

    ``dp_rank`` is the rank assumed for batches that don't carry one (old SGLang).
    ``first_seq``: the seq a publisher starts at (0 for vLLM and SGLang); a first message
    above it triggers a replay from it when ``replay_endpoint`` is set.
    """

    def __init__(
        self,
        worker_id: str,
        endpoint: str,
        sink: EventSink,
        *,
        replay_endpoint: str | None = None,
        dp_rank: int = 0,
        topic: str | bytes = b"",
        metrics: Any = None,
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout: float = 5.0,
        first_seq: int = 0,
        rcvhwm: int = DEFAULT_RCVHWM,
        resync_interval: float = RESYNC_INTERVAL,
    ) -> None:
        super().__init__(ctx, rcvhwm)
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = _as_bytes(topic)
        self.stream = WorkerStream(
            worker_id, sink, self._ctx,
            replay_endpoint=replay_endpoint, dp_rank=dp_rank, first_seq=first_seq,
            replay_timeout=replay_timeout, resync_interval=resync_interval,
            metrics=metrics, on_change=self._notify,
        )

    def __repr__(self) -> str:
        return f"KVSubscriber({self.worker_id!r}, {self.endpoint!r})"

    def _streams(self) -> list[WorkerStream]:
        return [self.stream]

    def request_resync(self, dp_rank: int | None = None) -> bool:
        """Clear ``dp_rank`` (None: every rank seen) and replay it from the start, e.g. when
        the index met a store with an unknown parent. Scheduled, never inline (safe from
        inside ``sink.apply``); rate-limited per rank; without a replay endpoint it is only
        counted. Returns whether a resync was scheduled."""
        if not self.running:
            return False
        return self.stream.request_resync(dp_rank)

    def _setup(self, sock: zmq.asyncio.Socket) -> None:
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)  # prefix match; b"" = every topic
        sock.connect(self.endpoint)

    async def _handle(self, frames: list[bytes]) -> None:
        await self._deliver(self.stream, frames)

    # ---- plain stats -----------------------------------------------------------------------

    @property
    def stats(self) -> StreamStats:
        return self.stream.stats

    @property
    def ready(self) -> bool:
        """Connected and at least one message applied: the index reflects this worker."""
        return self.connected and self.stats.messages_applied > 0

    last_seq = property(lambda self: self.stats.last_seq)
    events_seen = property(lambda self: self.stats.events_seen)
    messages_seen = property(lambda self: self.stats.messages_seen)
    messages_applied = property(lambda self: self.stats.messages_applied)
    last_event_time = property(lambda self: self.stats.last_event_time)
    gaps = property(lambda self: self.stats.gaps)
    replays = property(lambda self: self.stats.replays)
    restarts = property(lambda self: self.stats.restarts)
    decode_errors = property(lambda self: self.stats.decode_errors)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready state for ``/router/workers``."""
        s = self.stats
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "connected": self.connected,
            "ready": self.ready,
            "last_seq": s.last_seq,
            "seq_by_rank": {str(k): v for k, v in s.seq_by_rank.items()},
            "messages_seen": s.messages_seen,
            "messages_applied": s.messages_applied,
            "events_seen": s.events_seen,
            "events_skipped": s.events_skipped,
            "duplicates": s.duplicates,
            "gaps": s.gaps,
            "replays": dict(s.replay_outcomes),
            "restarts": s.restarts,
            "clears": s.clears,
            "reconnects": s.reconnects,
            "verifications": s.verifications,
            "resyncs": s.resyncs,
            "resyncs_suppressed": s.resyncs_suppressed,
            "resyncs_unavailable": s.resyncs_unavailable,
            "decode_errors": s.decode_errors,
            "last_event_time": s.last_event_time,
        }


class KVCollector(_ZmqConsumer):
    """Collector mode (``--kv-events-bind``): one SUB *binds*, publishers connect to it.

    ``topics`` maps a message topic to its worker id (exact match); messages on other
    topics are counted in ``unknown_topics`` and dropped. Seq tracking is per topic;
    replay only for topics with an entry in ``replay_endpoints``.
    """

    def __init__(
        self,
        bind: str,
        sink: EventSink,
        topics: Mapping[str | bytes, str],
        *,
        replay_endpoints: Mapping[str | bytes, str] | None = None,
        metrics: Any = None,
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout: float = 5.0,
        first_seq: int = 0,
        rcvhwm: int = DEFAULT_RCVHWM,
        resync_interval: float = RESYNC_INTERVAL,
    ) -> None:
        super().__init__(ctx, rcvhwm)
        self.bind = bind
        self.endpoint: str | None = None  # resolved after start() (e.g. tcp://127.0.0.1:*)
        self.metrics = metrics
        replay = {_as_bytes(k): v for k, v in (replay_endpoints or {}).items()}
        self.streams: dict[bytes, WorkerStream] = {
            _as_bytes(topic): WorkerStream(
                worker, sink, self._ctx,
                replay_endpoint=replay.get(_as_bytes(topic)), first_seq=first_seq,
                replay_timeout=replay_timeout, resync_interval=resync_interval,
                metrics=metrics, on_change=self._notify,
            )
            for topic, worker in topics.items()
        }
        self.messages_seen = 0
        self.unknown_topics = 0
        self.decode_errors = 0  # messages without a usable topic frame

    def __repr__(self) -> str:
        return f"KVCollector({self.bind!r})"

    def _setup(self, sock: zmq.asyncio.Socket) -> None:
        # Subscribe to everything so unknown topics can be counted, not silently filtered.
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.bind(self.bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _streams(self) -> list[WorkerStream]:
        return list(self.streams.values())

    def request_resync(self, worker_id: str, dp_rank: int | None = None) -> bool:
        """``KVSubscriber.request_resync`` for one worker of the collector."""
        if not self.running:
            return False
        return any([s.request_resync(dp_rank) for s in self.streams.values() if s.worker_id == worker_id])

    def stats_for(self, worker_id: str) -> StreamStats | None:
        for st in self.streams.values():
            if st.worker_id == worker_id:
                return st.stats
        return None

    async def _handle(self, frames: list[bytes]) -> None:
        self.messages_seen += 1
        if not frames:
            self.decode_errors += 1
            self._notify()
            return
        stream = self.streams.get(bytes(frames[0]))
        if stream is None:
            self.unknown_topics += 1
            log.debug("%r: dropped message on unknown topic %r", self, bytes(frames[0])[:64])
            self._notify()
            return
        await self._deliver(stream, frames)

    def snapshot(self) -> dict[str, Any]:
        return {
            "bind": self.bind,
            "endpoint": self.endpoint,
            "peers": self.peers,
            "messages_seen": self.messages_seen,
            "unknown_topics": self.unknown_topics,
            "decode_errors": self.decode_errors,
            "workers": {
                s.worker_id: {
                    "topic": t.decode(errors="replace"),
                    "last_seq": s.stats.last_seq,
                    "messages_applied": s.stats.messages_applied,
                    "gaps": s.stats.gaps,
                    "restarts": s.stats.restarts,
                    "decode_errors": s.stats.decode_errors,
                }
                for t, s in self.streams.items()
            },
        }
