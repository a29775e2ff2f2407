"""Scheduler: cost, policies, tie-breaks, temperature, bookings (injected clock and rng)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from routing_helpers import ManualClock

from mmroute.routing.scheduler import Candidate, NoEligibleWorker, RequestSize, Scheduler

REQ = RequestSize(prompt_tokens=160, block_size=16, decode_tokens=32)  # 10 blocks


def sched(policy="kv", seed=0, **kw) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    return Scheduler(policy=policy, rng=random.Random(seed), clock=clock, **kw), clock


def test_cost_breakdown_and_lowest_wins():
    s, _ = sched(w_prefill=1.0, w_decode=0.5)
    cands = [Candidate("a", overlap_blocks=6), Candidate("b", overlap_blocks=0), Candidate("c", overlap_blocks=10)]
    d = s.choose(cands, REQ)
    assert d.worker_id == "c" and d.reason == "lowest_cost"
    by = {c.worker_id: c for c in d.costs}
    assert by["a"].uncached_blocks == 4 and by["a"].cost == 4
    assert by["b"].cost == 10
    assert by["c"].cost == 0
    # Overlap beyond the prompt (decode blocks) never makes the cost negative.
    d = s.choose([Candidate("a", overlap_blocks=50)], REQ)
    assert d.costs[0].uncached_blocks == 0


def test_booked_load_moves_the_choice():
    s, _ = sched(w_prefill=1.0, w_decode=0.5)
    cands = [Candidate("a", overlap_blocks=6), Candidate("b", overlap_blocks=0)]
    bk = s.book("a", prefill_tokens=16 * 7, decode_tokens=0)  # 7 blocks queued on a
    d = s.choose(cands, REQ)
    by = {c.worker_id: c for c in d.costs}
    assert by["a"].cost == 4 + 7 and by["a"].booked_prefill_blocks == 7
    assert d.worker_id == "b"
    bk.release_prefill()  # first token: prefill share gone
    assert s.choose(cands, REQ).worker_id == "a"
    s.book("a", 0, decode_tokens=16 * 20)  # decode load: 20 blocks * 0.5 = 10
    d = s.choose(cands, REQ)
    assert {c.worker_id: c.cost for c in d.costs} == {"a": 4 + 10, "b": 10}
    assert d.worker_id == "b"


def test_reported_queue_blends_beyond_own_bookings():
    s, _ = sched(w_prefill=1.0, w_decode=0.0)
    # No bookings yet: a reported waiting request is priced at this request's prompt.
    d = s.choose([Candidate("a", overlap_blocks=10, queued_reqs_reported=2), Candidate("b")], REQ)
    by = {c.worker_id: c for c in d.costs}
    assert by["a"].reported_queue_blocks == 20 and by["a"].cost == 20
    assert d.worker_id == "b"
    # Our own two prefill-pending bookings on a are what it reports: nothing extra.
    s.book("a", 32, 0)
    s.book("a", 32, 0)
    d = s.choose([Candidate("a", overlap_blocks=10, queued_reqs_reported=2), Candidate("b")], REQ)
    by = {c.worker_id: c for c in d.costs}
    assert by["a"].reported_queue_blocks == 0 and by["a"].booked_prefill_blocks == 4
    # Three reported, two ours: one extra request at the average booked size (32 tokens).
    d = s.choose([Candidate("a", overlap_blocks=10, queued_reqs_reported=3), Candidate("b")], REQ)
    assert {c.worker_id: c for c in d.costs}["a"].reported_queue_blocks == pytest.approx(2.0)


def test_tie_break_fewest_indexed_then_seeded_random():
    cands = [Candidate("a", indexed_blocks=50), Candidate("b", indexed_blocks=10), Candidate("c", indexed_blocks=10)]
    picks = Counter()
    for seed in range(40):
        s, _ = sched(seed=seed)
        d = s.choose(cands, REQ)
        assert d.reason == "tie_random"
        picks[d.worker_id] += 1
        assert sched(seed=seed)[0].choose(cands, REQ).worker_id == d.worker_id  # deterministic per seed
    assert set(picks) == {"b", "c"}
    s, _ = sched()
    d = s.choose(cands[:2], REQ)
    assert (d.worker_id, d.reason) == ("b", "tie_indexed")


def test_temperature_softmax():
    s, _ = sched(seed=7, temperature=2.0)
    cands = [Candidate("a", overlap_blocks=10), Candidate("b", overlap_blocks=8), Candidate("x", healthy=False)]
    d = s.choose(cands, REQ)
    probs = {c.worker_id: c.probability for c in d.costs}
    # costs 0 and 2, T=2: p(a) = 1 / (1 + e^-1)
    assert probs["a"] == pytest.approx(1 / (1 + 2.718281828459045**-1))
    assert probs["a"] + probs["b"] == pytest.approx(1.0)
    assert probs["x"] is None
    n = Counter(s.choose(cands, REQ).worker_id for _ in range(4000))
    assert set(n) == {"a", "b"}
    assert n["a"] / 4000 == pytest.approx(probs["a"], abs=0.03)
    # temperature 0: always the lowest cost.
    s0, _ = sched(seed=7)
    assert {s0.choose(cands, REQ).worker_id for _ in range(50)} == {"a"}


def test_unhealthy_and_excluded_never_chosen():
    for policy in ("kv", "round-robin", "least-loaded", "random"):
        s, _ = sched(policy)
        cands = [Candidate("a", overlap_blocks=10, healthy=False), Candidate("b"), Candidate("c")]
        for _ in range(30):
            assert s.choose(cands, REQ, exclude={"c"}).worker_id == "b"
        with pytest.raises(NoEligibleWorker):
            s.choose(cands, REQ, exclude={"b", "c"})
        with pytest.raises(NoEligibleWorker):
            s.choose([], REQ)


def test_round_robin_cycles_eligible():
    s, _ = sched("round-robin")
    cands = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert [s.choose(cands, REQ).worker_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded():
    s, _ = sched("least-loaded")
    cands = [Candidate("a", overlap_blocks=10), Candidate("b")]
    s.book("a", 10, 10)
    assert s.choose(cands, REQ).worker_id == "b"
    s.book("b", 100, 100)
    b2 = s.book("b", 0, 0)
    assert s.choose(cands, REQ).worker_id == "a"
    b2.release()
    # Same request counts: fewer booked tokens wins.
    assert s.choose(cands, REQ).worker_id == "a"


def test_random_policy_seeded_covers_all():
    s, _ = sched("random", seed=3)
    cands = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert {s.choose(cands, REQ).worker_id for _ in range(60)} == {"a", "b", "c"}
    with pytest.raises(ValueError):
        Scheduler(policy="nope")


def test_bookings_release_idempotent_no_leaks():
    s, _ = sched()
    b1 = s.book("a", 100, 20)
    b2 = s.book("a", 50, 10)
    b3 = s.book("b", 30, 5)
    ld = s.load("a")
    assert (ld.requests, ld.prefill_requests, ld.prefill_tokens, ld.decode_tokens) == (2, 2, 150, 30)
    b1.release_prefill()
    b1.release_prefill()
    ld = s.load("a")
    assert (ld.requests, ld.prefill_requests, ld.prefill_tokens, ld.decode_tokens) == (2, 1, 50, 30)
    b1.release()
    b1.release()
    b1.release_prefill()
    b2.release()  # without release_prefill (error before first token)
    b3.release_prefill()
    b3.release()
    assert s.loads() == {}
    assert s.active_bookings == 0
    assert s.load("a").is_idle()


def test_booking_expiry_with_injected_clock():
    expired = []
    s, clock = sched(booking_ttl=10.0, on_booking_expired=expired.append)
    b1 = s.book("a", 100, 20)
    clock.advance(5)
    b2 = s.book("b", 10, 1)
    clock.advance(5)  # b1 reaches its ttl exactly
    assert s.load("a").is_idle() and s.load("b").requests == 1
    assert expired == ["a"] and b1.expired and not b1.open
    b1.release()  # a late release after expiry is a no-op
    b1.release_prefill()
    assert s.loads() == {"b": s.load("b")}
    clock.advance(4.999)
    assert s.sweep() == 0
    clock.advance(0.001)
    # Expiry is swept lazily by choose() too.
    s.choose([Candidate("a"), Candidate("b")], REQ)
    assert expired == ["a", "b"] and s.expired_total == 2
    b2.release()
    assert s.loads() == {} and s.active_bookings == 0


def test_negative_tokens_clamped():
    s, _ = sched()
    b = s.book("a", -5, -1)
    assert s.load("a").prefill_tokens == 0
    b.release()
    assert s.loads() == {}
