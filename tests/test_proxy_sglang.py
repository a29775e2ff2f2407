"""SGLang /generate: body building, and translation to OpenAI objects through real servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from proxy_helpers import RETRY_STATUS, FakeWorker, HookLog, make_worker, mini_router, serve, upstream_for_tests

from mmroute.errors import RouterError
from mmroute.proxy import Usage, build_generate_body, generate_unsupported, proxy_sglang_generate
from mmroute.proxy.sglang import TextDeltas

HASH = "deadbeefcafe1234"


def gen_event(text: str, *, finish: dict | None = None, completion: int = 1, ids: list[int] | None = None) -> dict:
    return {
        "text": text,
        "output_ids": ids if ids is not None else list(range(completion)),
        "meta_info": {
            "id": "req-7", "finish_reason": finish, "prompt_tokens": 418, "completion_tokens": completion,
            "cached_tokens": 400, "weight_version": "default",
        },
    }


def raw_sse(obj: Any) -> bytes:
    # SGLang's own framing: compact JSON, UTF-8 (not ASCII-escaped).
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class FakeSGLang(FakeWorker):
    path = "/generate"


@contextlib.asynccontextmanager
async def router(worker_url: str, *, include_usage: bool = False, incremental: bool = False) -> AsyncIterator[tuple[str, HookLog]]:
    upstream = upstream_for_tests()
    worker = make_worker(worker_url, name="sg", backend="sglang")
    worker.incremental_stream = incremental
    log = HookLog()

    async def forward(request: web.Request) -> web.StreamResponse:
        chat = await request.json()
        body = build_generate_body(chat, "<prompt>", ["data:image/png;base64,AAAA"], [HASH], "req-7")
        return await proxy_sglang_generate(
            request, upstream, worker, body, model="qwen", stream=chat.get("stream") is True,
            include_usage=include_usage, request_id="req-7", hooks=log.hooks(),
        )

    async with mini_router("/v1/chat/completions", forward, upstream) as url:
        yield url, log


async def post(url: str, body: dict) -> tuple[int, bytes, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            raw = await asyncio.wait_for(r.read(), 10)
            return r.status, raw, r.headers


def events_of(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for e in raw.split(b"\n\n"):
        if not e:
            continue
        assert e.startswith(b"data: ")
        payload = e[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def streaming_handler(objs: list[Any], *, split_bytes: bool = False, then: str = "done", gate_after_first: bool = False):
    async def h(fw: FakeSGLang, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        rest = objs
        if gate_after_first:  # the client holds the first output before the failure comes
            await resp.write(raw_sse(objs[0]))
            await fw.gate.wait()
            rest = objs[1:]
        data = b"".join(raw_sse(o) for o in rest)
        if split_bytes:  # one byte at a time: multi-byte characters split across TCP chunks
            for i in range(len(data)):
                await resp.write(data[i:i + 1])
        else:
            await resp.write(data)
        if then == "done":
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        elif then == "drop":
            request.transport.close()
        return resp

    return h


# ---- body building --------------------------------------------------------------------------


def test_build_generate_body_mapping():
    chat = {
        "model": "qwen", "messages": [], "stream": True, "max_tokens": 10, "max_completion_tokens": 20,
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": ["</s>"], "seed": 7, "frequency_penalty": 0.1,
        "presence_penalty": 0.2, "min_tokens": 2, "response_format": {"type": "json_object"}, "cache_salt": "s1",
        "n": 1,
    }
    body = build_generate_body(chat, "TEXT", ["http://img/1.png", "data:image/png;base64,AA"], ["a" * 16, "b" * 16], "rid-1")
    assert body == {
        "text": "TEXT",
        "sampling_params": {
            "max_new_tokens": 20, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": ["</s>"],
            "sampling_seed": 7, "frequency_penalty": 0.1, "presence_penalty": 0.2, "min_new_tokens": 2,
            "json_schema": '{"type": "object"}',
        },
        "stream": True,
        "rid": "rid-1",
        "image_data": ["http://img/1.png", "data:image/png;base64,AA"],
        "mm_hashes": ["a" * 16, "b" * 16],
        "extra_key": "s1",
    }
    plain = build_generate_body({"messages": []}, "T", [], None, "r", default_max_new_tokens=99)
    assert plain == {"text": "T", "sampling_params": {"max_new_tokens": 99}, "stream": False, "rid": "r"}
    assert build_generate_body({"max_tokens": 3}, "T", [], None, "r")["sampling_params"] == {"max_new_tokens": 3}
    assert build_generate_body({}, "T", [], None, "r")["sampling_params"] == {"max_new_tokens": None}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sp = build_generate_body({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                             "T", [], None, "r")["sampling_params"]
    assert json.loads(sp["json_schema"]) == schema


def test_build_generate_body_rejects():
    with pytest.raises(RouterError) as ei:
        build_generate_body({"n": 2}, "T", [], None, "r")
    assert ei.value.status == 400 and ei.value.param == "n"
    with pytest.raises(RouterError):
        build_generate_body({"temperature": "hot"}, "T", [], None, "r")
    with pytest.raises(RouterError):
        build_generate_body({"max_tokens": -1}, "T", [], None, "r")
    with pytest.raises(RouterError):
        build_generate_body({"stop": [1]}, "T", [], None, "r")
    with pytest.raises(ValueError, match="mm_hashes"):
        build_generate_body({}, "T", ["u1", "u2"], ["a" * 16], "r")
    assert generate_unsupported({"tools": [{"type": "function"}]}) == "tools"
    assert generate_unsupported({"tools": [{"type": "function"}], "tool_choice": "none"}) is None
    assert generate_unsupported({"logprobs": True}) == "logprobs"
    assert generate_unsupported({"n": 3}) == "n"
    assert generate_unsupported({"messages": []}) is None


# ---- text deltas ----------------------------------------------------------------------------


def test_text_deltas_hold_back_replacement_characters():
    d = TextDeltas()
    assert [d.update(t, False) for t in ["H", "H\ufffd", "Hé", "Hé\ufffd\ufffd"]] == ["H", "", "é", ""]
    assert d.update("Hé😀", True) == "😀"
    # The brief's sequence: the character before a U+FFFD is held too, so "e" -> "é" is safe.
    d = TextDeltas()
    got = [d.update(t, f) for t, f in [("H", False), ("He\ufffd", False), ("Hé", False), ("Hé😀", True)]]
    assert "".join(got) == "Hé😀" and not any("\ufffd" in g for g in got)
    # A real U+FFFD at the very end is emitted.
    d = TextDeltas()
    assert d.update("a\ufffd", False) == "" and d.update("a\ufffd", True) == "a\ufffd"


def test_text_deltas_non_prefix_update_never_duplicates():
    d = TextDeltas()
    assert d.update("Hello", False) == "Hello"
    assert d.update("Help!!", False) == "!"  # revised "lo" -> "p!": continue after the 5 chars sent
    assert d.revised
    assert d.update("Help!! ok", True) == " ok"
    assert d.update("short", True) == ""  # shrinking text: nothing, never an exception


def test_text_deltas_incremental_mode():
    d = TextDeltas(incremental=True)
    assert [d.update(t, False) for t in ["He", "l\ufffd", "😀x"]] == ["He", "l", "\ufffd😀x"]
    d = TextDeltas(incremental=True)
    assert d.update("a\ufffd", False) == "a" and d.update("", True) == "\ufffd"


# ---- non-streaming --------------------------------------------------------------------------


async def test_non_stream_translation_fields_and_usage():
    async def h(fw: FakeSGLang, request: web.Request) -> web.Response:
        return web.json_response(gen_event("Hé!", finish={"type": "length", "length": 3}, completion=3))

    fw = FakeSGLang(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        status, raw, headers = await post(url, {"model": "qwen", "messages": [], "max_tokens": 3})
    assert status == 200 and headers["x-mmroute-worker"] == "sg" and headers["x-request-id"] == "req-7"
    obj = json.loads(raw)
    assert obj["id"] == "chatcmpl-req-7" and obj["object"] == "chat.completion" and obj["model"] == "qwen"
    assert isinstance(obj["created"], int)
    assert obj["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hé!"}, "logprobs": None,
                               "finish_reason": "length"}]
    assert obj["usage"] == {"prompt_tokens": 418, "completion_tokens": 3, "total_tokens": 421,
                            "prompt_tokens_details": {"cached_tokens": 400}}
    sent = fw.bodies[0]
    assert sent["stream"] is False and sent["rid"] == "req-7" and sent["mm_hashes"] == [HASH]
    assert sent["sampling_params"]["max_new_tokens"] == 3 and sent["text"] == "<prompt>"
    assert log.usage == [Usage(418, 3, 400)] and log.first_token == 1 and log.outcomes == ["ok"]


async def test_non_stream_abort_4xx_and_5xx():
    answers: list[web.Response] = [
        web.json_response(gen_event("", finish={"type": "abort", "message": "too long", "status_code": 400})),
        web.json_response(gen_event("", finish={"type": "abort", "message": "retracted"})),
        web.json_response({"error": {"message": "Input is too long"}}, status=400),
        web.Response(text="Internal Server Error", status=500),
    ]

    async def h(fw: FakeSGLang, request: web.Request) -> web.Response:
        return answers.pop(0)

    fw = FakeSGLang(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        status, raw, _ = await post(url, {"messages": []})
        assert status == 400 and json.loads(raw)["error"]["message"] == "too long"
        status, raw, _ = await post(url, {"messages": []})
        assert status == RETRY_STATUS and json.loads(raw)["status"] == 503 and "retracted" in json.loads(raw)["retryable"]
        status, raw, _ = await post(url, {"messages": []})
        err = json.loads(raw)["error"]
        assert status == 400 and err["message"] == "Input is too long" and err["type"] == "BadRequestError"
        status, raw, _ = await post(url, {"messages": []})
        assert status == RETRY_STATUS and json.loads(raw)["status"] == 500


# ---- streaming ------------------------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [False, True])
async def test_stream_multibyte_split_across_chunks(include_usage: bool):
    objs = [
        gen_event("H", completion=1),
        gen_event("H\ufffd", completion=2),
        gen_event("Hé", completion=3),
        gen_event("Hé\ufffd", completion=4),
        gen_event("Hé😀", completion=5, finish={"type": "stop", "matched": 151645}),
    ]
    fw = FakeSGLang(streaming_handler(objs, split_bytes=True))
    async with serve(fw.app) as wurl, router(wurl, include_usage=include_usage) as (url, log):
        status, raw, headers = await post(url, {"messages": [], "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    evs = events_of(raw)
    assert evs[-1] == "[DONE]"
    chunks = [e for e in evs[:-1] if e["choices"]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-req-7" and c["model"] == "qwen" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:]]
    assert contents == ["H", "é", "😀"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    usage_chunks = [e for e in evs[:-1] if not e["choices"]]
    if include_usage:
        assert usage_chunks == [{"id": "chatcmpl-req-7", "object": "chat.completion.chunk", "created": chunks[0]["created"],
                                 "model": "qwen", "choices": [],
                                 "usage": {"prompt_tokens": 418, "completion_tokens": 5, "total_tokens": 423,
                                           "prompt_tokens_details": {"cached_tokens": 400}}}]
    else:
        assert usage_chunks == []
    assert fw.bodies[0]["stream"] is True
    assert log.usage == [Usage(418, 5, 400)] and log.first_token == 1 and log.outcomes == ["ok"]


async def test_stream_incremental_worker():
    objs = [gen_event("Hel", completion=1), gen_event("lo", completion=2, finish={"type": "length", "length": 2})]
    fw = FakeSGLang(streaming_handler(objs))
    async with serve(fw.app) as wurl, router(wurl, incremental=True) as (url, log):
        _, raw, _ = await post(url, {"messages": [], "stream": True})
    chunks = [e for e in events_of(raw)[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:]] == ["Hel", "lo"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_stream_is_not_buffered():
    async def h(fw: FakeSGLang, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(raw_sse(gen_event("Hi")))
        await fw.gate.wait()
        await resp.write(raw_sse(gen_event("Hi there", completion=2, finish={"type": "stop"})) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    fw = FakeSGLang(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json={"messages": [], "stream": True}) as r:
                first = json.loads((await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10))[6:])
                second = json.loads((await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10))[6:])
                assert first["choices"][0]["delta"]["role"] == "assistant"
                assert second["choices"][0]["delta"] == {"content": "Hi"}
                fw.gate.set()
                rest = events_of(await asyncio.wait_for(r.read(), 10))
    assert rest[0]["choices"][0]["delta"] == {"content": " there"} and rest[0]["choices"][0]["finish_reason"] == "stop"
    assert rest[-1] == "[DONE]"


async def test_stream_midstream_abort_error_and_drop():
    cases = [
        ([gen_event("Hi"), gen_event("", finish={"type": "abort", "message": "oom", "status_code": 500})], "done", "oom"),
        ([gen_event("Hi"), {"error": {"message": "detokenizer crashed"}}], "done", "detokenizer crashed"),
        ([gen_event("Hi")], "drop", "stream broke"),
        ([gen_event("Hi")], "done", "without a finish_reason"),
    ]
    for objs, then, needle in cases:
        fw = FakeSGLang(streaming_handler(objs, then=then, gate_after_first=True))
        async with serve(fw.app) as wurl, router(wurl) as (url, log):
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", json={"messages": [], "stream": True}) as r:
                    assert r.status == 200
                    head = b""
                    for _ in range(2):  # role chunk, then "Hi"
                        head += await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                    fw.gate.set()
                    raw = head + await asyncio.wait_for(r.read(), 10)
        evs = events_of(raw)
        assert evs[1]["choices"][0]["delta"] == {"content": "Hi"}
        assert needle in evs[2]["error"]["message"] and evs[2]["error"]["code"] == "upstream_stream_error"
        assert evs[3] == "[DONE]" and len(evs) == 4
        assert log.outcomes == ["upstream_error"]


async def test_stream_failure_before_output():
    # An abort before any output: nothing reached the client yet, so another worker may try.
    fw = FakeSGLang(streaming_handler([gen_event("", finish={"type": "abort", "message": "oom"})]))
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        status, raw, _ = await post(url, {"messages": [], "stream": True})
    assert status == RETRY_STATUS and json.loads(raw)["status"] == 503
    fw = FakeSGLang(streaming_handler([gen_event("", finish={"type": "abort", "message": "bad image", "status_code": 400})]))
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        status, raw, _ = await post(url, {"messages": [], "stream": True})
    assert status == 400 and json.loads(raw)["error"]["message"] == "bad image"
    fw = FakeSGLang(streaming_handler([], then="drop"))
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        status, raw, _ = await post(url, {"messages": [], "stream": True})
    assert status == RETRY_STATUS and log.first_token == 0


async def test_stream_client_disconnect_cancels_upstream():
    async def h(fw: FakeSGLang, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(raw_sse(gen_event("Hi")))
        await asyncio.Event().wait()
        return resp

    fw = FakeSGLang(h)
    async with serve(fw.app) as wurl, router(wurl) as (url, log):
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/v1/chat/completions", json={"messages": [], "stream": True})
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            r.close()
            await asyncio.wait_for(fw.cancelled.wait(), 10)
            await asyncio.wait_for(log.done.wait(), 10)
    assert log.outcomes == ["client_disconnect"]
