"""OpenAI chat/completions served by the simulated engines (vLLM 0.33 shapes).

vLLM semantics (``entrypoints/openai/chat_completion/protocol.py``; ENGINES.md §2.5):
``stream_options`` without ``stream`` is a 400; ``include_usage`` adds a final chunk
with ``choices: []``; ``continuous_usage_stats`` puts usage on every chunk;
``max_completion_tokens`` beats ``max_tokens``; ``usage.prompt_tokens_details`` is
always present (as with ``--enable-prompt-tokens-details``). SGLang reports the
details only when ``cached_tokens > 0`` (``--enable-cache-report``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Mapping

from aiohttp import web

from mmroute.errors import RouterError


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def parse_max_tokens(body: Mapping[str, Any], default: int, *, chat: bool) -> int:
    value = body.get("max_completion_tokens") if chat else None
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RouterError(400, "'max_tokens' must be an integer", param="max_tokens")
    if value < 1:
        raise RouterError(400, f"max_tokens must be at least 1, got {value}.", param="max_tokens")
    return value


def check_stream_options(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = bool(body.get("stream"))
    opts = body.get("stream_options")
    if opts is not None and not stream:
        raise RouterError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise RouterError(400, "'stream_options' must be an object", param="stream_options")
    opts = opts or {}
    return stream, bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats"))


def usage(prompt: int, completion: int, cached: int | None, *, always_details: bool) -> dict[str, Any]:
    details: dict[str, Any] | None = None
    if cached is not None and (always_details or cached > 0):
        details = {"cached_tokens": cached}
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def respond(
    request: web.Request,
    *,
    chat: bool,
    model: str,
    prompt_tokens: int,
    cached: int,
    tokens: Any,
    stream: bool,
    include_usage: bool,
    continuous_usage: bool,
    always_details: bool,
    extra_response: Mapping[str, Any] | None = None,
) -> web.StreamResponse:
    """Drain ``tokens`` (an async iterator of (id, text)) into an OpenAI response."""
    created = int(time.time())
    rid = new_id("chatcmpl-" if chat else "cmpl-")
    obj = "chat.completion" if chat else "text_completion"
    if not stream:
        ids: list[int] = []
        texts: list[str] = []
        async for tok, text in tokens:
            ids.append(tok)
            texts.append(text)
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(texts), "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            choice = {"index": 0, "text": "".join(texts), "logprobs": None, "finish_reason": "length",
                      "stop_reason": None, "prompt_logprobs": None}
        if extra_response and extra_response.get("prompt_token_ids") is not None:
            choice["token_ids"] = ids
        body["choices"] = [choice]
        body["usage"] = usage(prompt_tokens, len(ids), cached, always_details=always_details)
        body.update(extra_response or {})
        return web.json_response(body)

    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    resp = await open_sse(request)
    n = 0

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        c: dict[str, Any] = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [choice]}
        if include_usage and continuous_usage:
            c["usage"] = usage(prompt_tokens, n, None, always_details=False)
        return c

    if chat:
        await resp.write(sse(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None})))
    pending: tuple[int, str] | None = None
    async for item in tokens:
        if pending is not None:
            n += 1
            await resp.write(sse(chunk(_stream_choice(chat, pending[1], None))))
        pending = item
    if pending is not None:
        n += 1
        await resp.write(sse(chunk(_stream_choice(chat, pending[1], "length"))))
    if include_usage:
        await resp.write(sse({"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [],
                              "usage": usage(prompt_tokens, n, cached, always_details=always_details)}))
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


def _stream_choice(chat: bool, text: str, finish: str | None) -> dict[str, Any]:
    if chat:
        return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish,
                "stop_reason": None}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
