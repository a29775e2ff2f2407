"""Bad input and unhealthy upstreams get a clear OpenAI-style error with the right
status: never a hang, a stack trace or a leaked booking."""

from __future__ import annotations


import aiohttp
import pytest
from aiohttp import web

from mmroute.api.app import start_background
from mmroute.api.context import AppContext
from mmroute.config import RouterConfig, WorkerSpec
from tests.e2e_helpers import QWEN25_VL, metric_value, running_sims, start_fleet
from tests.proxy_helpers import free_port

pytestmark = pytest.mark.asyncio

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def sims():
    with running_sims(1, QWEN25_VL) as procs:
        yield procs


@pytest.fixture
async def fleet(sims):
    f = await start_fleet(sims, QWEN25_VL, names=["w0"], max_model_len=512)
    yield f
    assert f.ctx.scheduler.active_bookings == 0, "a request leaked its booking"
    await f.close()


def _assert_error(status: int, data: dict, want: int) -> None:
    assert status == want, data
    assert set(data) == {"error"}
    err = data["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    assert {"message", "type", "param", "code"} <= set(err)


@pytest.mark.parametrize(
    "raw,want",
    [
        (b"{not json", 400),
        (b"", 400),
        (b"[1, 2, 3]", 400),
        (b'"just a string"', 400),
    ],
)
async def test_malformed_bodies(fleet, raw, want):
    async with fleet.session.post(fleet.url + "/v1/chat/completions", data=raw,
                                  headers={"content-type": "application/json"}) as r:
        _assert_error(r.status, await r.json(), want)


@pytest.mark.parametrize(
    "body,want,param",
    [
        ({"model": "m", "messages": "hello"}, 400, "messages"),
        ({"model": "m", "messages": []}, 400, "messages"),
        ({"model": "m"}, 400, "messages"),
        ({"model": "m", "messages": [{"role": "user"}]}, 400, None),
        ({"model": "m", "messages": [{"content": "no role"}]}, 400, None),
        ({"model": "m", "messages": HELLO, "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "m", "messages": HELLO, "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "m", "messages": HELLO, "stream": "yes"}, 400, "stream"),
        ({"model": "m", "messages": HELLO, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"model": "m", "messages": HELLO, "cache_salt": ""}, 400, "cache_salt"),
        ({"model": "m", "messages": HELLO, "n": 0}, 400, "n"),
        ({"model": "m", "messages": HELLO, "continue_final_message": True, "add_generation_prompt": True}, 400, None),
        ({"model": 7, "messages": HELLO}, 400, "model"),
        ({"model": "no-such-model", "messages": HELLO}, 404, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": "many words " * 400}]}, 400, None),
        ({"model": "m", "messages": HELLO, "max_tokens": 100000}, 400, None),
    ],
)
async def test_invalid_chat_requests(fleet, body, want, param):
    status, data, _ = await fleet.post("/v1/chat/completions", body)
    _assert_error(status, data, want)
    if param:
        assert data["error"]["param"] == param
    if want == 404:
        assert data["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body,want",
    [
        ({"model": "m"}, 400),
        ({"model": "m", "prompt": ""}, 400),
        ({"model": "m", "prompt": []}, 400),
        ({"model": "m", "prompt": [1, "x"]}, 400),
        ({"model": "m", "prompt": [10**9]}, 400),
        ({"model": "m", "prompt": 12}, 400),
    ],
)
async def test_invalid_completions(fleet, body, want):
    status, data, _ = await fleet.post("/v1/completions", body)
    _assert_error(status, data, want)


async def test_completions_forms(fleet):
    # A string, a token-id list, and several prompts (routed on load alone: said in explain).
    for prompt in ("The quick brown fox", [785, 3974, 13876, 38835]):
        status, data, headers = await fleet.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 3})
        assert status == 200, data
        assert headers["x-mmroute-worker"] == "w0"
        assert data["usage"]["prompt_tokens"] == (4 if isinstance(prompt, list) else len(
            fleet.ctx.renderer.tokenizer.encode(prompt, True)))
    ex = await fleet.explain({"model": "m", "prompt": ["a", "b"], "endpoint": "completions"})
    assert ex["fallback"] == "multi_prompt" and ex["prompt_tokens"] == 0
    # Routed on load alone and forwarded as is (the simulator itself serves one prompt per
    # request and answers 400, which reaches the client unchanged).
    status, data, headers = await fleet.post("/v1/completions", {"model": "m", "prompt": ["a", "b"], "max_tokens": 2})
    assert headers["x-mmroute-worker"] == "w0"
    assert status == 400 and "one token prompt per request" in data["error"]["message"]
    text = await fleet.metrics_text()
    assert metric_value(text, "mmroute_routing_fallback_total", {"reason": "multi_prompt"}) == 2  # explain + request


async def test_explain_and_ops_endpoints(fleet):
    status, data, _ = await fleet.post("/router/explain", {"endpoint": "embeddings", "input": "x"})
    _assert_error(status, data, 400)
    async with fleet.session.get(fleet.url + "/health") as r:
        assert r.status == 200
    async with fleet.session.get(fleet.url + "/ready") as r:
        assert r.status == 200 and (await r.json())["healthy_workers"] == ["w0"]
    async with fleet.session.get(fleet.url + "/v1/models") as r:
        models = await r.json()
        assert [m["id"] for m in models["data"]] == ["m"] and models["data"][0]["max_model_len"] == 512
    async with fleet.session.get(fleet.url + "/router/workers") as r:
        ws = await r.json()
        w = ws["workers"][0]
        for key in ("id", "url", "backend", "healthy", "indexed_blocks", "in_flight_requests",
                    "in_flight_prefill_tokens", "last_event_seq", "event_lag_seconds"):
            assert key in w
        assert w["backend"] == "vllm" and w["healthy"] is True
    async with fleet.session.post(fleet.url + "/v1/chat/completions", data=b"x" * (80 * 1024 * 1024)) as r:
        _assert_error(r.status, await r.json(), 413)


async def test_worker_4xx_passes_through_unchanged(fleet):
    # The router accepts n=2 (vLLM does too); ask the worker something it refuses instead:
    # a LoRA adapter the router knows but the worker does not serve.
    fleet.ctx.lora_names.add("ghost-adapter")
    status, data, headers = await fleet.post("/v1/chat/completions", {"model": "ghost-adapter", "messages": HELLO})
    assert status in (400, 404), data
    assert data["error"]["message"]
    assert headers["x-mmroute-worker"] == "w0"


async def test_no_healthy_worker_is_503_with_retry_after():
    dead = f"http://127.0.0.1:{free_port()},kv=tcp://127.0.0.1:{free_port()},name=dead"
    cfg = RouterConfig(model=QWEN25_VL, served_model_name=["m"], port=0, workers=[WorkerSpec.parse(dead)],
                       health_interval=0.2)
    ctx = AppContext(cfg)
    runner, port = await start_background(cfg, ctx)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m", "messages": HELLO}) as r:
                data = await r.json()
                _assert_error(r.status, data, 503)
                assert r.headers["Retry-After"] == "1"
                assert data["error"]["code"] == "no_healthy_worker"
            async with s.get(f"http://127.0.0.1:{port}/ready") as r:
                assert r.status == 503 and r.headers["Retry-After"]
        assert ctx.scheduler.active_bookings == 0
    finally:
        await runner.cleanup()


async def test_5xx_before_first_byte_retries_on_next_worker(sims):
    """A worker answering 500 (or refusing connections) is skipped; the client sees the healthy one."""
    calls = {"n": 0}

    async def broken(request: web.Request) -> web.Response:
        if request.path in ("/health", "/version"):
            return web.json_response({"version": "0.33.0"}) if request.path == "/version" else web.Response()
        if request.path == "/metrics":
            return web.Response(text="")
        if request.method == "POST" and request.path.startswith("/v1/"):
            calls["n"] += 1
        return web.json_response({"error": {"message": "engine dead", "type": "InternalServerError"}}, status=500)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    bport = site._server.sockets[0].getsockname()[1]
    good = sims[0]
    cfg = RouterConfig(model=QWEN25_VL, served_model_name=["m"], port=0, policy="round-robin", health_interval=0.5,
                       workers=[WorkerSpec.parse(f"http://127.0.0.1:{bport},kv=tcp://127.0.0.1:{free_port()},name=bad"),
                                WorkerSpec.parse(good.spec(name="good"))])
    ctx = AppContext(cfg)
    rrunner, port = await start_background(cfg, ctx)
    try:
        await ctx.registry.wait_healthy(2, 30)
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  json={"model": "m", "messages": HELLO, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-mmroute-worker"] == "good"
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        assert calls["n"] >= 1
        assert metric_value(text, "mmroute_retries_total", {"worker": "bad", "reason": "status_500"}) == calls["n"]
        assert ctx.scheduler.active_bookings == 0
    finally:
        await rrunner.cleanup()
        await runner.cleanup()


async def test_truncate_prompt_tokens_and_cache_bypass(fleet):
    long_conv = [{"role": "user", "content": "word " * 700}]
    # Too long for max_model_len 512 unless truncated, as vLLM truncates before checking.
    status, data, _ = await fleet.post("/v1/chat/completions", {"model": "m", "messages": long_conv, "max_tokens": 2})
    assert status == 400
    body = {"model": "m", "messages": long_conv, "max_tokens": 2, "truncate_prompt_tokens": 100}
    ex = await fleet.explain(body)
    full = fleet.ctx.renderer.render_chat({"messages": long_conv}, []).token_ids
    assert ex["prompt_token_ids"] == full[-100:] and ex["prompt_tokens"] == 100
    ex = await fleet.explain({**body, "truncation_side": "right"})
    assert ex["prompt_token_ids"] == full[:100]
    for bad in (0, -2, "x"):
        status, data, _ = await fleet.post("/router/explain", {**body, "truncate_prompt_tokens": bad})
        _assert_error(status, data, 400)
    # prompt_logprobs: vLLM skips reading the cache, so no overlap is credited.
    conv = [{"role": "user", "content": "a cached question " * 20}]
    await fleet.chat(conv)
    await fleet.sync()
    ex = await fleet.explain({"model": "m", "messages": conv})
    assert ex["candidates"][0]["overlap_blocks"] > 0
    ex = await fleet.explain({"model": "m", "messages": conv, "prompt_logprobs": 1})
    assert ex["candidates"][0]["overlap_blocks"] == 0 and ex["candidates"][0]["predicted_cached_tokens"] == 0
