"""End to end, images: the router in front of 3 simulated vLLM workers (Qwen2.5-VL).

The router identifies each image by its bytes and forwards it as the part's
``uuid``; the simulated vLLM keys its blocks with that uuid verbatim (as vLLM does)
and publishes it in ``BlockStored.extra_keys``. Repeats land on the holder at the
physical hit-rate limit; another image with the same text gets no credit for the
image blocks; the same picture through another URL or encoding does.
"""

from __future__ import annotations

import logging

import pytest
from aiohttp import web

from mmroute.api.context import AppContext
from mmroute.config import RouterConfig, WorkerSpec
from mmroute.media.identity import image_identifier
from tests.e2e_helpers import QWEN25_VL, data_url, image_message, metric_value, png_bytes, running_sims, start_fleet
from tests.proxy_helpers import serve

pytestmark = pytest.mark.asyncio

BS = 16
SYSTEM = {"role": "system", "content": "You describe pictures for a catalogue. " * 12}


@pytest.fixture(scope="module")
def sims():
    with running_sims(3, QWEN25_VL, ["--num-blocks", "4096"]) as procs:
        yield procs


@pytest.fixture
async def image_server():
    """Serves images over real HTTP on 127.0.0.1 (allowed explicitly: loopback is refused by default)."""
    images: dict[str, bytes] = {}
    hits: dict[str, int] = {}

    async def handler(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        hits[name] = hits.get(name, 0) + 1
        if name not in images:
            return web.Response(status=404)
        return web.Response(body=images[name], content_type="image/jpeg" if name.endswith(".jpg") else "image/png")

    app = web.Application()
    app.router.add_get("/img/{name}", handler)
    async with serve(app, handler_cancellation=False) as url:
        yield f"{url}/img/", images, hits


def _conv(url: str, text: str = "What is in this image?") -> list[dict]:
    return [SYSTEM, image_message(url, text)]


async def test_image_repeats_hit_and_identity_is_content(sims, image_server):
    base, images, hits = image_server
    red, blue = png_bytes(640, 480, (200, 30, 30)), png_bytes(640, 480, (30, 30, 200))
    images["red.png"] = red
    images["red-copy.png"] = red  # same bytes, another URL
    fleet = await start_fleet(sims, QWEN25_VL, media_allow_hosts=["127.0.0.1"])
    try:
        for s in sims:
            async with fleet.session.post(s.url + "/reset_prefix_cache") as r:
                assert r.status == 200
        await fleet.sync()
        conv = _conv(data_url(red))
        ex = await fleet.explain({"model": "m", "messages": conv})
        assert ex["fallback"] is None
        [item] = ex["mm_items"]
        assert item["identifier"] == image_identifier(red)
        assert item["length"] == 391  # 640x480 on Qwen2.5-VL (ENGINES.md §5.2)
        ids = ex["prompt_token_ids"]
        assert ids[item["offset"] - 1] == 151652 and ids[item["offset"] + 391] == 151653
        assert ids[item["offset"]: item["offset"] + 391] == [151655] * 391
        p = ex["prompt_tokens"]
        full = p // BS
        limit = full / -(-p // BS)

        text = await fleet.metrics_text()
        s0, c0 = (metric_value(text, "mmroute_predicted_hit_rate_sum"),
                  metric_value(text, "mmroute_predicted_hit_rate_count"))
        workers = []
        for rep in range(3):
            worker, data = await fleet.chat(conv)
            workers.append(worker)
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (0 if rep == 0 else ((p - 1) // BS) * BS)
            await fleet.sync()
            if rep == 0:
                text = await fleet.metrics_text()
                s1, c1 = (metric_value(text, "mmroute_predicted_hit_rate_sum"),
                          metric_value(text, "mmroute_predicted_hit_rate_count"))
                assert (s1 - s0, c1 - c0) == (0.0, 1.0)
        assert len(set(workers)) == 1
        holder = workers[0]
        text = await fleet.metrics_text()
        n = metric_value(text, "mmroute_predicted_hit_rate_count") - c1
        mean = (metric_value(text, "mmroute_predicted_hit_rate_sum") - s1) / n
        assert n == 2 and mean == pytest.approx(limit, abs=1e-9)
        assert metric_value(text, "mmroute_prediction_mismatch_total") == 0

        # The same text with another image: credit only for the blocks before the image.
        ex_blue = await fleet.explain({"model": "m", "messages": _conv(data_url(blue))})
        [blue_item] = ex_blue["mm_items"]
        assert blue_item["identifier"] != item["identifier"]
        ov = {c["worker"]: c["overlap_blocks"] for c in ex_blue["candidates"]}
        assert ov[holder] == item["offset"] // BS
        assert ov[holder] < full
        _, data = await fleet.chat(_conv(data_url(blue)))
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == (item["offset"] // BS) * BS
        await fleet.sync()

        # The same picture by http URL (twice: fetched once) and by JPEG-free re-encoding of the URL: full credit.
        for url in (base + "red.png", base + "red-copy.png"):
            ex_url = await fleet.explain({"model": "m", "messages": _conv(url)})
            assert ex_url["mm_items"][0]["identifier"] == item["identifier"]
            assert {c["worker"]: c["overlap_blocks"] for c in ex_url["candidates"]}[holder] == full
            worker, data = await fleet.chat(_conv(url))
            assert worker == holder
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == ((p - 1) // BS) * BS
        assert hits["red.png"] >= 1
    finally:
        await fleet.close()


async def test_image_in_earlier_turn_and_two_images(sims):
    a, b = png_bytes(320, 240, (1, 2, 3)), png_bytes(100, 2000, (9, 9, 9))
    conv = [SYSTEM, image_message(data_url(a), "First picture."),
            {"role": "assistant", "content": "A dark picture."},
            {"role": "user", "content": [{"type": "text", "text": "And these two?"},
                                         {"type": "image_url", "image_url": {"url": data_url(b)}},
                                         {"type": "image_url", "image_url": {"url": data_url(a)}}]}]
    fleet = await start_fleet(sims, QWEN25_VL)
    try:
        ex = await fleet.explain({"model": "m", "messages": conv})
        items = ex["mm_items"]
        assert [i["identifier"] for i in items] == [image_identifier(a), image_identifier(b), image_identifier(a)]
        assert [i["length"] for i in items] == [
            (252 // 14) * (308 // 14) // 4,  # 320x240 -> 252x308
            (1988 // 14) * (112 // 14) // 4,  # 100x2000 -> 1988x112 (ENGINES.md §5.2: 284)
            (252 // 14) * (308 // 14) // 4,
        ]
        worker, data = await fleet.chat(conv)
        await fleet.sync()
        worker2, data2 = await fleet.chat(conv)
        assert worker2 == worker
        p = data2["usage"]["prompt_tokens"]
        assert p == ex["prompt_tokens"]
        assert data2["usage"]["prompt_tokens_details"]["cached_tokens"] == ((p - 1) // BS) * BS
    finally:
        await fleet.close()


@pytest.mark.parametrize(
    "url,status,code",
    [
        (data_url(png_bytes(64, 64)[:-40]), 400, "invalid_image"),  # truncated
        ("data:text/plain;base64,aGVsbG8=", 400, None),  # wrong type
        (data_url(b"not an image at all, really"), 400, "invalid_image"),
        ("data:image/png;base64,@@@not-base64@@@", 400, None),
        ("http://169.254.169.254/latest/meta-data/x.png", 400, "forbidden_address"),  # metadata address
        ("http://10.1.2.3/x.png", 400, "forbidden_address"),  # private address
        ("ftp://example.com/x.png", 400, None),
    ],
)
async def test_bad_images_get_clear_400(sims, url, status, code):
    fleet = await start_fleet(sims[:1], QWEN25_VL, names=["w0"])
    try:
        st, data, _ = await fleet.post("/v1/chat/completions",
                                       {"model": "m", "messages": _conv(url), "max_tokens": 2})
        assert st == status, data
        assert "error" in data and data["error"]["message"]
        if code:
            assert data["error"]["code"] == code
        assert fleet.ctx.scheduler.active_bookings == 0
    finally:
        await fleet.close()


async def test_decompression_bomb_is_refused(sims):
    import struct
    import zlib

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF)

    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 1024)) + chunk(b"IEND", b""))
    fleet = await start_fleet(sims[:1], QWEN25_VL, names=["w0"])
    try:
        st, data, _ = await fleet.post("/v1/chat/completions",
                                       {"model": "m", "messages": _conv(data_url(bomb)), "max_tokens": 2})
        assert st == 400 and data["error"]["code"] == "image_too_large", data
    finally:
        await fleet.close()


async def test_unreachable_image_falls_back_to_text_prefix(sims):
    """The router cannot fetch the image: route on the text before it, send no uuid, say why."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    fleet = await start_fleet(sims[:1], QWEN25_VL, names=["w0"], media_allow_hosts=["127.0.0.1"])
    try:
        ex = await fleet.explain({"model": "m", "messages": _conv(f"http://127.0.0.1:{port}/x.png")})
        assert ex["fallback"] == "image_unresolved" or ex["fallback"].startswith("image")
        assert ex["mm_items"] == []
        # Only the text before the image is keyed: the system prompt and the user header.
        toks = ex["prompt_token_ids"]
        assert toks[-1] == 151652 or 151652 not in toks
        text = await fleet.metrics_text()
        assert metric_value(text, "mmroute_mm_fallback_total") >= 1
    finally:
        await fleet.close()


async def test_startup_log_states_multimodal_status(caplog):
    caplog.set_level(logging.INFO, logger="mmroute")
    AppContext(RouterConfig(model=QWEN25_VL, workers=[WorkerSpec.parse("http://127.0.0.1:1")]))
    assert any("multimodal routing enabled" in r.getMessage() and "qwen" in r.getMessage().lower()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    caplog.clear()
    import os

    text_model = os.path.join(os.path.dirname(QWEN25_VL), "Qwen__Qwen2.5-0.5B-Instruct")
    AppContext(RouterConfig(model=text_model, workers=[WorkerSpec.parse("http://127.0.0.1:1")]))
    assert any("multimodal routing disabled" in r.getMessage() for r in caplog.records)
