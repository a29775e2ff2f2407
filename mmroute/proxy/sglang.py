"""SGLang ``/generate``: request building and translation back to OpenAI chat objects.

Image requests go to SGLang's native ``/generate`` because only it accepts ``mm_hashes``
(ENGINES.md §3.3); mmroute then speaks for SGLang's OpenAI layer: ``chat.completion``
objects and ``chat.completion.chunk`` SSE, shaped like SGLang's own
``entrypoints/openai/serving_chat.py`` output. ``/generate`` streams *cumulative* text by
default (``--incremental-streaming-output`` sends deltas; ENGINES.md §3.4), so deltas are
computed here, holding back a trailing U+FFFD until the next chunk resolves it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from mmroute.errors import RouterError, bad_request
from mmroute.proxy.common import (
    DONE_EVENT,
    ClientStream,
    ProxyHooks,
    RetryableUpstreamError,
    SSESplitter,
    StreamFailure,
    UpstreamChunks,
    Usage,
    error_response,
    int_or_none,
    post_and_relay,
    read_error_body,
    read_whole,
    sse_data,
    sse_event,
    timed_out,
)
from mmroute.proxy.upstream import Upstream
from mmroute.workers.registry import Worker

log = logging.getLogger("mmroute.proxy.sglang")

REPLACEMENT = "\ufffd"

# OpenAI field -> SGLang SamplingParams field (SGLang sampling/sampling_params.py).
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "logit_bias": "logit_bias",
    "regex": "regex",
    "ebnf": "ebnf",
    "no_stop_trim": "no_stop_trim",
}
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INT_FIELDS = ("top_k", "seed", "min_tokens")


def generate_unsupported(chat_body: dict[str, Any]) -> str | None:
    """Why a chat body cannot be served through ``/generate`` (no tool/logprob parsing
    there), or None. The api may send such requests to the OpenAI endpoint instead."""
    if chat_body.get("tools") and chat_body.get("tool_choice") != "none":
        return "tools"
    if chat_body.get("logprobs") or chat_body.get("top_logprobs"):
        return "logprobs"
    n = chat_body.get("n")
    if n is not None and n != 1:
        return "n"
    return None


def build_generate_body(
    chat_body: dict[str, Any],
    prompt_text: str,
    image_urls: list[str],
    mm_hashes: list[str] | None,
    request_id: str,
    *,
    default_max_new_tokens: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body for an OpenAI chat body rendered to ``prompt_text``.

    ``max_completion_tokens`` beats ``max_tokens`` (vLLM's rule, ENGINES.md §2.5); with
    neither, ``default_max_new_tokens`` or an explicit null: SGLang's scheduler reads null
    as "up to the context length" (``managers/scheduler.py::init_req_max_new_tokens``),
    while leaving the field out would give SamplingParams' default of 128. Raises a 400
    ``RouterError`` for values /generate cannot honour.
    """
    n = chat_body.get("n")
    if n is not None and n != 1:
        raise bad_request("n must be 1 for image requests to SGLang workers", param="n")
    sp: dict[str, Any] = {}
    max_new = chat_body.get("max_completion_tokens")
    if max_new is None:
        max_new = chat_body.get("max_tokens")
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0):
        raise bad_request("max_tokens must be a non-negative integer", param="max_tokens")
    sp["max_new_tokens"] = max_new if max_new is not None else default_max_new_tokens
    for key, target in _SAMPLING_FIELDS.items():
        v = chat_body.get(key)
        if v is None:
            continue
        if key in _NUMBER_FIELDS and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise bad_request(f"{key} must be a number", param=key)
        if key in _INT_FIELDS and (not isinstance(v, int) or isinstance(v, bool)):
            raise bad_request(f"{key} must be an integer", param=key)
        if key == "stop" and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
            raise bad_request("stop must be a string or a list of strings", param="stop")
        sp[target] = v
    rf = chat_body.get("response_format")
    if isinstance(rf, dict):
        kind = rf.get("type")
        if kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema") if isinstance(rf.get("json_schema"), dict) else None
            if schema is None:
                raise bad_request("response_format.json_schema.schema is required", param="response_format")
            sp["json_schema"] = json.dumps(schema)
        elif kind == "json_object":
            sp["json_schema"] = '{"type": "object"}'  # as SGLang's OpenAI layer does
        elif kind not in (None, "text"):
            raise bad_request(f"unsupported response_format type {kind!r}", param="response_format")
    body: dict[str, Any] = {
        "text": prompt_text,
        "sampling_params": sp,
        "stream": chat_body.get("stream") is True,
        "rid": request_id,
    }
    if image_urls:
        body["image_data"] = list(image_urls)
        if mm_hashes is not None:
            if len(mm_hashes) != len(image_urls):
                # SGLang silently ignores the whole list on a count mismatch (ENGINES.md §3.3).
                raise ValueError(f"{len(mm_hashes)} mm_hashes for {len(image_urls)} images")
            body["mm_hashes"] = list(mm_hashes)
    salt = chat_body.get("cache_salt")
    if isinstance(salt, str) and salt:
        body["extra_key"] = salt  # SGLang namespaces its radix tree by it
    if extra:
        body.update(extra)
    return body


# ---- text deltas ----------------------------------------------------------------------------


def _trailing_replacements(s: str) -> int:
    k = 0
    while k < len(s) and s[len(s) - 1 - k] == REPLACEMENT:
        k += 1
    return k


class TextDeltas:
    """Turns SGLang's streamed ``text`` into deltas that never show a broken character.

    Cumulative mode (SGLang's default): ``pos`` counts the characters of the cumulative
    text already sent. A trailing U+FFFD (an incomplete multi-byte character) is held back,
    together with the one character before it (a detokenizer may merge it with the bytes
    still to come), until a later chunk resolves it; at the end everything left is sent.
    An update that does not extend what was sent (the engine revised text already
    streamed) cannot be retracted: it is logged and streaming continues after the
    characters already sent, so nothing is duplicated or lost in length.
    Incremental mode (``--incremental-streaming-output``): the texts are deltas; only a
    held-back U+FFFD tail is carried over.
    """

    __slots__ = ("incremental", "pos", "sent_prefix", "pending", "revised")

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental
        self.pos = 0
        self.sent_prefix = ""  # the upstream text[:pos] as last seen
        self.pending = ""  # incremental mode: held-back tail
        self.revised = False

    def update(self, text: str, final: bool) -> str:
        if self.incremental:
            buf = self.pending + text
            keep = 0 if final else _trailing_replacements(buf)
            self.pending = buf[len(buf) - keep:] if keep else ""
            return buf[: len(buf) - keep]
        if not text.startswith(self.sent_prefix):
            if not self.revised:
                log.warning("SGLang revised already-streamed text; continuing after the sent characters")
            self.revised = True
        new = text[self.pos:]
        if not final:
            keep = _trailing_replacements(new)
            if keep:
                new = new[: max(0, len(new) - keep - 1)]
        self.pos += len(new)
        self.sent_prefix = text[: self.pos]
        return new


# ---- response objects -----------------------------------------------------------------------


def chat_id(request_id: str) -> str:
    return request_id if request_id.startswith("chatcmpl-") else f"chatcmpl-{request_id}"


def usage_of(meta: dict[str, Any]) -> Usage:
    return Usage(int_or_none(meta.get("prompt_tokens")), int_or_none(meta.get("completion_tokens")), int_or_none(meta.get("cached_tokens")))


def usage_dict(u: Usage) -> dict[str, Any]:
    p, c = u.prompt_tokens or 0, u.completion_tokens or 0
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens} if u.cached_tokens is not None else None,
    }


class GenerateFailure(Exception):
    """An ``/generate`` answer that is an error (``{"error"}``) or an abort."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_failure(obj: Any) -> None:
    """Raise ``GenerateFailure`` for an error object or an aborted request."""
    if not isinstance(obj, dict):
        raise GenerateFailure(502, "SGLang answered something that is not a JSON object")
    err = obj.get("error")
    if err is not None:
        msg = err.get("message") if isinstance(err, dict) else str(err)
        code = int_or_none(err.get("code")) if isinstance(err, dict) else None
        raise GenerateFailure(code if code and 400 <= code < 600 else 500, str(msg or "SGLang error"))
    meta = obj.get("meta_info")
    fr = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(fr, dict) and fr.get("type") == "abort":
        code = int_or_none(fr.get("status_code"))
        msg = fr.get("message") or "the request was aborted by the SGLang worker"
        raise GenerateFailure(code if code and 400 <= code < 600 else 503, str(msg))


def finish_reason_of(meta: dict[str, Any]) -> str | None:
    """meta_info.finish_reason.type -> OpenAI finish_reason (abort is handled as an error)."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("stop", "length"):
        return kind
    return str(kind) if kind else "stop"


def chat_completion(obj: dict[str, Any], *, model: str, request_id: str, created: int) -> tuple[dict[str, Any], Usage]:
    """A non-streamed ``/generate`` answer as an OpenAI ``chat.completion`` object."""
    meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
    text = obj.get("text")
    usage = usage_of(meta)
    return (
        {
            "id": chat_id(request_id),
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text if isinstance(text, str) else ""},
                    "logprobs": None,
                    "finish_reason": finish_reason_of(meta) or "stop",
                }
            ],
            "usage": usage_dict(usage),
        },
        usage,
    )


class ChunkTranslator:
    """``/generate`` stream events -> ``chat.completion.chunk`` SSE events."""

    def __init__(self, *, model: str, request_id: str, include_usage: bool, incremental: bool = False) -> None:
        self.model = model
        self.id = chat_id(request_id)
        self.created = int(time.time())
        self.include_usage = include_usage
        self.text = TextDeltas(incremental)
        self.started = False
        self.finished = False
        self.usage: Usage | None = None

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        return sse_event(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            }
        )

    def feed(self, obj: dict[str, Any]) -> list[bytes]:
        """Events for one upstream object (already checked with ``check_failure``)."""
        if self.finished:
            return []
        out: list[bytes] = []
        if not self.started:
            self.started = True
            out.append(self._chunk({"role": "assistant", "content": ""}, None))
        meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
        self.usage = usage_of(meta)
        finish = finish_reason_of(meta)
        text = obj.get("text")
        delta = self.text.update(text if isinstance(text, str) else "", finish is not None)
        if finish is not None:
            self.finished = True
            out.append(self._chunk({"content": delta} if delta else {}, finish))
            if self.include_usage and self.usage is not None:
                out.append(
                    sse_event(
                        {
                            "id": self.id,
                            "object": "chat.completion.chunk",
                            "created": self.created,
                            "model": self.model,
                            "choices": [],
                            "usage": usage_dict(self.usage),
                        }
                    )
                )
        elif delta:
            out.append(self._chunk({"content": delta}, None))
        return out


# ---- proxy ----------------------------------------------------------------------------------


def _error_from_4xx(status: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """SGLang's 4xx answer in OpenAI's error shape (its own is ``{"error": {"message"}}``)."""
    msg = body.decode("utf-8", "replace").strip() or f"SGLang answered {status}"
    try:
        js = json.loads(body)
    except ValueError:
        js = None
    if isinstance(js, dict):
        err = js.get("error")
        if isinstance(err, dict) and err.get("message"):
            msg = str(err["message"])
        elif isinstance(err, str):
            msg = err
        elif isinstance(js.get("message"), str):
            msg = js["message"]
        elif isinstance(js.get("detail"), str):
            msg = js["detail"]
    return status, RouterError(status, msg).body()


async def proxy_sglang_generate(
    request: web.Request,
    upstream: Upstream,
    worker: Worker,
    gen_body: dict[str, Any],
    *,
    model: str,
    stream: bool,
    include_usage: bool,
    request_id: str,
    hooks: ProxyHooks | None = None,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """POST ``gen_body`` to the worker's ``/generate`` and answer in OpenAI chat format.

    Same contract as ``proxy_openai``: ``RetryableUpstreamError`` when nothing was sent to
    the client and the worker was unreachable, answered 5xx, or failed before its first
    output; ``CancelledError`` propagates on client disconnect after closing upstream.
    """
    hooks = hooks or ProxyHooks()
    body = {**gen_body, "stream": stream}
    body.setdefault("rid", request_id)
    data = msgspec.json.encode(body)

    async def relay(resp: aiohttp.ClientResponse, out_headers: dict[str, str]) -> web.StreamResponse:
        if resp.status >= 400:
            status, err_body = _error_from_4xx(resp.status, await read_error_body(resp, 1024 * 1024))
            hooks.complete("error")
            return web.json_response(err_body, status=status, headers=out_headers)
        translator = ChunkTranslator(
            model=model, request_id=request_id, include_usage=include_usage, incremental=worker.incremental_stream
        )
        if stream and resp.content_type == "text/event-stream":
            return await _relay_stream(request, resp, worker, out_headers, hooks, translator)
        return await _relay_whole(request, resp, worker, out_headers, hooks, translator, stream, model, request_id)

    return await post_and_relay(
        request, upstream, worker, "/generate", data, request_id=request_id, hooks=hooks, headers=headers, relay=relay
    )


def _failure_before_output(worker: Worker, f: GenerateFailure, out_headers: dict[str, str], hooks: ProxyHooks) -> web.Response:
    """Nothing was sent yet: a 5xx-like failure may go to another worker, a 4xx is the client's."""
    if f.status >= 500:
        raise RetryableUpstreamError(
            f"{worker.id}: {f.message}",
            status=f.status,
            body=json.dumps(RouterError(f.status, f.message).body()).encode(),
            content_type="application/json",
        )
    hooks.complete("error")
    return error_response(f.status, f.message, headers=out_headers)


async def _relay_whole(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    worker: Worker,
    out_headers: dict[str, str],
    hooks: ProxyHooks,
    translator: ChunkTranslator,
    stream: bool,
    model: str,
    request_id: str,
) -> web.StreamResponse:
    payload = await read_whole(resp, worker)
    if payload is None:
        return timed_out(worker, out_headers, hooks)
    try:
        obj = json.loads(payload)
    except ValueError:
        obj = None
    if isinstance(obj, list):  # batch form: n == 1 gives one element
        obj = obj[0] if obj else None
    try:
        check_failure(obj)
    except GenerateFailure as f:
        return _failure_before_output(worker, f, out_headers, hooks)
    hooks.first_token()
    if not stream:
        completion, usage = chat_completion(obj, model=model, request_id=request_id, created=int(time.time()))
        hooks.usage(usage)
        hooks.complete("ok")
        return web.json_response(completion, headers=out_headers, dumps=lambda o: json.dumps(o, ensure_ascii=False))
    # Asked to stream but the worker answered in one piece: stream that piece.
    events = translator.feed(obj)
    if not translator.finished:
        meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
        meta = {**meta, "finish_reason": {"type": "stop"}}
        events += translator.feed({**obj, "text": obj.get("text"), "meta_info": meta})
    client = ClientStream(request, hooks, out_headers, None)  # the answer is read: nothing to close upstream
    if not await client.open():
        return client.out
    if translator.usage is not None:
        hooks.usage(translator.usage)
    if not await client.send(b"".join(events) + DONE_EVENT):
        return client.out
    return await client.finish(None)


async def _relay_stream(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    worker: Worker,
    out_headers: dict[str, str],
    hooks: ProxyHooks,
    tr: ChunkTranslator,
) -> web.StreamResponse:
    client: ClientStream | None = None  # opened lazily: an early failure can still be a JSON error
    splitter = SSESplitter()
    chunks = UpstreamChunks(resp, worker)
    failure: StreamFailure | None = None
    done = False
    async for chunk in chunks:
        pieces: list[bytes] = []
        for ev in splitter.feed(chunk):
            payload = sse_data(ev)
            if payload is None:
                continue
            if payload == b"[DONE]":
                done = True
                break
            try:
                obj = json.loads(payload)
                check_failure(obj)
            except ValueError:
                failure = StreamFailure("upstream_error", 502, f"worker {worker.id} sent an undecodable stream event")
            except GenerateFailure as f:
                failure = StreamFailure("upstream_error", f.status, f.message)
            if failure is not None:
                break
            pieces.extend(tr.feed(obj))
            if tr.finished:
                done = True
                break
        if failure is not None and client is None:
            return _failure_before_output(worker, GenerateFailure(failure.status, failure.message), out_headers, hooks)
        if pieces:
            if client is None:
                client = ClientStream(request, hooks, out_headers, resp)
                if not await client.open():
                    return client.out
                hooks.first_token()
            if not await client.send(b"".join(pieces)):
                return client.out
        if failure is not None or done:
            break
    failure = failure or chunks.failure
    if tr.usage is not None:
        hooks.usage(tr.usage)
    if client is None:
        # Not a byte went out: the worker failed before its first output.
        msg = failure.message if failure else f"worker {worker.id} ended the stream before any output"
        raise RetryableUpstreamError(f"{worker.id}: {msg}", status=failure.status if failure else 502)
    if failure is None and not tr.finished:
        failure = StreamFailure("upstream_error", 502, f"worker {worker.id} ended the stream without a finish_reason")
    return await client.finish(failure, DONE_EVENT)
