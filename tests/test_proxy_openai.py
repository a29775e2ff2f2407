"""proxy_openai between a real client, a real router app and a real fake worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from proxy_helpers import (
    RETRY_STATUS,
    FakeWorker,
    HookLog,
    free_port,
    make_worker,
    mini_router,
    serve,
    sse,
    upstream_for_tests,
)

from mmroute.proxy import RetryableUpstreamError, Usage, proxy_openai
from mmroute.proxy.common import SSESplitter, sse_data

PATH = "/v1/chat/completions"


class FakeVLLM(FakeWorker):
    path = PATH


@contextlib.asynccontextmanager
async def router(worker_url: str, *, handler_cancellation: bool = False, **up: Any) -> AsyncIterator[tuple[str, HookLog]]:
    """A minimal router: the handler the api will have, minus routing."""
    upstream = upstream_for_tests(**up)
    worker = make_worker(worker_url)
    log = HookLog()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await proxy_openai(request, upstream, worker, PATH, body, request_id="req-42", hooks=log.hooks())

    async with mini_router(PATH, forward, upstream, handler_cancellation=handler_cancellation) as url:
        yield url, log


COMPLETION = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
              "prompt_tokens_details": {"cached_tokens": 32}},
}


def chunk(content: str | None = None, *, finish: str | None = None, usage: dict | None = None) -> dict:
    c: dict = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    if usage is not None:
        c["choices"] = []
        c["usage"] = usage
    else:
        c["choices"] = [{"index": 0, "delta": {"content": content} if content is not None else {}, "finish_reason": finish}]
    return c


USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43, "prompt_tokens_details": {"cached_tokens": 16}}


async def stream_prefix(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    return resp


async def test_non_stream_passthrough_and_usage():
    raw = json.dumps(COMPLETION).encode()

    async def h(fw: FakeVLLM, request: web.Request) -> web.Response:
        return web.Response(body=raw, content_type="application/json")

    fw = FakeVLLM(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": [], "stream_options": None}) as r:
                assert r.status == 200
                assert await r.read() == raw
                assert r.headers["x-mmroute-worker"] == "w0" and r.headers["x-request-id"] == "req-42"
    assert fw.headers[0]["x-request-id"] == "req-42"
    assert fw.bodies[0] == {"model": "m", "messages": [], "stream_options": None}  # untouched when not streaming
    assert log.usage == [Usage(40, 2, 32)] and log.first_token == 1 and log.outcomes == ["ok"]


async def test_sse_is_relayed_chunk_by_chunk_and_injected_usage_is_stripped():
    events = [sse(chunk("Hel")), sse(chunk("lo")), sse(chunk(finish="stop")), sse(chunk(usage=USAGE)), b"data: [DONE]\n\n"]

    async def h(fw: FakeVLLM, request: web.Request) -> web.StreamResponse:
        resp = await stream_prefix(request)
        await resp.write(events[0])
        await fw.gate.wait()  # set by the test only once the client holds the first chunk
        # The rest in odd slices: event boundaries must not matter.
        rest = b"".join(events[1:])
        for i in range(0, len(rest), 7):
            await resp.write(rest[i:i + 7])
        await resp.write_eof()
        return resp

    fw = FakeVLLM(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": [], "stream": True}) as r:
                assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-mmroute-worker"] == "w0"
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                assert first == events[0]
                assert log.first_token == 1
                fw.gate.set()
                rest = await asyncio.wait_for(r.read(), 10)
    # Exactly the upstream bytes minus the usage chunk the client did not ask for.
    assert first + rest == events[0] + events[1] + events[2] + events[4]
    assert fw.bodies[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert log.usage == [Usage(40, 3, 16)] and log.outcomes == ["ok"]


async def test_client_requested_usage_is_forwarded_unchanged():
    events = [sse(chunk("x")), sse(chunk(finish="length")),
              sse(chunk(usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": None})),
              b"data: [DONE]\n\n"]

    async def h(fw: FakeVLLM, request: web.Request) -> web.StreamResponse:
        resp = await stream_prefix(request)
        await resp.write(b"".join(events))
        await resp.write_eof()
        return resp

    fw = FakeVLLM(h)
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json=body) as r:
                assert await r.read() == b"".join(events)
    assert fw.bodies[0] == body
    assert log.usage == [Usage(5, 1, None)]


async def test_5xx_before_first_byte_is_retryable():
    async def h(fw: FakeVLLM, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "engine dead"}}, status=503)

    fw = FakeVLLM(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": [], "stream": True}) as r:
                assert r.status == RETRY_STATUS
                js = await r.json()
    assert js["status"] == 503 and "503" in js["retryable"]
    assert log.first_token == 0 and log.outcomes == []


async def test_connection_refused_is_retryable():
    dead = f"http://127.0.0.1:{free_port()}"
    async with router(dead) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": []}) as r:
                assert r.status == RETRY_STATUS
                js = await r.json()
    assert js["status"] is None and "w0" in js["retryable"]


async def test_retryable_error_fields_directly():
    dead = make_worker(f"http://127.0.0.1:{free_port()}")
    upstream = upstream_for_tests()

    async def handle(request: web.Request) -> web.StreamResponse:
        with pytest.raises(RetryableUpstreamError) as ei:
            await proxy_openai(request, upstream, dead, PATH, {}, request_id="r")
        assert ei.value.connect_failure and ei.value.status is None
        return web.Response(text="checked")

    app = web.Application()
    app.router.add_post("/t", handle)
    try:
        async with serve(app) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/t", json={}) as r:
                assert await r.text() == "checked"
    finally:
        await upstream.close()


async def test_4xx_is_passed_through_unchanged():
    err = {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": None, "code": 400}}
    raw = json.dumps(err).encode()

    async def h(fw: FakeVLLM, request: web.Request) -> web.Response:
        return web.Response(body=raw, status=400, content_type="application/json")

    fw = FakeVLLM(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": [], "stream": True}) as r:
                assert r.status == 400 and await r.read() == raw
                assert r.headers["x-mmroute-worker"] == "w0"
    assert log.outcomes == ["error"]


@pytest.mark.parametrize("handler_cancellation", [False, True])
async def test_client_disconnect_cancels_upstream(handler_cancellation: bool):
    async def h(fw: FakeVLLM, request: web.Request) -> web.StreamResponse:
        resp = await stream_prefix(request)
        await resp.write(sse(chunk("a")))
        await asyncio.Event().wait()  # a long generation: only cancellation ends it
        return resp

    fw = FakeVLLM(h)
    async with serve(fw.app) as wurl, router(wurl, handler_cancellation=handler_cancellation) as (url, log):
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + PATH, json={"model": "m", "messages": [], "stream": True})
            assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10) == sse(chunk("a"))
            r.close()  # the client goes away mid-stream
            await asyncio.wait_for(fw.cancelled.wait(), 10)
            await asyncio.wait_for(log.done.wait(), 10)
    assert log.outcomes == ["client_disconnect"]


async def test_client_disconnect_before_first_byte_cancels_upstream():
    async def h(fw: FakeVLLM, request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()  # a long prefill, nothing sent
        raise AssertionError("unreachable")

    fw = FakeVLLM(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(s.post(url + PATH, json={"model": "m", "messages": []}))
            await asyncio.wait_for(fw.received.wait(), 10)  # the worker has the request
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(fw.cancelled.wait(), 10)


async def test_midstream_drop_gives_error_event_and_done():
    async def h(fw: FakeVLLM, request: web.Request) -> web.StreamResponse:
        resp = await stream_prefix(request)
        await resp.write(sse(chunk("par")))
        await resp.write(b'data: {"id": "chatcmpl-1", "choi')  # half an event, then the wire breaks
        request.transport.close()
        return resp

    fw = FakeVLLM(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": [], "stream": True}) as r:
                assert r.status == 200
                raw = await asyncio.wait_for(r.read(), 10)
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == sse(chunk("par"))
    err = json.loads(events[1][len(b"data: "):])
    assert err["error"]["code"] == "upstream_stream_error" and "w0" in err["error"]["message"]
    assert events[2] == b"data: [DONE]" and len(events) == 3
    assert log.outcomes == ["upstream_error"]


async def test_stream_without_done_is_terminated_cleanly():
    async def h(fw: FakeVLLM, request: web.Request) -> web.StreamResponse:
        resp = await stream_prefix(request)
        await resp.write(sse(chunk("x")))
        await resp.write_eof()  # clean end, but no [DONE]
        return resp

    fw = FakeVLLM(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": [], "stream": True}) as r:
                raw = await asyncio.wait_for(r.read(), 10)
    events = [e for e in raw.split(b"\n\n") if e]
    assert len(events) == 3 and b"without [DONE]" in events[1] and events[2] == b"data: [DONE]"


async def test_timeout_before_answer_is_504_and_midstream_timeout_is_error_event():
    async def silent(fw: FakeVLLM, request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    fw = FakeVLLM(silent)
    async with serve(fw.app) as wurl, router(wurl, request_timeout=0.2) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": []}) as r:
                assert r.status == 504
                js = await r.json()
    assert js["error"]["code"] == 504 and "did not answer" in js["error"]["message"]

    async def stalls(fw: FakeVLLM, request: web.Request) -> web.StreamResponse:
        resp = await stream_prefix(request)
        await resp.write(sse(chunk("a")))
        await asyncio.Event().wait()
        return resp

    fw2 = FakeVLLM(stalls)
    async with serve(fw2.app) as wurl, router(wurl, request_timeout=0.2) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + PATH, json={"model": "m", "messages": [], "stream": True}) as r:
                raw = await asyncio.wait_for(r.read(), 10)
    events = [e for e in raw.split(b"\n\n") if e]
    assert b"timeout" in events[1] and events[-1] == b"data: [DONE]"
    assert log.outcomes == ["timeout"]


def test_sse_splitter_any_boundaries():
    stream = b"data: a\n\n: ping\r\n\r\ndata: b\ndata: c\n\ndata: [DONE]\n\n"
    for size in range(1, len(stream) + 1):
        sp = SSESplitter()
        got: list[bytes] = []
        for i in range(0, len(stream), size):
            got += sp.feed(stream[i:i + size])
        assert b"".join(got) == stream and sp.rest() == b""
        assert [sse_data(e) for e in got] == [b"a", None, b"b\nc", b"[DONE]"]
