"""OpenAI-endpoint pass-through (vLLM, or SGLang's OpenAI surface) with usage capture.

What the client receives is what the worker sent, byte for byte, with one exception:
for a streamed request whose client did not ask for ``stream_options.include_usage``
the proxy asks for it upstream (to learn ``cached_tokens``) and drops the final
usage-only chunk (``"choices": []``) again (ENGINES.md §2.5 allows exactly this).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from mmroute.proxy.common import (
    ClientStream,
    ProxyHooks,
    SSESplitter,
    StreamFailure,
    UpstreamChunks,
    Usage,
    post_and_relay,
    read_error_body,
    read_whole,
    sse_data,
    timed_out,
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

    async def relay(resp: aiohttp.ClientResponse, out_headers: dict[str, str]) -> web.StreamResponse:
        if resp.status >= 400:
            # The worker's OpenAI error, unchanged.
            err = await read_error_body(resp, 1024 * 1024)
            hooks.complete("error")
            return web.Response(body=err, status=resp.status, content_type=resp.content_type, headers=out_headers)
        if resp.content_type == "text/event-stream":
            return await _relay_stream(request, resp, worker, out_headers, hooks, strip_usage)
        return await _relay_whole(resp, worker, out_headers, hooks)

    return await post_and_relay(
        request, upstream, worker, path, data, request_id=request_id, hooks=hooks, headers=headers, relay=relay
    )


async def _relay_whole(
    resp: aiohttp.ClientResponse, worker: Worker, out_headers: dict[str, str], hooks: ProxyHooks
) -> web.Response:
    payload = await read_whole(resp, worker)
    if payload is None:
        return timed_out(worker, out_headers, hooks)
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
    client = ClientStream(request, hooks, out_headers, resp, status=resp.status)
    if not await client.open():
        return client.out
    splitter = SSESplitter()
    first = True
    saw_done = False
    usage: Usage | None = None
    chunks = UpstreamChunks(resp, worker, timeout_status=502)  # this relay reports every stream failure as 502
    async for chunk in chunks:
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
        if keep and not await client.send(b"".join(keep)):
            return client.out
    failure = chunks.failure
    rest = splitter.rest()
    if rest.strip() and failure is None:
        if not await client.send(rest + b"\n\n"):
            return client.out
    if usage is not None:
        hooks.usage(usage)
    if failure is None and not saw_done:
        failure = StreamFailure("upstream_error", 502, f"worker {worker.id} ended the stream without [DONE]")
    return await client.finish(failure)
