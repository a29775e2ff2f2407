"""KVSubscriber / KVCollector over real ZMQ sockets, fed with the real captures.

The test publishers are XPUB sockets (wire-identical to the engines' PUB) so a test can
wait for the subscription to arrive instead of sleeping through the slow-joiner window;
one test uses a plain PUB and relies on the subscriber's join -> replay-from-0 path.
The replay server is a ROUTER answering ``[identity, b"", start]`` like the engines'.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from mmroute.kv.events import EventBatch
from mmroute.kv.subscriber import KVCollector, KVSubscriber
from mmroute.kv.wire import END_SEQ, decode_message
from mmroute.metrics import Metrics

FIXTURES = Path(__file__).parent / "fixtures" / "kv_events"
TIMEOUT = 10.0


def load_frames(name: str) -> list[list[bytes]]:
    lines = (FIXTURES / name).read_text().splitlines()
    return [[bytes.fromhex(h) for h in json.loads(line)["frames_hex"]] for line in lines]


class Capture:
    """One engine's live messages (by seq) and its replay reply frames (by seq)."""

    def __init__(self, engine: str):
        self.live = {int.from_bytes(f[1], "big"): f for f in load_frames(f"{engine}_events.jsonl")}
        replay = load_frames(f"{engine}_replay.jsonl")
        assert replay[-1][-2] == END_SEQ
        self.end = replay[-1]
        self.replay = {int.from_bytes(f[-2], "big"): f for f in replay[:-1]}
        self.batches = {seq: decode_message([b"", f[-2], f[-1]]).batch for seq, f in self.replay.items()}

    def seq_of(self, batch: EventBatch) -> int:
        (seq,) = [s for s, b in self.batches.items() if b == batch]
        return seq


class RecordingSink:
    def __init__(self, capture: Capture | None = None):
        self.log: list[tuple] = []
        self.capture = capture
        self.fail_next = 0
        self.on_apply = None  # called inside apply, like the index's on_unknown_parent

    def apply(self, worker_id: str, dp_rank: int, batch: EventBatch) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("sink exploded")
        if self.on_apply is not None:
            self.on_apply(batch)
        self.log.append(("apply", worker_id, dp_rank, self.capture.seq_of(batch) if self.capture else batch))

    def clear(self, worker_id: str, dp_rank: int | None) -> None:
        self.log.append(("clear", worker_id, dp_rank))


class Publisher:
    """XPUB (or PUB) bound on an ephemeral port, or connected to a collector."""

    def __init__(self, net: Net, kind: int = zmq.XPUB, connect: str | None = None):
        self.sock = net.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        if connect:
            self.sock.connect(connect)
            self.endpoint = connect
        else:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"

    async def restart(self, net: Net) -> None:
        """Close the socket and bind a new XPUB on the same endpoint (a publisher that went
        away and came back: a new process, or the same one after a network blip)."""
        self.sock.close(linger=0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT
        while True:
            sock = net.socket(zmq.XPUB)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(self.endpoint)
                break
            except zmq.ZMQError as e:  # the old listener is torn down asynchronously
                sock.close(linger=0)
                assert e.errno == zmq.EADDRINUSE and loop.time() < deadline, e
                await asyncio.sleep(0.01)  # retry after an explicit error, not a sync point
        self.sock = sock

    async def wait_subscribed(self) -> bytes:
        msg = await asyncio.wait_for(self.sock.recv(), TIMEOUT)
        assert msg[:1] == b"\x01"
        return msg[1:]

    async def send(self, frames: list[bytes], topic: bytes | None = None) -> None:
        if topic is not None:
            frames = [topic, *frames[1:]]
        await self.sock.send_multipart(frames)


class ReplayServer:
    """ROUTER replay endpoint serving a capture's reply frames for seq in [start, max_seq]."""

    def __init__(self, net: Net, capture: Capture | None, *, silent: bool = False):
        self.sock = net.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.capture = capture
        self.silent = silent
        self.max_seq = -1  # what the "publisher" has published so far
        self.requests: list[int] = []
        self.got_request = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()
        self.task = asyncio.get_running_loop().create_task(self._serve())
        net.tasks.append(self.task)

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            ident, rest = frames[0], frames[1:]
            assert rest[0] == b"" and len(rest) == 2, f"bad replay request {rest!r}"
            start = int.from_bytes(rest[1], "big")
            self.requests.append(start)
            upto = self.max_seq  # snapshot at request time
            self.got_request.set()
            if self.silent:
                continue
            await self.gate.wait()
            for seq in sorted(self.capture.replay):
                if start <= seq <= upto:
                    await self.sock.send_multipart([ident, *self.capture.replay[seq]])
            await self.sock.send_multipart([ident, *self.capture.end])

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)


class Net:
    """A test's own ZMQ context; owns the test-side sockets and tasks, closed at teardown."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sockets: list[zmq.asyncio.Socket] = []
        self.tasks: list[asyncio.Task] = []

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        self.sockets.append(sock)
        return sock

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.destroy(linger=0)


@pytest.fixture
async def net():
    n = Net()
    yield n
    await n.close()


async def publish(pub: Publisher, cap: Capture, server: ReplayServer | None, *seqs: int, topic=None) -> None:
    for s in seqs:
        if server is not None:
            server.max_seq = max(server.max_seq, s)
        await pub.send(cap.live[s] if s in cap.live else [b"", *cap.replay[s][-2:]], topic)


async def started(sub):
    sub.start()
    return sub


async def subscribed(
    net: Net, pub: Publisher, sink: RecordingSink, server: ReplayServer | None = None, **kw
) -> KVSubscriber:
    """A started KVSubscriber "w1" on ``pub`` (replaying from ``server``), once ``pub`` has its subscription."""
    replay = server.endpoint if server is not None else None
    sub = await started(KVSubscriber("w1", pub.endpoint, sink, replay_endpoint=replay, ctx=net.ctx, **kw))
    await pub.wait_subscribed()
    return sub


def applied(sink: RecordingSink, worker="w1", rank=0) -> list[int]:
    return [e[3] for e in sink.log if e[0] == "apply" and e[1] == worker and e[2] == rank]


# ---- tests ---------------------------------------------------------------------------------


async def test_slow_joiner_plain_pub_replays_from_zero(net):
    """A real PUB publishes before the SUB is connected; whatever the join point, the
    sink ends with every batch exactly once, in order (join -> replay from 0)."""
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net, zmq.PUB)
    server = ReplayServer(net, cap)
    sink = RecordingSink(cap)
    sub = await started(KVSubscriber("w1", pub.endpoint, sink, replay_endpoint=server.endpoint, ctx=net.ctx))
    await publish(pub, cap, server, *range(10))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    # Probe: re-publish the newest message until the subscriber has caught up to it.
    while not await sub.wait_for(lambda s: s.last_seq == 9, timeout=0.05):
        assert loop.time() < deadline, sub.snapshot()
        await publish(pub, cap, server, 9)
    assert sink.log == [("apply", "w1", 0, s) for s in range(10)]
    assert sub.events_seen == 34 and sub.messages_applied == 10
    assert sub.decode_errors == 0 and sub.restarts == 0
    await sub.stop()
    await server.close()


async def test_join_after_start_replays_from_zero_sglang(net):
    """SGLang: live starts at seq 1; the startup AllBlocksCleared (seq 0) only comes by replay."""
    cap = Capture("sglang-0.5.23")
    pub = Publisher(net)
    server = ReplayServer(net, cap)
    sink = RecordingSink(cap)
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, server, metrics=metrics)
    await publish(pub, cap, server, 1)
    assert await sub.wait_for(lambda s: s.messages_applied == 2, TIMEOUT), sub.snapshot()
    assert server.requests == [0]
    await publish(pub, cap, server, *range(2, 10))
    assert await sub.wait_for(lambda s: s.last_seq == 9, TIMEOUT), sub.snapshot()
    assert applied(sink) == list(range(10)) and len(sink.log) == 10
    assert sub.stats.replay_outcomes == {"ok": 1}
    assert sub.stats.duplicates == 1 and sub.gaps == 0
    assert await sub.wait_for(lambda s: s.ready, TIMEOUT) and sub.connected
    assert metrics.registry.get_sample_value("mmroute_kv_replays_total", {"worker": "w1", "outcome": "ok"}) == 1
    assert metrics.registry.get_sample_value(
        "mmroute_kv_events_total", {"worker": "w1", "type": "BlockStored", "status": "applied"}) == 8
    assert metrics.registry.get_sample_value(
        "mmroute_kv_events_total", {"worker": "w1", "type": "AllBlocksCleared", "status": "applied"}) == 2
    await sub.stop()
    await server.close()


async def test_gap_replay_three_frame_layout_vllm023(net):
    cap = Capture("vllm-0.23.0")
    assert all(len(f) == 3 for f in cap.replay.values())  # [b"", seq, payload]
    pub = Publisher(net)
    server = ReplayServer(net, cap)
    sink = RecordingSink(cap)
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, server, metrics=metrics)
    await publish(pub, cap, server, 0)
    assert await sub.wait_for(lambda s: s.messages_applied == 1, TIMEOUT)
    server.max_seq = 1  # seq 1 published but lost on the way
    await publish(pub, cap, server, 2, 3)
    assert await sub.wait_for(lambda s: s.messages_seen == 3 and s.last_seq == 3, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, s) for s in range(4)]
    assert server.requests == [0]  # from L: its digest is checked
    assert sub.gaps == 1 and sub.stats.replay_outcomes == {"ok": 1} and sub.stats.clears == 0
    assert metrics.registry.get_sample_value("mmroute_kv_seq_gaps_total", {"worker": "w1"}) == 1
    await sub.stop()
    await server.close()


async def test_live_messages_during_replay_are_buffered_then_applied(net):
    """vLLM 0.33 four-frame replay; live 4, 5 arrive while the replay is held back."""
    cap = Capture("vllm-0.33.0")
    assert all(len(f) == 4 for f in cap.replay.values())  # [b"", topic, seq, payload]
    pub = Publisher(net)
    server = ReplayServer(net, cap)
    sink = RecordingSink(cap)
    sub = await subscribed(net, pub, sink, server)
    await publish(pub, cap, server, 0, 1)
    assert await sub.wait_for(lambda s: s.messages_applied == 2, TIMEOUT)
    server.gate.clear()
    server.max_seq = 2  # seq 2 lost
    await publish(pub, cap, server, 3)
    await asyncio.wait_for(server.got_request.wait(), TIMEOUT)
    assert server.requests == [1]  # from L: its digest is checked
    await publish(pub, cap, server, 4, 5)  # replay snapshot ends at 3: these come live
    server.gate.set()
    assert await sub.wait_for(lambda s: s.messages_seen == 5 and s.stats.duplicates == 1, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, s) for s in range(6)]
    assert sub.stats.duplicates == 1  # live 3, already replayed
    assert sub.stats.replay_outcomes == {"ok": 1}
    await sub.stop()
    await server.close()


async def test_gap_without_replay_endpoint_clears(net):
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    sink = RecordingSink(cap)
    sub = await subscribed(net, pub, sink)
    await publish(pub, cap, None, 0, 1, 3, 4)
    assert await sub.wait_for(lambda s: s.last_seq == 4, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, 0), ("apply", "w1", 0, 1), ("clear", "w1", 0),
                        ("apply", "w1", 0, 3), ("apply", "w1", 0, 4)]
    assert sub.gaps == 1 and sub.stats.clears == 1 and sub.replays == 0
    await sub.stop()


async def test_first_message_without_replay_is_applied(net):
    cap = Capture("sglang-0.5.22")
    pub = Publisher(net)
    sink = RecordingSink(cap)
    sub = await subscribed(net, pub, sink)
    await publish(pub, cap, None, 2, 3, 3, 4)  # joined late, and one duplicate
    assert await sub.wait_for(lambda s: s.messages_seen == 4, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, s) for s in (2, 3, 4)]
    assert sub.gaps == 0 and sub.stats.clears == 0 and sub.stats.duplicates == 1
    await sub.stop()


async def test_restart_clears_then_applies(net):
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    sink = RecordingSink(cap)
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, metrics=metrics)
    await publish(pub, cap, None, 0, 1, 2, 0, 1)
    assert await sub.wait_for(lambda s: s.messages_seen == 5, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, 0), ("apply", "w1", 0, 1), ("apply", "w1", 0, 2),
                        ("clear", "w1", 0), ("apply", "w1", 0, 0), ("apply", "w1", 0, 1)]
    assert sub.restarts == 1 and sub.gaps == 0
    assert metrics.registry.get_sample_value("mmroute_kv_restarts_detected_total", {"worker": "w1"}) == 1
    await sub.stop()


async def test_restart_with_replay_refills_from_zero(net):
    """The new process's seq 0 was missed: clear, then replay from 0 of the new buffer."""
    old, new = Capture("vllm-0.33.0"), Capture("vllm-0.33.0_bytes-hashes")
    pub = Publisher(net)
    server = ReplayServer(net, old)
    sink = RecordingSink()
    sub = await subscribed(net, pub, sink, server)
    await publish(pub, old, server, 0, 1, 2)
    assert await sub.wait_for(lambda s: s.messages_applied == 3, TIMEOUT)
    server.capture, server.max_seq = new, 1  # restarted engine: new buffer, seq 0 lost
    await publish(pub, new, None, 1)
    assert await sub.wait_for(lambda s: s.messages_applied == 5 and s.stats.duplicates == 1, TIMEOUT), sub.snapshot()
    assert server.requests == [0]
    assert [e[0] for e in sink.log] == ["apply"] * 3 + ["clear", "apply", "apply"]
    assert [e[3] for e in sink.log[4:]] == [new.batches[0], new.batches[1]]
    assert sub.restarts == 1 and sub.stats.duplicates == 1
    await sub.stop()
    await server.close()


async def test_replay_timeout_clears_and_continues(net):
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    server = ReplayServer(net, cap, silent=True)
    sink = RecordingSink(cap)
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, server, metrics=metrics, replay_timeout=0.2)
    await publish(pub, cap, server, 0, 2, 3)
    assert await sub.wait_for(lambda s: s.last_seq == 3, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, 0), ("clear", "w1", 0), ("apply", "w1", 0, 2), ("apply", "w1", 0, 3)]
    assert server.requests == [0]  # from L: its digest is checked
    assert sub.stats.replay_outcomes == {"timeout": 1}
    assert metrics.registry.get_sample_value("mmroute_kv_replays_total", {"worker": "w1", "outcome": "timeout"}) == 1
    await sub.stop()
    await server.close()


async def test_garbage_is_counted_and_subscriber_keeps_working(net):
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    sink = RecordingSink()
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, metrics=metrics)
    await pub.send([b"kv-events", b"\x00" * 8, b"\xc1not msgpack"])
    await pub.send([b"kv-events"])
    await pub.send([b"kv-events", b"\x00\x01", cap.live[0][2]])
    await pub.send([b"kv-events", b"\x00" * 8, b"\x81\xa1a\x01"])  # a map, not [ts, events]
    # a batch with one unknown event and one good one: the good one is applied
    good = msgpack.packb([1.5, [{"type": "AllBlocksCleared"}, {"type": "NewEvent"}], 0])
    await pub.send([b"kv-events", b"\x00" * 8, good])
    await publish(pub, cap, None, 1)
    assert await sub.wait_for(lambda s: s.messages_seen == 6, TIMEOUT), sub.snapshot()
    assert sub.decode_errors == 4 and sub.messages_applied == 2 and sub.running
    assert sink.log[0][3].skipped == 1 and len(sink.log[0][3].events) == 1
    assert sink.log[1] == ("apply", "w1", 0, cap.batches[1])
    assert metrics.registry.get_sample_value("mmroute_kv_decode_errors_total", {"worker": "w1"}) == 4
    assert metrics.registry.get_sample_value(
        "mmroute_kv_events_total", {"worker": "w1", "type": "unknown", "status": "skipped"}) == 1
    await sub.stop()


async def test_sink_exception_does_not_kill_the_loop(net):
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    sink = RecordingSink(cap)
    sink.fail_next = 1
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, metrics=metrics)
    await publish(pub, cap, None, 0, 1)
    assert await sub.wait_for(lambda s: s.messages_seen == 2, TIMEOUT), sub.snapshot()
    # failed batch: the rank is cleared (half-applied), the next one applies normally
    assert sink.log == [("clear", "w1", 0), ("apply", "w1", 0, 1)]
    assert sub.stats.sink_errors == 1 and sub.running
    assert metrics.registry.get_sample_value(
        "mmroute_kv_events_total", {"worker": "w1", "type": "BlockStored", "status": "error"}) == 1
    await sub.stop()


async def test_stop_leaves_no_tasks_and_closes_sockets(net):
    pub = Publisher(net)
    sink = RecordingSink()
    before = asyncio.all_tasks()
    sub = await started(KVSubscriber("w1", pub.endpoint, sink, ctx=net.ctx))
    assert sub.running
    await pub.wait_subscribed()
    assert await sub.wait_for(lambda s: s.connected, TIMEOUT)
    sock = sub._sock
    await sub.stop()
    assert asyncio.all_tasks() - before == set()
    assert sock.closed and not sub.running and not sub.connected
    await sub.stop()  # idempotent
    with pytest.raises(ValueError, match="KVSubscriber"):
        await started(KVSubscriber("w2", "not-an-endpoint", sink, ctx=net.ctx))
    assert asyncio.all_tasks() - before == set()


async def test_collector_routes_topics_to_workers(net):
    vllm, sgl = Capture("vllm-0.33.0"), Capture("sglang-0.5.23")
    server = ReplayServer(net, vllm)
    sink = RecordingSink()
    metrics = Metrics()
    before = asyncio.all_tasks()
    coll = KVCollector("tcp://127.0.0.1:*", sink, {"kv-a": "wa", b"kv-b": "wb"},
                       replay_endpoints={"kv-a": server.endpoint}, ctx=net.ctx, metrics=metrics)
    coll.start()
    assert coll.endpoint.startswith("tcp://127.0.0.1:")
    # Engines with a non-wildcard endpoint *connect* their PUB to us (ENGINES.md §1.2).
    pa = Publisher(net, connect=coll.endpoint)
    pb = Publisher(net, connect=coll.endpoint)
    assert await pa.wait_subscribed() == b"" and await pb.wait_subscribed() == b""
    await publish(pa, vllm, server, 0, topic=b"kv-a")
    await publish(pb, sgl, None, 1, 2, topic=b"kv-b")
    await pa.send(vllm.live[1], topic=b"kv-unknown")
    server.max_seq = 2  # kv-a seq 1, 2 published, only 2 arrives live... 1 never sent live
    await publish(pa, vllm, server, 2, topic=b"kv-a")
    await pb.send([b"kv-b", b"\x00" * 8, b"\xc1"])
    assert await coll.wait_for(lambda c: c.messages_seen == 6 and c.stats_for("wa").last_seq == 2, TIMEOUT), coll.snapshot()
    assert coll.unknown_topics == 1 and coll.peers == 2
    assert [e[3] for e in sink.log if e[1] == "wa"] == [vllm.batches[0], vllm.batches[1], vllm.batches[2]]
    assert [e[3] for e in sink.log if e[1] == "wb"] == [sgl.batches[1], sgl.batches[2]]
    assert all(e[0] == "apply" and e[2] == 0 for e in sink.log)
    assert server.requests == [0]  # from L: its digest is checked
    assert coll.stats_for("wa").gaps == 1 and coll.stats_for("wb").decode_errors == 1
    assert metrics.registry.get_sample_value("mmroute_kv_decode_errors_total", {"worker": "wb"}) == 1
    await coll.stop()
    assert asyncio.all_tasks() - before == set()
    await server.close()


async def test_seq_tracked_per_dp_rank_with_configured_fallback(net):
    pub = Publisher(net)
    sink = RecordingSink()
    sub = await started(KVSubscriber("w1", pub.endpoint, sink, ctx=net.ctx, dp_rank=3))

    def frames(seq: int, *rank: int) -> list[bytes]:
        return [b"", seq.to_bytes(8, "big"), msgpack.packb([float(seq), [{"type": "AllBlocksCleared"}], *rank])]

    await pub.wait_subscribed()
    for f in (frames(0), frames(1), frames(0, 1), frames(2, 3), frames(1, 1)):
        await pub.send(f)
    assert await sub.wait_for(lambda s: s.messages_seen == 5, TIMEOUT), sub.snapshot()
    # no rank in the batch (old SGLang) -> configured rank 3; rank 1 has its own seq space
    assert [(e[0], e[2], e[3].ts) for e in sink.log] == [
        ("apply", 3, 0.0), ("apply", 3, 1.0), ("apply", 1, 0.0), ("apply", 3, 2.0), ("apply", 1, 1.0)]
    assert sub.restarts == 0 and sub.gaps == 0
    assert sub.stats.seq_by_rank == {3: 2, 1: 1}
    await sub.stop()


async def test_replay_older_than_buffer_is_partial_and_clears(net):
    """ENGINES.md §1.6: a start older than the buffer is not an error; the hole remains."""
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    server = ReplayServer(net, cap)
    del cap.replay[0], cap.replay[1], cap.replay[2]  # the engine's buffer already dropped them
    sink = RecordingSink(cap)
    sub = await subscribed(net, pub, sink, server)
    await publish(pub, cap, server, 0)
    server.max_seq = 4
    await publish(pub, cap, server, 4)
    assert await sub.wait_for(lambda s: s.messages_seen == 2 and s.stats.duplicates == 1, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, 0), ("clear", "w1", 0), ("apply", "w1", 0, 3), ("apply", "w1", 0, 4)]
    assert server.requests == [0]  # the anchor (last applied) is gone too: not a restart
    assert sub.stats.replay_outcomes == {"partial": 1} and sub.gaps == 1 and sub.restarts == 0
    await sub.stop()
    await server.close()


# ---- restart detection: payload digests, reconnect verification, resync ---------------------


async def test_restart_first_seen_at_last_seq_is_detected_by_digest(net):
    """(a) The new process's seq 0, 1 are lost; its seq 2 collides with the last applied
    seq 2 of the old one. A different payload: restart, clear, replay the new buffer."""
    old, new = Capture("vllm-0.33.0"), Capture("vllm-0.33.0_bytes-hashes")
    pub = Publisher(net)
    server = ReplayServer(net, old)
    sink = RecordingSink()
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, server, metrics=metrics)
    await publish(pub, old, server, 0, 1, 2)
    assert await sub.wait_for(lambda s: s.messages_applied == 3, TIMEOUT)
    server.capture, server.max_seq = new, 2
    await publish(pub, new, None, 2)
    assert await sub.wait_for(lambda s: s.messages_seen == 4 and s.stats.duplicates == 1, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, old.batches[s]) for s in range(3)] + [("clear", "w1", 0)] + [
        ("apply", "w1", 0, new.batches[s]) for s in range(3)]
    assert server.requests == [0]
    assert sub.restarts == 1 and sub.stats.duplicates == 1 and sub.gaps == 0  # live 2: already replayed
    assert sub.stats.replay_outcomes == {"ok": 1}
    assert metrics.registry.get_sample_value("mmroute_kv_restarts_detected_total", {"worker": "w1"}) == 1
    await sub.stop()
    await server.close()


async def test_restart_at_last_seq_without_replay_clears_and_applies(net):
    old, new = Capture("vllm-0.33.0"), Capture("vllm-0.33.0_bytes-hashes")
    pub = Publisher(net)
    sink = RecordingSink()
    sub = await subscribed(net, pub, sink)
    await publish(pub, old, None, 0, 1)
    await publish(pub, new, None, 1, 2)
    assert await sub.wait_for(lambda s: s.messages_seen == 4, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, old.batches[0]), ("apply", "w1", 0, old.batches[1]), ("clear", "w1", 0),
                        ("apply", "w1", 0, new.batches[1]), ("apply", "w1", 0, new.batches[2])]
    assert sub.restarts == 1 and sub.stats.duplicates == 0 and sub.gaps == 0
    await sub.stop()


async def test_genuine_duplicate_is_ignored(net):
    """(e) The same payload twice under one seq is a duplicate, not a restart."""
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    server = ReplayServer(net, cap)
    sink = RecordingSink(cap)
    sub = await subscribed(net, pub, sink, server)
    await publish(pub, cap, server, 0, 1, 1, 2, 2)
    assert await sub.wait_for(lambda s: s.messages_seen == 5, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, s) for s in range(3)]
    assert sub.stats.duplicates == 2 and sub.restarts == 0 and sub.stats.clears == 0
    assert server.requests == []
    await sub.stop()
    await server.close()


async def test_same_process_reconnect_replays_missed_messages(net):
    """(b) The publisher socket goes away and is re-bound on the same port, seq goes on:
    on reconnect the subscriber replays from its last seq, the digest matches, nothing is
    cleared and the messages published meanwhile are applied without any live traffic."""
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    server = ReplayServer(net, cap)
    sink = RecordingSink(cap)
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, server, metrics=metrics)
    await publish(pub, cap, server, 0, 1)
    assert await sub.wait_for(lambda s: s.messages_applied == 2 and s.connected, TIMEOUT)
    await pub.restart(net)
    assert await sub.wait_for(lambda s: not s.connected, TIMEOUT)
    server.max_seq = 4  # 2, 3, 4 published while nobody listened
    await pub.wait_subscribed()
    assert await sub.wait_for(lambda s: s.last_seq == 4, TIMEOUT), sub.snapshot()
    await publish(pub, cap, server, 5)
    assert await sub.wait_for(lambda s: s.last_seq == 5, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, s) for s in range(6)]
    assert server.requests == [1]
    assert sub.stats.reconnects == 1 and sub.stats.verifications == 1
    assert sub.restarts == 0 and sub.stats.clears == 0 and sub.stats.replay_outcomes == {"ok": 1}
    assert metrics.registry.get_sample_value("mmroute_kv_replays_total", {"worker": "w1", "outcome": "ok"}) == 1
    await sub.stop()
    await server.close()


async def test_restart_after_reconnect_continuing_seq_is_detected(net):
    """A new process on the same port whose first live message is seq L + 1 (0..L lost):
    indistinguishable by seq, caught by the reconnect check (replayed L differs)."""
    old, new = Capture("vllm-0.33.0"), Capture("vllm-0.33.0_bytes-hashes")
    pub = Publisher(net)
    server = ReplayServer(net, old)
    sink = RecordingSink()
    sub = await subscribed(net, pub, sink, server)
    await publish(pub, old, server, 0, 1, 2)
    assert await sub.wait_for(lambda s: s.messages_applied == 3 and s.connected, TIMEOUT)
    await pub.restart(net)
    server.capture, server.max_seq = new, 2
    await pub.wait_subscribed()
    await publish(pub, new, server, 3)
    assert await sub.wait_for(lambda s: s.messages_seen == 4 and s.stats.replay_outcomes["ok"] == 1, TIMEOUT), \
        sub.snapshot()
    assert sink.log == [("apply", "w1", 0, old.batches[s]) for s in range(3)] + [("clear", "w1", 0)] + [
        ("apply", "w1", 0, new.batches[s]) for s in range(4)]
    assert server.requests == [2, 0]
    assert sub.restarts == 1 and sub.stats.replay_outcomes == {"restart": 1, "ok": 1}
    await sub.stop()
    await server.close()


async def test_restart_after_reconnect_with_empty_buffer_is_detected(net):
    """The new process has published nothing yet: its buffer lacks L, so it is not the
    process L came from. The old blocks are dropped right at reconnect, not at the next
    message."""
    old, new = Capture("vllm-0.33.0"), Capture("vllm-0.33.0_bytes-hashes")
    pub = Publisher(net)
    server = ReplayServer(net, old)
    sink = RecordingSink()
    sub = await subscribed(net, pub, sink, server)
    await publish(pub, old, server, 0, 1, 2)
    assert await sub.wait_for(lambda s: s.messages_applied == 3 and s.connected, TIMEOUT)
    server.capture, server.max_seq = new, -1
    await pub.restart(net)
    await pub.wait_subscribed()
    assert await sub.wait_for(lambda s: s.restarts == 1 and s.stats.replay_outcomes["ok"] == 1, TIMEOUT), \
        sub.snapshot()
    assert sink.log == [("apply", "w1", 0, old.batches[s]) for s in range(3)] + [("clear", "w1", 0)]
    assert server.requests == [2, 0]
    await publish(pub, new, server, 0, 1)
    assert await sub.wait_for(lambda s: s.messages_applied == 5, TIMEOUT), sub.snapshot()
    assert [e[3] for e in sink.log[4:]] == [new.batches[0], new.batches[1]]
    assert sub.gaps == 0 and sub.restarts == 1
    await sub.stop()
    await server.close()


async def test_restart_seen_as_gap_is_a_restart_not_a_partial_replay(net):
    """(c) First message of the new process seen: seq 4 > L + 1 (L = 1). The replay from L
    returns the new process's seq 1, whose digest differs: restart, replay from 0."""
    old, new = Capture("vllm-0.33.0"), Capture("vllm-0.33.0_bytes-hashes")
    pub = Publisher(net)
    server = ReplayServer(net, old)
    sink = RecordingSink()
    metrics = Metrics()
    sub = await subscribed(net, pub, sink, server, metrics=metrics)
    await publish(pub, old, server, 0, 1)
    assert await sub.wait_for(lambda s: s.messages_applied == 2, TIMEOUT)
    server.capture, server.max_seq = new, 4
    await publish(pub, new, None, 4)
    assert await sub.wait_for(lambda s: s.messages_seen == 3 and s.stats.duplicates == 1, TIMEOUT), sub.snapshot()
    assert sink.log == [("apply", "w1", 0, old.batches[0]), ("apply", "w1", 0, old.batches[1]), ("clear", "w1", 0)] + [
        ("apply", "w1", 0, new.batches[s]) for s in range(5)]
    assert server.requests == [1, 0]
    assert sub.restarts == 1 and sub.stats.replay_outcomes == {"restart": 1, "ok": 1}
    assert "partial" not in sub.stats.replay_outcomes and sub.stats.duplicates == 1
    assert metrics.registry.get_sample_value("mmroute_kv_restarts_detected_total", {"worker": "w1"}) == 1
    await sub.stop()
    await server.close()


async def test_request_resync_clears_and_replays_rate_limited(net):
    """(d) The index meets an unknown parent and calls request_resync from inside apply:
    scheduled (not inline), the rank is cleared and replayed from 0; a second request
    within the window does nothing."""
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    server = ReplayServer(net, cap)
    sink = RecordingSink(cap)
    metrics = Metrics()
    sub = await started(KVSubscriber("w1", pub.endpoint, sink, replay_endpoint=server.endpoint, ctx=net.ctx,
                                     metrics=metrics))
    calls = []
    sink.on_apply = lambda b: calls.append(sub.request_resync()) if b == cap.batches[2] and not calls else None
    await pub.wait_subscribed()
    await publish(pub, cap, server, 0, 1, 2)
    assert await sub.wait_for(lambda s: s.stats.resyncs == 1 and sum(s.stats.replay_outcomes.values()) == 1,
                              TIMEOUT), sub.snapshot()
    assert calls == [True]
    assert sink.log == [("apply", "w1", 0, s) for s in range(3)] + [("clear", "w1", 0)] + [
        ("apply", "w1", 0, s) for s in range(3)]
    assert server.requests == [0] and sub.stats.replay_outcomes == {"ok": 1}
    # Rate limit: neither all ranks nor the explicit rank resync again within the window.
    assert sub.request_resync() is False and sub.request_resync(0) is False
    assert sub.stats.resyncs_suppressed == 2 and sub.stats.resyncs == 1
    await publish(pub, cap, server, 3)  # the stream goes on; its seq space is intact
    assert await sub.wait_for(lambda s: s.last_seq == 3, TIMEOUT), sub.snapshot()
    assert applied(sink)[-1] == 3 and server.requests == [0] and sub.restarts == 0
    assert metrics.registry.get_sample_value("mmroute_kv_replays_total", {"worker": "w1", "outcome": "ok"}) == 1
    await sub.stop()
    assert sub.request_resync() is False  # stopped: nothing scheduled
    await server.close()


async def test_request_resync_without_replay_endpoint_only_counts(net):
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    sink = RecordingSink(cap)
    sub = await subscribed(net, pub, sink, resync_interval=3600)
    await publish(pub, cap, None, 0)
    assert await sub.wait_for(lambda s: s.messages_applied == 1, TIMEOUT)
    assert sub.request_resync() is False and sub.request_resync(0) is False
    assert sub.stats.resyncs_unavailable == 1 and sub.stats.resyncs_suppressed == 1
    assert sink.log == [("apply", "w1", 0, 0)] and sub.stats.clears == 0
    await sub.stop()


async def test_collector_detects_a_publisher_restart_on_reconnect(net):
    """Collector mode: a publisher that connects again after a disconnect makes every
    stream verify; the restarted one (replayed L differs) is cleared and refilled."""
    old, new = Capture("vllm-0.33.0"), Capture("vllm-0.33.0_bytes-hashes")
    server = ReplayServer(net, old)
    sink = RecordingSink()
    coll = KVCollector("tcp://127.0.0.1:*", sink, {"kv-a": "wa"}, replay_endpoints={"kv-a": server.endpoint},
                       ctx=net.ctx)
    coll.start()
    pa = Publisher(net, connect=coll.endpoint)
    assert await pa.wait_subscribed() == b""
    await publish(pa, old, server, 0, 1, 2, topic=b"kv-a")
    assert await coll.wait_for(lambda c: c.stats_for("wa").last_seq == 2 and c.peers == 1, TIMEOUT), coll.snapshot()
    pa.sock.close(linger=0)
    assert await coll.wait_for(lambda c: c.peers == 0, TIMEOUT), coll.snapshot()
    server.capture, server.max_seq = new, 2
    pa2 = Publisher(net, connect=coll.endpoint)
    assert await pa2.wait_subscribed() == b""
    await publish(pa2, new, server, 3, topic=b"kv-a")
    st = coll.stats_for("wa")
    assert await coll.wait_for(lambda c: st.messages_seen == 4 and st.last_seq == 3 and st.replay_outcomes["ok"] == 1,
                               TIMEOUT), coll.snapshot()
    assert sink.log == [("apply", "wa", 0, old.batches[s]) for s in range(3)] + [("clear", "wa", 0)] + [
        ("apply", "wa", 0, new.batches[s]) for s in range(4)]
    assert st.restarts == 1 and st.reconnects == 1 and server.requests == [2, 0]
    await coll.stop()
    await server.close()


async def test_replay_is_delivered_in_one_step(net):
    """A join replays from 0 through old states (here: blocks the final reset wipes); the
    replayed batches reach the sink with no other task running in between, so routing
    never sees a half-replayed index."""
    cap = Capture("vllm-0.33.0")
    pub = Publisher(net)
    server = ReplayServer(net, cap)
    sink = RecordingSink(cap)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    seen: list[int] = []
    sink.on_apply = lambda b: seen.append(ticks)
    net.tasks.append(asyncio.get_running_loop().create_task(ticker()))
    sub = await subscribed(net, pub, sink, server)
    await publish(pub, cap, server, 9)  # the reset; 0..8 only come by replay
    assert await sub.wait_for(lambda s: s.last_seq == 9 and s.stats.duplicates == 1, TIMEOUT), sub.snapshot()
    assert applied(sink) == list(range(10))
    assert len(set(seen)) == 1 and ticks > seen[0]  # the ticker ran, but never mid-replay
    await sub.stop()
    await server.close()
