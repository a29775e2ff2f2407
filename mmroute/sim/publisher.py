"""ZMQ PUB + replay ROUTER publishing the simulated engine's KV events.

Mirrors ``ZmqEventPublisher`` (vLLM ``vllm/distributed/kv_events.py``, SGLang
``disaggregation/kv_events.py``; ENGINES.md §1.2, §1.6):

* PUB **binds** when the endpoint has ``*`` or ``::`` or is ``ipc://``/``inproc://``,
  otherwise it **connects** (the subscriber binds). Sim extension: a tcp endpoint with
  port 0 binds an ephemeral port (``bound_endpoint`` reports the real one).
* Live messages: ``[topic, seq u64be, payload]``, seq from 0 per process, +1 per batch.
* The replay ROUTER always binds; a request ``[identity, b"", start u64be]`` gets every
  buffered batch with ``seq >= start`` then the end marker; anything else gets no reply.
  Layout by emulated version: ``"topic"`` (vLLM >= 0.26, SGLang) ``[b"", topic, seq,
  payload]`` / end ``[b"", b"", ff*8, b""]``; ``"plain"`` (vLLM <= 0.25) ``[b"", seq,
  payload]`` / end ``[b"", ff*8, b""]``.

A daemon thread owns both sockets; ``publish`` only enqueues (never blocks the event
loop). Batches are encoded on the caller's side so the engine's clock decides ``ts``.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from collections import deque
from dataclasses import dataclass

import zmq

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_LAYOUTS = ("topic", "plain")


def should_bind(endpoint: str) -> bool:
    """vLLM/SGLang's heuristic, plus: a tcp endpoint with port 0 (ephemeral) binds."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    return bool(re.match(r"^tcp://.*:0$", endpoint))


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    # libzmq spells the ephemeral port "*"; accept the conventional ":0" too.
    ep = re.sub(r":0$", ":*", endpoint) if endpoint.startswith("tcp://") else endpoint
    sock.bind(ep)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


@dataclass(frozen=True)
class PublisherConfig:
    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    topic: str = ""
    replay_layout: str = "topic"
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    force_bind: bool = False  # bind even where vLLM's rule would connect


class EventPublisher:
    """Start with ``start()``; ``publish(payload)`` from any thread; ``close()``."""

    def __init__(self, config: PublisherConfig, ctx: zmq.Context | None = None):
        if config.replay_layout not in REPLAY_LAYOUTS:
            raise ValueError(f"unknown replay layout {config.replay_layout!r}")
        self.config = config
        self._ctx = ctx or zmq.Context.instance()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self.bound_endpoint: str | None = None  # PUB's real endpoint when it binds
        self.replay_bound_endpoint: str | None = None
        self.published = 0
        # Fault injection (tests, chaos drills): batches still buffered for replay but
        # never sent live, as a subscriber sees an HWM overflow or a network blip.
        self.drop_live = 0

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="sim-kv-publisher", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("KV event publisher did not start")
        if self._error is not None:
            raise RuntimeError(f"KV event publisher failed to start: {self._error}") from self._error

    def publish(self, payload: bytes) -> None:
        """Enqueue one encoded batch (blocks only if ``max_queue_size`` is reached)."""
        if self._stop.is_set():
            raise RuntimeError("publisher is closed")
        self._queue.put(payload)

    def close(self, timeout: float = 2.0) -> None:
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def last_seq(self) -> int | None:
        """Seq of the last batch handed to the socket (None before the first)."""
        return self._seq - 1 if self._seq else None

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every enqueued batch went out (tests, shutdown)."""
        done = threading.Event()

        def waiter() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        return done.wait(timeout)

    # --- thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        pub = replay = None
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            if self.config.force_bind or should_bind(self.config.endpoint):
                self.bound_endpoint = _bind(pub, self.config.endpoint)
            else:
                pub.connect(self.config.endpoint)
            if self.config.replay_endpoint:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                # vLLM 0.33: SNDHWM = 2 * (buffer_steps + 1) so a full replay is not dropped.
                replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
                self.replay_bound_endpoint = _bind(replay, self.config.replay_endpoint)
        except BaseException as exc:  # reported by start()
            self._error = exc
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                if replay is not None and poller.poll(0):
                    self._serve_replay(replay)
                try:
                    payload = self._queue.get(timeout=0.02)
                except queue.Empty:
                    if self._stop.is_set():
                        break
                    continue
                try:
                    if payload is None:
                        break
                    seq = self._seq
                    self._seq += 1
                    if self.drop_live > 0:
                        self.drop_live -= 1
                    else:
                        pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    self.published += 1
                finally:
                    self._queue.task_done()
        except Exception:  # never take the server down with the publisher
            log.exception("KV event publisher thread failed")
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    def _serve_replay(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("Invalid replay request: %d frames", len(frames))
            return
        ident, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        topic_layout = self.config.replay_layout == "topic"
        for seq, payload in list(self._buffer):
            if seq >= start:
                seq_b = seq.to_bytes(8, "big")
                if topic_layout:
                    sock.send_multipart((ident, b"", self._topic, seq_b, payload))
                else:
                    sock.send_multipart((ident, b"", seq_b, payload))
        if topic_layout:
            sock.send_multipart((ident, b"", b"", END_SEQ, b""))
        else:
            sock.send_multipart((ident, b"", END_SEQ, b""))
