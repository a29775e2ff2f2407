"""OpenAI-endpoint pass-through (vLLM, or SGLang's OpenAI surface) with usage capture.

What the client receives is what the worker sent, byte for byte, with one exception:
for a streamed request whose client did not ask for ``stream_options.include_usage``
the proxy asks for it upstream (to learn ``cached_tokens``) and drops the final
usage-only chunk (``"choices": []``) again (ENGINES.md §2.5 allows exactly this).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from mmroute.proxy.common import (
    CONNECT_ERRORS,
    DONE_EVENT,
    SSE_HEADERS,
    ClientWatch,
    ProxyHooks,
    RetryableUpstreamError,
    SSESplitter,
    Usage,
    client_eof,
    client_gone,
    client_write,
    error_event,
    error_response,
    read_error_body,
    response_headers,
    sse_data,
    upstream_headers,
    usage_from,
)
from mmroute.proxy.upstream import Upstream
from mmroute.workers.registry import Worker


def with_usage_requested(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body to send upstream, and whether the usage-only chunk must be stripped."""
    if body.get("stream") is not True:
        return body, False
    so = body.get("stream_options")
    if isinstance(so, dict) and so.get("include_usage"):
        return body, False
    so2 = dict(so) if isinstance(so, dict) else {}
    so2["include_usage"] = True
    # vLLM applies continuous_usage_stats only together with include_usage: keep it off so
    # the client's chunks stay exactly what it asked for.
    so2["continuous_usage_stats"] = False
    return {**body, "stream_options": so2}, True


async def proxy_openai(
    request: web.Request,
    upstream: Upstream,
    worker: Worker,
    path: str,
    body: dict[str, Any],
    *,
    request_id: str,
    hooks: ProxyHooks | None = None,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Send ``body`` to ``worker.url + path`` and relay the answer to the client.

    Raises ``RetryableUpstreamError`` when nothing was sent to the client and the worker
    was unreachable or answered 5xx. Client disconnect: the upstream response is closed
    (the worker sees the cancellation) and ``asyncio.CancelledError`` propagates.
    """
    hooks = hooks or ProxyHooks()
    send_body, strip_usage = with_usage_requested(body)
    data = msgspec.json.encode(send_body)  # fast on multi-MB base64 image bodies
    out_headers = response_headers(worker.id, request_id)
    watch = ClientWatch(request)
    resp: aiohttp.ClientResponse | None = None
    try:
        try:
            resp = await upstream.session(worker).post(
                worker.url + path, data=data, headers=upstream_headers(request, request_id, headers)
            )
        except CONNECT_ERRORS as exc:
            raise RetryableUpstreamError(f"{worker.id}: {type(exc).__name__}: {exc}") from exc
        except asyncio.TimeoutError:
            hooks.complete("timeout")
            return error_response(504, f"worker {worker.id} did not answer in time", headers=out_headers)

        if resp.status >= 500:
            err = await read_error_body(resp)
            raise RetryableUpstreamError(
                f"{worker.id} answered {resp.status}", status=resp.status, body=err, content_type=resp.content_type
            )
        if resp.status >= 400:
            # The worker's OpenAI error, unchanged.
            err = await read_error_body(resp, 1024 * 1024)
            hooks.complete("error")
            return web.Response(body=err, status=resp.status, content_type=resp.content_type, headers=out_headers)
        if resp.content_type == "text/event-stream":
            return await _relay_stream(request, resp, worker, out_headers, hooks, strip_usage)
        return await _relay_whole(resp, worker, out_headers, hooks)
    except asyncio.CancelledError:
        if resp is not None:
            resp.close()  # drop the connection: the worker aborts the request
        hooks.complete("client_disconnect" if watch.fired or client_gone(request) else "cancelled")
        raise
    finally:
        watch.stop()
        if resp is not None:
            resp.release()


async def _relay_whole(
    resp: aiohttp.ClientResponse, worker: Worker, out_headers: dict[str, str], hooks: ProxyHooks
) -> web.Response:
    try:
        payload = await resp.read()
    except asyncio.TimeoutError:
        hooks.complete("timeout")
        return error_response(504, f"worker {worker.id} did not answer in time", headers=out_headers)
    except (aiohttp.ClientError, OSError) as exc:
        # Nothing went to the client yet: another worker may still answer.
        raise RetryableUpstreamError(f"{worker.id}: response broken: {type(exc).__name__}: {exc}") from exc
    hooks.first_token()
    if b'"usage"' in payload:
        try:
            u = usage_from(json.loads(payload))
        except ValueError:
            u = None
        if u is not None:
            hooks.usage(u)
    hooks.complete("ok")
    return web.Response(body=payload, status=resp.status, content_type=resp.content_type, charset=resp.charset, headers=out_headers)


async def _relay_stream(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    worker: Worker,
    out_headers: dict[str, str],
    hooks: ProxyHooks,
    strip_usage: bool,
) -> web.StreamResponse:
    out = web.StreamResponse(status=resp.status, headers={**SSE_HEADERS, **out_headers})
    try:
        await out.prepare(request)
    except (ConnectionError, aiohttp.ClientConnectionError):
        resp.close()
        hooks.complete("client_disconnect")
        return out
    splitter = SSESplitter()
    first = True
    saw_done = False
    usage: Usage | None = None
    failure: tuple[str, str] | None = None  # (outcome, message)
    while True:
        try:
            chunk = await resp.content.readany()
        except asyncio.TimeoutError:
            failure = ("timeout", f"worker {worker.id} stopped streaming (timeout)")
            break
        except (aiohttp.ClientError, OSError) as exc:
            failure = ("upstream_error", f"worker {worker.id} stream broke: {type(exc).__name__}: {exc}")
            break
        if not chunk:
            break
        events = splitter.feed(chunk)
        if not events:
            continue
        keep: list[bytes] = []
        for ev in events:
            payload = sse_data(ev)
            if payload is None:
                keep.append(ev)  # comment / keep-alive
                continue
            if payload == b"[DONE]":
                saw_done = True
                keep.append(ev)
                continue
            if first:
                first = False
                hooks.first_token()
            if b'"usage"' in payload:
                try:
                    obj = json.loads(payload)
                except ValueError:
                    obj = None
                u = usage_from(obj)
                if u is not None:
                    usage = u
                    if strip_usage and obj.get("choices") == []:
                        continue  # the usage chunk the client did not ask for
            keep.append(ev)
        if keep and not await client_write(out, b"".join(keep)):
            resp.close()
            hooks.complete("client_disconnect")
            return out
    rest = splitter.rest()
    if rest.strip() and failure is None:
        if not await client_write(out, rest + b"\n\n"):
            resp.close()
            hooks.complete("client_disconnect")
            return out
    if usage is not None:
        hooks.usage(usage)
    if failure is None and not saw_done:
        failure = ("upstream_error", f"worker {worker.id} ended the stream without [DONE]")
    if failure is not None:
        resp.close()
        await client_write(out, error_event(502, failure[1], code="upstream_stream_error") + DONE_EVENT)
        await client_eof(out)
        hooks.complete(failure[0])
        return out
    await client_eof(out)
    hooks.complete("ok")
    return out
