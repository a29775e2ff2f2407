"""HTTP handlers: the OpenAI surface, ops endpoints and router introspection."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from mmroute.api.context import AppContext
from mmroute.api.pipeline import Prepared, Route, decide, forward_chat_body, prepare
from mmroute.errors import RouterError, bad_request
from mmroute.metrics import CONTENT_TYPE
from mmroute.proxy.common import ProxyHooks, RetryableUpstreamError, Usage
from mmroute.proxy.openai import proxy_openai
from mmroute.proxy.sglang import build_generate_body, proxy_sglang_generate
from mmroute.routing import views

log = logging.getLogger("mmroute.api")

CTX: web.AppKey[AppContext] = web.AppKey("mmroute_ctx", AppContext)

_decode_json = msgspec.json.Decoder().decode


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json",
                        headers=headers)


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        raise bad_request("request body is empty: expected a JSON object")
    try:
        return _decode_json(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"malformed JSON in request body: {exc}") from None


# ---------------------------------------------------------------- OpenAI


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "chat", "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "completions", "/v1/completions")


async def _complete(request: web.Request, endpoint: str, path: str) -> web.StreamResponse:
    ctx = request.app[CTX]
    started = time.perf_counter()
    body = await read_json(request)
    prep = await prepare(ctx, endpoint, body)
    ctx.maybe_verify(prep)
    request_id = request.headers.get("x-request-id") or f"mmr-{uuid.uuid4().hex}"
    exclude: set[str] = set()
    last_error: RetryableUpstreamError | None = None
    for attempt in range(ctx.config.max_retries + 1):
        try:
            route = decide(ctx, prep, exclude)
        except RouterError:
            if last_error is not None:
                break  # every worker failed: report the upstream failure below
            raise
        if attempt == 0:
            _record_prediction(ctx, route)
        try:
            return await _send(ctx, request, prep, route, path, request_id, started)
        except RetryableUpstreamError as exc:
            last_error = exc
            wid = route.worker_id
            exclude.add(wid)
            reason = "connect" if exc.connect_failure else f"status_{exc.status}"
            ctx.metrics.retries.labels(wid, reason).inc()
            if exc.connect_failure:
                ctx.registry.mark_failed(wid, exc.reason)
            log.warning("request %s: worker %s failed before answering (%s); trying another", request_id, wid, exc.reason)
    assert last_error is not None
    if last_error.status is not None and last_error.body is not None:
        return web.Response(body=last_error.body, status=last_error.status,
                            content_type=last_error.content_type or "application/json")
    raise RouterError(502, f"No worker could serve the request: {last_error.reason}", code="upstream_unavailable")


def _record_prediction(ctx: AppContext, route: Route) -> None:
    blocks = route.request_blocks()
    if blocks:
        ctx.metrics.predicted_hit_rate.observe(min(1.0, route.overlaps.get(route.worker_id, 0) / blocks))


async def _send(ctx: AppContext, request: web.Request, prep: Prepared, route: Route, path: str, request_id: str,
                started: float) -> web.StreamResponse:
    worker = ctx.registry.get(route.worker_id)
    view = route.views[worker.id]
    predicted = route.predicted_cached_tokens(worker.id)
    # Prefill share: the uncached prompt (released at the first token). Decode share: the
    # KV footprint the request holds until it completes (prompt + expected output), the
    # "active blocks" that slow every decode step of the worker.
    prompt_tokens = route.prompt_tokens_for(worker.id)
    booking = ctx.scheduler.book(worker.id, max(0, prompt_tokens - predicted), prompt_tokens + prep.decode_tokens)
    if view.keys:
        ctx.index.insert_speculative(worker.id, view.keys, ctx.config.speculative_ttl)
    m = ctx.metrics
    usage_box: list[Usage] = []

    def first_token() -> None:
        booking.release_prefill()
        m.ttft.labels(worker.id).observe(time.perf_counter() - started)

    hooks = ProxyHooks(on_first_token=first_token, on_usage=usage_box.append)
    status = 200
    try:
        if worker.backend == "sglang" and prep.has_mm and prep.endpoint == "chat" and not prep.generate_unsupported:
            mm = [views.mm_hash_hex16(it.identifier) for it in prep.prompt.mm_items] if view.mm_exact else None
            gen = build_generate_body(prep.body, prep.prompt.text or "", prep.image_urls, mm, request_id)
            resp = await proxy_sglang_generate(request, ctx.upstream, worker, gen, model=prep.model, stream=prep.stream,
                                               include_usage=_include_usage(prep.body), request_id=request_id,
                                               hooks=hooks)
        else:
            body = forward_chat_body(ctx, prep, worker)
            resp = await proxy_openai(request, ctx.upstream, worker, path, body, request_id=request_id, hooks=hooks)
        status = resp.status
        return resp
    except RetryableUpstreamError:
        status = 0
        # It never saw the request: its blocks must not look cached there.
        ctx.index.drop_speculative(worker.id, view.keys)
        raise
    except BaseException:
        status = 499  # client went away (or the handler was cancelled)
        raise
    finally:
        booking.release()
        if status:
            m.requests.labels(worker.id, str(status)).inc()
            m.request_duration.labels(worker.id).observe(time.perf_counter() - started)
        if usage_box:
            _check_prediction(ctx, prep, route, worker, predicted, usage_box[-1])
        if status == 200 and worker.backend == "sglang" and prep.has_mm and view.mm_exact:
            ctx.check_sglang_mm_hashes(worker, view.keys, min(it.offset for it in prep.prompt.mm_items),
                                       route.block_size)


def _include_usage(body: dict[str, Any]) -> bool:
    so = body.get("stream_options")
    return bool(isinstance(so, dict) and so.get("include_usage"))


def _check_prediction(ctx: AppContext, prep: Prepared, route: Route, worker: Any, predicted: int, usage: Usage) -> None:
    if usage.cached_tokens is None or not usage.prompt_tokens:
        return
    m = ctx.metrics
    m.actual_cached_ratio.observe(min(1.0, usage.cached_tokens / usage.prompt_tokens))
    if prep.prompt is None or prep.fallback:
        return
    m.prediction_checked.labels(worker.id).inc()
    if usage.cached_tokens != predicted:
        direction = "over" if predicted > usage.cached_tokens else "under"
        m.prediction_mismatch.labels(worker.id, direction).inc()
        log.info("worker %s reported %d cached tokens, predicted %d (%s)", worker.id, usage.cached_tokens,
                 predicted, direction)


# ---------------------------------------------------------------- ops


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    created = int(ctx.started_at)
    data = [{"id": n, "object": "model", "created": created, "owned_by": "mmroute", "root": ctx.config.model,
             "parent": None, "max_model_len": ctx.renderer.max_model_len} for n in ctx.config.model_names]
    data += [{"id": n, "object": "model", "created": created, "owned_by": "mmroute", "root": n,
              "parent": ctx.config.model_names[0], "max_model_len": ctx.renderer.max_model_len}
             for n in sorted(ctx.lora_names)]
    return json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    healthy = [w.id for w in ctx.registry.healthy_workers()]
    if not healthy:
        return json_response({"status": "unavailable", "healthy_workers": []}, status=503, headers={"Retry-After": "1"})
    return json_response({"status": "ready", "healthy_workers": healthy})


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    ctx.refresh_gauges()
    return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


# ---------------------------------------------------------------- router introspection


async def workers(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    now = time.monotonic()
    loads = ctx.scheduler.loads()
    out = []
    for snap in ctx.registry.snapshot():
        wid = snap["id"]
        kv = ctx.kv_state(wid)
        last_times = [k.get("last_event_time") for k in kv if k.get("last_event_time") is not None]
        ld = loads.get(wid)
        snap.update(
            indexed_blocks=ctx.index.block_count(wid),
            in_flight_requests=ld.requests if ld else 0,
            in_flight_prefill_tokens=ld.prefill_tokens if ld else 0,
            in_flight_decode_tokens=ld.decode_tokens if ld else 0,
            last_event_seq=max((k["last_seq"] for k in kv if k.get("last_seq") is not None), default=None),
            event_lag_seconds=round(now - max(last_times), 3) if last_times else None,
            kv_events_seen=sum(k.get("events_seen", 0) for k in kv),
            kv_subscriptions=kv,
        )
        out.append(snap)
    return json_response({"block_size": ctx.index.block_size, "policy": ctx.config.policy, "workers": out})


async def explain(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    body = dict(body)
    endpoint = body.pop("endpoint", None)
    if endpoint is None:
        endpoint = "chat" if "messages" in body else "completions"
    endpoint = {"/v1/chat/completions": "chat", "chat.completions": "chat", "/v1/completions": "completions"}.get(
        endpoint, endpoint)
    if endpoint not in ("chat", "completions"):
        raise bad_request("'endpoint' must be 'chat' or 'completions'", param="endpoint")
    prep = await prepare(ctx, endpoint, body)
    route = decide(ctx, prep)
    p = prep.prompt
    out: dict[str, Any] = {
        "worker": route.worker_id,
        "policy": route.decision.policy,
        "reason": route.decision.reason,
        "block_size": route.block_size,
        "prompt_tokens": prep.prompt_tokens,
        "blocks": route.request_blocks(),
        "full_blocks": prep.prompt_tokens // route.block_size,
        "candidates": [
            {
                "worker": c.worker_id,
                "backend": ctx.registry.get(c.worker_id).backend,
                "view": route.views[c.worker_id].name,
                "eligible": c.eligible,
                "overlap_blocks": c.overlap_blocks,
                "predicted_cached_tokens": route.predicted_cached_tokens(c.worker_id),
                "cost": round(c.cost, 4),
                "uncached_blocks": round(c.uncached_blocks, 4),
                "booked_prefill_blocks": round(c.booked_prefill_blocks, 4),
                "reported_queue_blocks": round(c.reported_queue_blocks, 4),
                "decode_blocks": round(c.decode_blocks, 4),
                "in_flight": c.in_flight,
                "probability": c.probability,
            }
            for c in route.decision.costs
        ],
        "fallback": prep.fallback,
        "mm_items": [{"identifier": it.identifier, "offset": it.offset, "length": it.length}
                     for it in (p.mm_items if p is not None else [])],
        "lora_name": prep.lora_name,
        "cache_salt": prep.cache_salt,
        "stages_ms": {k: round(v * 1000, 4) for k, v in route.stages.items()},
    }
    if request.query.get("tokens") in ("1", "true"):
        out["prompt_token_ids"] = p.token_ids if p is not None else None
    return json_response(out)


# ---------------------------------------------------------------- errors


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except RouterError as exc:
        return json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = RouterError(exc.status, exc.reason if exc.status != 413 else
                          f"request body too large ({exc.text.strip() if exc.text else 'over the limit'})")
        return json_response(err.body(), status=exc.status)
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        err = RouterError(500, "internal router error; see the router log", code="internal_error")
        return json_response(err.body(), status=500)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/router/workers", workers)
    app.router.add_post("/router/explain", explain)
