"""End to end with simulated SGLang workers, and a mixed vLLM + SGLang fleet.

SGLang publishes no extra keys: image pages carry its pad values, derived from the
``mm_hashes`` the router forwards on ``/generate``. The router's SGLang token view
fills image spans with the same pad values (by release), so a repeat lands on the
holder and the predicted overlap equals ``meta_info.cached_tokens``.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.e2e_helpers import (QWEN25_VL, Fleet, data_url, image_message, metric_value, png_bytes, running_sims,
                               start_fleet, start_sims)

pytestmark = pytest.mark.asyncio

PS = 16
SYSTEM = {"role": "system", "content": "You are a careful visual assistant for a museum archive. " * 8}


def _text_conv(i: int, system: dict = SYSTEM) -> list[dict]:
    return [system, {"role": "user", "content": f"Tell me about exhibit number {i}. " * (5 + i)}]


def _image_conv(color: tuple[int, int, int], size=(640, 480), system: dict = SYSTEM) -> list[dict]:
    return [system, image_message(data_url(png_bytes(*size, color)), "What is in this image?")]


def _system(i: int) -> dict:
    return {"role": "system", "content": f"Archive desk {i}. " * 20}


async def _cached_from(data: dict) -> int:
    details = data["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


async def _repeat_lands_on_holder(fleet: Fleet, conv: list[dict], times: int = 3) -> tuple[str, list[float]]:
    """Send ``conv`` ``times`` times; every request's cached tokens must equal the
    prediction, repeats must land on the first one's worker. Returns that worker and
    the predicted hit rate of each request."""
    holder = None
    rates = []
    for rep in range(times):
        ex = await fleet.explain({"model": "m", "messages": conv})
        p, blocks = ex["prompt_tokens"], ex["blocks"]
        cands = {c["worker"]: c for c in ex["candidates"]}
        worker, data = await fleet.chat(conv)
        assert data["usage"]["prompt_tokens"] == p
        if max(c["overlap_blocks"] for c in cands.values()) > 0:
            assert worker == ex["worker"], (worker, ex)
        if rep == 0:
            holder = worker
        else:
            assert worker == holder, f"repeat {rep} went to {worker}, held by {holder}"
            assert cands[holder]["overlap_blocks"] == p // PS, ex
        assert await _cached_from(data) == cands[worker]["predicted_cached_tokens"]
        rates.append(cands[worker]["overlap_blocks"] / blocks)
        await fleet.sync()
    assert rates[1:] == [(p // PS) / -(-p // PS)] * (times - 1)
    return holder, rates


@pytest.fixture(scope="module")
def sglang_sims():
    with running_sims(3, QWEN25_VL, ["--backend", "sglang", "--block-size", str(PS), "--num-blocks", "8192"]) as procs:
        yield procs


async def test_sglang_fleet_discovery_text_and_images(sglang_sims):
    # URL-only specs: backend, KV endpoint and page size come from /server_info.
    fleet = await start_fleet(sglang_sims, QWEN25_VL, bare_specs=True)
    try:
        async with fleet.session.get(fleet.url + "/router/workers") as r:
            ws = (await r.json())["workers"]
        assert {w["backend"] for w in ws} == {"sglang"}
        assert all(w["kv_sources"][0]["endpoint"] == s.info["kv_endpoint"] for w, s in zip(ws, fleet.sims))
        assert all(w["page_size"] == PS for w in ws)

        text = await fleet.metrics_text()
        s0, c0 = metric_value(text, "mmroute_predicted_hit_rate_sum"), metric_value(text, "mmroute_predicted_hit_rate_count")
        limits = []
        for conv in (_text_conv(1), _text_conv(2), _image_conv((10, 200, 10)), _image_conv((10, 10, 200), (1024, 768))):
            holder, rates = await _repeat_lands_on_holder(fleet, conv)
            limits += rates
            ex = await fleet.explain({"model": "m", "messages": conv})
            assert {c["worker"]: c["view"] for c in ex["candidates"]}[holder].startswith("sglang")
        text = await fleet.metrics_text()
        n = metric_value(text, "mmroute_predicted_hit_rate_count") - c0
        assert n == len(limits)
        assert (metric_value(text, "mmroute_predicted_hit_rate_sum") - s0) == pytest.approx(sum(limits), abs=1e-9)
        assert metric_value(text, "mmroute_prediction_mismatch_total") == 0
        # A different image with the same text gets credit only for the pages before it.
        ex = await fleet.explain({"model": "m", "messages": _image_conv((99, 1, 1))})
        first = ex["mm_items"][0]["offset"]
        assert max(c["overlap_blocks"] for c in ex["candidates"]) == first // PS
    finally:
        await fleet.close()


@pytest.mark.parametrize("version", ["0.5.22"])
async def test_sglang_legacy_pad_values(version):
    sims = start_sims(2, QWEN25_VL, ["--backend", "sglang", "--sglang-version", version, "--block-size", str(PS)])
    fleet = await start_fleet(sims, QWEN25_VL, own_sims=True)
    try:
        await _repeat_lands_on_holder(fleet, _image_conv((1, 2, 3)))
        ex = await fleet.explain({"model": "m", "messages": _image_conv((1, 2, 3))})
        assert {c["view"] for c in ex["candidates"]} == {"sglang:legacy"}
    finally:
        await fleet.close()


async def test_sglang_build_ignoring_mm_hashes_is_detected():
    sims = start_sims(1, QWEN25_VL, ["--backend", "sglang", "--sglang-ignore-mm-hashes", "--block-size", str(PS)])
    fleet = await start_fleet(sims, QWEN25_VL, own_sims=True)
    try:
        w = fleet.ctx.registry.get("w0")
        for color in ((5, 5, 5), (6, 6, 6)):
            await fleet.chat(_image_conv(color))
            await fleet.sync()
        # Each image request is checked in the background: wait for both verdicts.
        for _ in range(200):
            if not w.mm_hashes_ok:
                break
            await asyncio.sleep(0.05)
        assert w.mm_hashes_ok is False
        text = await fleet.metrics_text()
        assert metric_value(text, "mmroute_mm_fallback_total", {"reason": "sglang_ignores_mm_hashes"}) == 1
        ex = await fleet.explain({"model": "m", "messages": _image_conv((5, 5, 5))})
        assert ex["candidates"][0]["view"] == "sglang:text"
        assert ex["candidates"][0]["overlap_blocks"] == ex["mm_items"][0]["offset"] // PS
    finally:
        await fleet.close()


async def test_mixed_fleet_scores_each_worker_with_its_own_view():
    sims = start_sims(4, QWEN25_VL, ["--block-size", str(PS)],
                      per_worker=[[], [], ["--backend", "sglang"], ["--backend", "sglang"]])
    fleet = await start_fleet(sims, QWEN25_VL, own_sims=True, names=["v0", "v1", "s0", "s1"])
    try:
        ex = await fleet.explain({"model": "m", "messages": _image_conv((7, 7, 7))})
        views = {c["worker"]: c["view"] for c in ex["candidates"]}
        assert views == {"v0": "vllm", "v1": "vllm", "s0": "sglang:wide", "s1": "sglang:wide"}
        holders = set()
        # Distinct prefixes: the first pass spreads them (ties go to the emptiest worker).
        for conv in (_image_conv((7, 7, 7), system=_system(1)), _image_conv((8, 8, 8), system=_system(2)),
                     _text_conv(3, _system(3)), _text_conv(4, _system(4)),
                     _image_conv((9, 9, 9), (480, 640), system=_system(5))):
            holder, _ = await _repeat_lands_on_holder(fleet, conv)
            holders.add(holder)
        assert holders & {"v0", "v1"} and holders & {"s0", "s1"}, holders
        assert metric_value(await fleet.metrics_text(), "mmroute_prediction_mismatch_total") == 0
    finally:
        await fleet.close()


async def test_stream_disconnect_cancels_upstream_and_releases_booking():
    sims = start_sims(1, QWEN25_VL, ["--backend", "sglang", "--decode-ms-per-token", "20"])
    fleet = await start_fleet(sims, QWEN25_VL, own_sims=True)
    try:
        body = {"model": "m", "messages": _image_conv((3, 3, 3)), "max_tokens": 500, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                assert r.headers["x-mmroute-worker"] == "w0"
                first = await r.content.readline()
                assert first.startswith(b"data: ")
                assert fleet.ctx.scheduler.active_bookings == 1
            # leaving the block closes the connection mid-stream
        for _ in range(200):  # the proxy notices the disconnect within its poll interval
            if fleet.ctx.scheduler.active_bookings == 0:
                break
            await asyncio.sleep(0.05)
        assert fleet.ctx.scheduler.active_bookings == 0
        for _ in range(200):  # the worker saw the request cancelled
            async with fleet.session.get(fleet.sims[0].url + "/metrics") as r:
                running = metric_value(await r.text(), "sglang:num_running_reqs")
            if running == 0:
                break
            await asyncio.sleep(0.05)
        assert running == 0
    finally:
        await fleet.close()


async def test_stream_translation_of_generate(sglang_sims):
    fleet = await start_fleet(sglang_sims[:1], QWEN25_VL, names=["w0"])
    try:
        body = {"model": "m", "messages": _image_conv((4, 4, 4)), "max_tokens": 7, "stream": True,
                "stream_options": {"include_usage": True}}
        async with fleet.session.post(fleet.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            raw = (await r.read()).decode()
        events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        import json

        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        finals = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
        assert finals and finals[-1]["choices"][0]["finish_reason"] == "length"
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 7 and usage["prompt_tokens"] > 391
        assert text  # the generated filler text, reassembled from deltas
        # Non-streaming: the same text as one object.
        body.pop("stream_options")
        body["stream"] = False
        st, data, _ = await fleet.post("/v1/chat/completions", body)
        assert st == 200 and data["object"] == "chat.completion"
        assert data["choices"][0]["message"]["content"] == text
    finally:
        await fleet.close()
