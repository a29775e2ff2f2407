"""End to end, the other modes: remote tokenization, tokenization verification,
collector mode, the vLLM <= 0.23 wire era, LoRA and cache_salt keys, streaming."""

from __future__ import annotations

import json

import pytest

from mmroute.api.app import start_background
from mmroute.api.context import AppContext
from mmroute.config import RouterConfig, WorkerSpec
from mmroute.demo import SimProcess
from tests.e2e_helpers import (QWEN25_VL, Fleet, data_url, image_message, metric_value, png_bytes, running_sims,
                               start_fleet, start_sims)
from tests.proxy_helpers import free_port

pytestmark = pytest.mark.asyncio

BS = 16
SYSTEM = {"role": "system", "content": "You keep the ledger of a small bakery and answer briefly. " * 6}


def _conv(i: int) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"How many loaves on day {i}? " * (3 + i)}]


async def _assert_repeat_hits(fleet: Fleet, body: dict, path: str = "/v1/chat/completions") -> str:
    status, data, headers = await fleet.post(path, body)
    assert status == 200, data
    holder = headers["x-mmroute-worker"]
    await fleet.sync()
    status, data, headers = await fleet.post(path, body)
    assert status == 200 and headers["x-mmroute-worker"] == holder
    p = data["usage"]["prompt_tokens"]
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == ((p - 1) // BS) * BS
    await fleet.sync()
    return holder


@pytest.fixture(scope="module")
def sims():
    with running_sims(2, QWEN25_VL, ["--lora-modules", "sql-adapter=/adapters/sql"]) as procs:
        yield procs


async def test_remote_tokenization_routes_exactly(sims):
    fleet = await start_fleet(sims, QWEN25_VL, tokenize="remote")
    try:
        local = fleet.ctx.renderer.render_chat({"messages": _conv(1)}, []).token_ids
        ex = await fleet.explain({"model": "m", "messages": _conv(1)})
        assert ex["prompt_token_ids"] == local  # the worker's /tokenize agrees with the local renderer
        await _assert_repeat_hits(fleet, {"model": "m", "messages": _conv(1), "max_tokens": 2})
        text = await fleet.metrics_text()
        assert metric_value(text, "mmroute_remote_tokenize_total", {"outcome": "ok"}) >= 1
        assert metric_value(text, "mmroute_remote_tokenize_total", {"outcome": "cache_hit"}) >= 1
        # A body the worker's /tokenize rejects gives the client the same error.
        status, data, _ = await fleet.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x" * 10}],
                                                                    "chat_template": "{{ raise_exception('nope') }}"})
        assert status == 400 and data["error"]["message"]
        assert fleet.ctx.scheduler.active_bookings == 0
    finally:
        await fleet.close()


async def test_verify_tokenization_counts_agreement(sims):
    fleet = await start_fleet(sims, QWEN25_VL, verify_tokenization=1.0)
    try:
        for i in range(3):
            await fleet.chat(_conv(10 + i))
        img = data_url(png_bytes(64, 64))
        await fleet.chat([SYSTEM, image_message(img, "tiny")])
        for _ in range(200):  # checks run off the critical path
            text = await fleet.metrics_text()
            if metric_value(text, "mmroute_tokenization_verify_total") >= 4:
                break
            import asyncio

            await asyncio.sleep(0.05)
        assert metric_value(text, "mmroute_tokenization_verify_total", {"result": "match"}) == 4
        assert metric_value(text, "mmroute_tokenization_verify_total", {"result": "mismatch"}) == 0
    finally:
        await fleet.close()


async def test_lora_and_cache_salt_are_keyed_like_vllm(sims):
    fleet = await start_fleet(sims, QWEN25_VL, lora_modules=["sql-adapter"])
    try:
        conv = _conv(20)
        base_holder = await _assert_repeat_hits(fleet, {"model": "m", "messages": conv, "max_tokens": 2})
        # The same prompt under a LoRA adapter is a different cache: no credit from the base model's blocks.
        ex = await fleet.explain({"model": "sql-adapter", "messages": conv})
        assert ex["lora_name"] == "sql-adapter"
        assert all(c["overlap_blocks"] == 0 for c in ex["candidates"])
        lora_holder = await _assert_repeat_hits(fleet, {"model": "sql-adapter", "messages": conv, "max_tokens": 2})
        # A salt keys block 0, so every block differs; the same salt hits.
        ex = await fleet.explain({"model": "m", "messages": conv, "cache_salt": "tenant-42"})
        assert all(c["overlap_blocks"] == 0 for c in ex["candidates"])
        await _assert_repeat_hits(fleet, {"model": "m", "messages": conv, "cache_salt": "tenant-42", "max_tokens": 2})
        assert base_holder and lora_holder
        assert metric_value(await fleet.metrics_text(), "mmroute_prediction_mismatch_total") == 0
    finally:
        await fleet.close()


async def test_streaming_passthrough_strips_injected_usage(sims):
    fleet = await start_fleet(sims, QWEN25_VL)
    try:
        body = {"model": "m", "messages": _conv(30), "max_tokens": 5, "stream": True}
        async with fleet.session.post(fleet.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
        events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("usage" not in c or c["usage"] is None for c in chunks)  # the client did not ask for it
        await fleet.sync()
        # ... yet the router read it upstream and checked its prediction.
        body["stream_options"] = {"include_usage": True}
        async with fleet.session.post(fleet.url + "/v1/chat/completions", json=body) as r:
            raw = (await r.read()).decode()
        chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        text = await fleet.metrics_text()
        assert metric_value(text, "mmroute_prediction_checked_total") == 2
        assert metric_value(text, "mmroute_prediction_mismatch_total") == 0
    finally:
        await fleet.close()


async def test_vllm_023_wire_era_with_lora_and_images():
    sims = start_sims(2, QWEN25_VL, ["--wire-format", "array", "--lora-modules", "sql-adapter=/a"])
    fleet = await start_fleet(sims, QWEN25_VL, own_sims=True, lora_modules=["sql-adapter"])
    try:
        conv = [SYSTEM, image_message(data_url(png_bytes(300, 200, (4, 5, 6))), "Describe.")]
        await _assert_repeat_hits(fleet, {"model": "sql-adapter", "messages": conv, "max_tokens": 2})
        await _assert_repeat_hits(fleet, {"model": "m", "messages": conv, "max_tokens": 2, "cache_salt": "s"})
    finally:
        await fleet.close()


async def test_collector_mode_publishers_connect_to_the_router():
    bind = f"tcp://127.0.0.1:{free_port()}"
    # Publishers *connect* (no "*" in the endpoint, as vLLM does); the topic names the worker.
    sims = [SimProcess.start(["--model", QWEN25_VL, "--served-model-name", "m", "--port", "0", "--log-level", "warning",
                              "--kv-endpoint", bind, "--topic", name, "--replay-endpoint", "none"])
            for name in ("c0", "c1")]
    cfg = RouterConfig(model=QWEN25_VL, served_model_name=["m"], port=0, kv_events_bind=bind, health_interval=0.5,
                       workers=[WorkerSpec.parse(f"{s.url},name={n}") for s, n in zip(sims, ("c0", "c1"))])
    ctx = AppContext(cfg)
    runner, port = await start_background(cfg, ctx)
    import aiohttp

    session = aiohttp.ClientSession()
    try:
        await ctx.registry.wait_healthy(2, 30)
        # Probe each publisher until the collector has seen it (its connection may trail the bind).
        for s, name in zip(sims, ("c0", "c1")):
            for _ in range(400):
                async with session.post(s.url + "/reset_prefix_cache") as r:
                    assert r.status == 200
                if await ctx.collector.wait_for(lambda c: (c.stats_for(name) and c.stats_for(name).messages_applied), 0.05):
                    break
            assert ctx.collector.stats_for(name).messages_applied > 0
        body = {"model": "m", "messages": _conv(40), "max_tokens": 2}
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
            holder = r.headers["x-mmroute-worker"]
        want = None
        async with session.get(sims[("c0", "c1").index(holder)].url + "/sim/state") as r:
            want = (await r.json())["kv_seq"]
        assert await ctx.collector.wait_for(lambda c: c.stats_for(holder).last_seq >= want, 30)
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
            data = await r.json()
            assert r.headers["x-mmroute-worker"] == holder
        p = data["usage"]["prompt_tokens"]
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == ((p - 1) // BS) * BS
        assert ctx.index.block_count(holder) >= p // BS
    finally:
        await session.close()
        await runner.cleanup()
        for s in sims:
            s.stop()


async def test_lora_adapters_are_discovered_from_the_workers(sims):
    """No --lora-modules on the router: the adapter listed by the workers' /v1/models is
    accepted and keyed with its name; an unknown model is still a 404."""
    fleet = await start_fleet(sims, QWEN25_VL)
    try:
        ex = await fleet.explain({"model": "sql-adapter", "messages": _conv(60)})
        assert ex["lora_name"] == "sql-adapter"
        await _assert_repeat_hits(fleet, {"model": "sql-adapter", "messages": _conv(60), "max_tokens": 2})
        async with fleet.session.get(fleet.url + "/v1/models") as r:
            assert {m["id"] for m in (await r.json())["data"]} == {"m", "sql-adapter"}
        status, data, _ = await fleet.post("/v1/chat/completions", {"model": "no-such", "messages": _conv(1)})
        assert status == 404 and data["error"]["code"] == "model_not_found"
    finally:
        await fleet.close()
