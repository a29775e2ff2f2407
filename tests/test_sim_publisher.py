"""The simulator's ZMQ publisher: live frames, seq, bind/connect, replay layouts (real sockets)."""

from __future__ import annotations

import zmq

from mmroute.sim.publisher import END_SEQ, EventPublisher, PublisherConfig, should_bind
from sim_helpers import replay_frames

TIMEOUT_MS = 10_000


def _sub(ctx, endpoint, topic=b""):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.connect(endpoint)
    return sub


def _wait_joined(pub: EventPublisher, sub) -> list[list[bytes]]:
    """Publish probes until the SUB receives one (slow-joiner); return what arrived."""
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    got = []
    for _ in range(500):
        pub.publish(b"probe")
        if poller.poll(20):
            got.append(sub.recv_multipart())
            return got
    raise AssertionError("subscriber never joined")


def test_should_bind_rules():
    assert should_bind("tcp://*:5557") and should_bind("tcp://[::]:5557") and should_bind("ipc:///tmp/x")
    assert should_bind("inproc://kv") and should_bind("tcp://127.0.0.1:0")
    assert not should_bind("tcp://127.0.0.1:5557") and not should_bind("tcp://router:6000")


def test_live_frames_seq_and_topic_replay_layout():
    ctx = zmq.Context()
    pub = EventPublisher(PublisherConfig(topic="kv-events"), ctx)
    pub.start()
    try:
        assert pub.bound_endpoint.startswith("tcp://127.0.0.1:") and not pub.bound_endpoint.endswith(":0")
        sub = _sub(ctx, pub.bound_endpoint)
        probes = _wait_joined(pub, sub)
        assert probes[0][0] == b"kv-events" and len(probes[0]) == 3
        for payload in (b"one", b"two"):
            pub.publish(payload)
        msgs = []
        while len(msgs) < 2:
            m = sub.recv_multipart()
            if m[2] != b"probe":
                msgs.append(m)
        seqs = [int.from_bytes(m[1], "big") for m in msgs]
        assert seqs[1] == seqs[0] + 1 and [m[2] for m in msgs] == [b"one", b"two"]
        assert pub.drain()
        # replay from the first real message: 4-frame sets, then [b"", b"", END, b""]
        out = replay_frames(ctx, pub.replay_bound_endpoint, seqs[0])
        assert out[:-1] == [[b"", b"kv-events", s.to_bytes(8, "big"), p] for s, p in zip(seqs, [b"one", b"two"])]
        assert out[-1] == [b"", b"", END_SEQ, b""]
        # replay from 0 starts at seq 0 (the first probe)
        assert int.from_bytes(replay_frames(ctx, pub.replay_bound_endpoint, 0)[0][2], "big") == 0
        sub.close(0)
    finally:
        pub.close()
        ctx.term()


def test_plain_replay_layout_and_invalid_requests():
    ctx = zmq.Context()
    pub = EventPublisher(PublisherConfig(topic="t", replay_layout="plain"), ctx)
    pub.start()
    try:
        pub.publish(b"a")
        pub.publish(b"b")
        assert pub.drain()
        # a malformed request gets no reply: on the same DEALER, the only replies that
        # arrive are those of the valid request sent after it
        out = replay_frames(ctx, pub.replay_bound_endpoint, 1, frames=None, before=[[b"garbage"], [b"", b"\x00" * 3]])
        assert out == [[b"", (1).to_bytes(8, "big"), b"b"], [b"", END_SEQ, b""]]
    finally:
        pub.close()
        ctx.term()


def test_connect_mode_reaches_a_binding_collector():
    ctx = zmq.Context()
    collector = ctx.socket(zmq.SUB)
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    collector.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    collector.bind("tcp://127.0.0.1:*")
    endpoint = collector.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = EventPublisher(PublisherConfig(endpoint=endpoint, replay_endpoint=None), ctx)
    pub.start()
    try:
        assert pub.bound_endpoint is None and pub.replay_bound_endpoint is None
        got = _wait_joined(pub, collector)
        assert got[0][2] == b"probe"
    finally:
        pub.close()
        collector.close(0)
        ctx.term()


def test_start_failure_is_reported():
    ctx = zmq.Context()
    pub = EventPublisher(PublisherConfig(endpoint="tcp://*:notaport"), ctx)
    try:
        pub.start()
    except RuntimeError as exc:
        assert "failed to start" in str(exc)
    else:
        raise AssertionError("bad endpoint accepted")
    finally:
        ctx.term()
