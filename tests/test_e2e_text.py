"""End to end, text: the router in front of 3 simulated vLLM workers (separate processes).

Proves that routing used KV overlap and not luck: many distinct prefixes, each
repeated; every repeat lands on the worker that holds it; the predicted overlap
equals the worker-reported cached tokens on every request; the mean predicted hit
rate of the repeats, read from /metrics, is the physical limit (full blocks / all
blocks). Restart, replay after a gap, and AllBlocksCleared each have a test.
"""

from __future__ import annotations

import random

import pytest

from tests.e2e_helpers import QWEN25_VL, metric_value, running_sims, start_fleet, start_sims

pytestmark = pytest.mark.asyncio

BS = 16


def _conversation(i: int, rng: random.Random) -> list[dict[str, str]]:
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma"]) for _ in range(60 + 7 * i))
    return [
        {"role": "system", "content": f"You are assistant number {i}. {words}"},
        {"role": "user", "content": f"Question {i}: summarise the words above in {i + 3} sentences."},
    ]


@pytest.fixture(scope="module")
def sims():
    with running_sims(3, QWEN25_VL, ["--num-blocks", "2048", "--block-size", str(BS)]) as procs:
        yield procs


async def _cached(data: dict) -> int:
    return data["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_repeats_land_on_holder_and_prediction_equals_cached_tokens(sims):
    fleet = await start_fleet(sims, QWEN25_VL)
    try:
        for s in sims:  # a clean cache on every worker (the fixture is shared)
            async with fleet.session.post(s.url + "/reset_prefix_cache") as r:
                assert r.status == 200
        await fleet.sync()
        rng = random.Random(7)
        convs = [_conversation(i, rng) for i in range(12)]
        holder: dict[int, str] = {}
        lengths: dict[int, int] = {}
        for i, conv in enumerate(convs):
            ex = await fleet.explain({"model": "m", "messages": conv})
            assert all(c["overlap_blocks"] == 0 for c in ex["candidates"]), ex
            lengths[i] = ex["prompt_tokens"]
            worker, data = await fleet.chat(conv)
            assert data["usage"]["prompt_tokens"] == lengths[i]
            assert await _cached(data) == 0
            holder[i] = worker
            await fleet.sync()
        assert len(set(holder.values())) == 3, f"first pass should spread over the fleet: {holder}"

        text = await fleet.metrics_text()
        sum0 = metric_value(text, "mmroute_predicted_hit_rate_sum")
        cnt0 = metric_value(text, "mmroute_predicted_hit_rate_count")
        checked0 = metric_value(text, "mmroute_prediction_checked_total")
        limits = []
        for rep in range(2):
            for i in rng.sample(range(len(convs)), len(convs)):
                conv = convs[i]
                ex = await fleet.explain({"model": "m", "messages": conv})
                p = ex["prompt_tokens"]
                full = p // BS
                by_worker = {c["worker"]: c for c in ex["candidates"]}
                assert by_worker[holder[i]]["overlap_blocks"] == full, ex
                assert ex["worker"] == holder[i]
                worker, data = await fleet.chat(conv)
                assert worker == holder[i], f"repeat {rep} of prefix {i} went to {worker}, held by {holder[i]}"
                expected_cached = min(full * BS, ((p - 1) // BS) * BS)
                assert await _cached(data) == expected_cached
                assert by_worker[holder[i]]["predicted_cached_tokens"] == expected_cached
                limits.append(full / -(-p // BS))
                await fleet.sync()

        text = await fleet.metrics_text()
        n = metric_value(text, "mmroute_predicted_hit_rate_count") - cnt0
        mean = (metric_value(text, "mmroute_predicted_hit_rate_sum") - sum0) / n
        assert n == len(limits)
        assert mean == pytest.approx(sum(limits) / len(limits), abs=1e-9)
        assert metric_value(text, "mmroute_prediction_checked_total") - checked0 == len(limits)
        assert metric_value(text, "mmroute_prediction_mismatch_total") == 0
    finally:
        await fleet.close()


async def test_all_blocks_cleared_drops_worker_blocks(sims):
    fleet = await start_fleet(sims, QWEN25_VL)
    try:
        conv = _conversation(40, random.Random(1))
        worker, _ = await fleet.chat(conv)
        await fleet.sync()
        ex = await fleet.explain({"model": "m", "messages": conv})
        assert {c["worker"]: c["overlap_blocks"] for c in ex["candidates"]}[worker] == ex["prompt_tokens"] // BS
        async with fleet.session.post(fleet.sim(worker).url + "/reset_prefix_cache") as r:
            assert r.status == 200
        await fleet.sync()
        assert fleet.ctx.index.block_count(worker) == 0
        ex = await fleet.explain({"model": "m", "messages": conv})
        assert all(c["overlap_blocks"] == 0 for c in ex["candidates"])
        _, data = await fleet.chat(conv)
        assert await _cached(data) == 0
    finally:
        await fleet.close()


async def test_gap_is_repaired_by_replay(sims):
    fleet = await start_fleet(sims, QWEN25_VL)
    try:
        target = fleet.names[0]
        sim_url = fleet.sim(target).url
        conv, conv2 = _conversation(41, random.Random(2)), _conversation(42, random.Random(3))
        gaps0 = metric_value(await fleet.metrics_text(), "mmroute_kv_seq_gaps_total", {"worker": target})
        # The worker's next batch (conv's block stores) is lost on the wire, kept in its replay buffer.
        # Requests go to the worker directly: the index follows events, whoever sent the request.
        async with fleet.session.post(sim_url + "/sim/drop_kv_batches?n=1") as r:
            assert r.status == 200
        async with fleet.session.post(sim_url + "/v1/chat/completions",
                                      json={"model": "m", "messages": conv, "max_tokens": 1}) as r:
            assert r.status == 200
        # The next live batch reveals the gap; the router replays the missing one.
        async with fleet.session.post(sim_url + "/v1/chat/completions",
                                      json={"model": "m", "messages": conv2, "max_tokens": 1}) as r:
            assert r.status == 200
        await fleet.sync()
        text = await fleet.metrics_text()
        assert metric_value(text, "mmroute_kv_seq_gaps_total", {"worker": target}) == gaps0 + 1
        assert metric_value(text, "mmroute_kv_replays_total", {"worker": target, "outcome": "ok"}) >= 1
        for c in (conv, conv2):
            ex = await fleet.explain({"model": "m", "messages": c})
            overlaps = {x["worker"]: x["overlap_blocks"] for x in ex["candidates"]}
            assert overlaps[target] == ex["prompt_tokens"] // BS, ex
            assert ex["worker"] == target
        worker, data = await fleet.chat(conv)
        assert worker == target
        p = data["usage"]["prompt_tokens"]
        assert await _cached(data) == ((p - 1) // BS) * BS
    finally:
        await fleet.close()


async def test_worker_restart_clears_its_blocks():
    sims = start_sims(2, QWEN25_VL, ["--num-blocks", "1024"])
    fleet = await start_fleet(sims, QWEN25_VL, own_sims=True)
    try:
        rng = random.Random(5)
        held: dict[str, list] = {}
        for i in range(6):
            conv = _conversation(50 + i, rng)
            worker, _ = await fleet.chat(conv)
            held.setdefault(worker, []).append(conv)
            await fleet.sync()
        victim = max(held, key=lambda w: len(held[w]))
        assert fleet.ctx.index.block_count(victim) > 0
        last_seq = fleet._subs(victim)[0].last_seq
        assert last_seq is not None and last_seq >= 2

        # Restart the worker process on the same ports: its seq starts again at 0.
        old = fleet.sim(victim)
        info = old.info
        old.stop()
        from mmroute.demo import SimProcess

        new = SimProcess.start(["--model", QWEN25_VL, "--served-model-name", "m", "--log-level", "warning",
                                "--port", str(info["port"]), "--kv-endpoint", info["kv_endpoint"], "--kv-bind",
                                "--replay-endpoint", info["replay_endpoint"], "--num-blocks", "1024"])
        fleet.sims[fleet.names.index(victim)] = new
        sub = fleet._subs(victim)[0]
        restarts0 = sub.stats.restarts
        import aiohttp

        async with aiohttp.ClientSession() as fresh:  # the old keep-alive connections died with the process
            for _ in range(400):  # probe until the reconnected subscriber sees the new process
                async with fresh.post(new.url + "/reset_prefix_cache") as r:
                    assert r.status == 200
                if await sub.wait_for(lambda s: s.stats.restarts > restarts0, 0.05):
                    break
        assert sub.stats.restarts == restarts0 + 1
        text = await fleet.metrics_text()
        assert metric_value(text, "mmroute_kv_restarts_detected_total", {"worker": victim}) == 1
        assert fleet.ctx.index.block_count(victim) == 0
        await fleet.ctx.registry.wait_healthy(2, 30)
        # Its old prefixes are no longer credited to it; a repeat is a miss there.
        conv = held[victim][0]
        ex = await fleet.explain({"model": "m", "messages": conv})
        assert {c["worker"]: c["overlap_blocks"] for c in ex["candidates"]}[victim] == 0
    finally:
        await fleet.close()
