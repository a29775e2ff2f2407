"""The one object that holds a router's state (no module-level globals).

``AppContext`` owns, for one router process: the model's renderer, the prefix index,
the scheduler, the worker registry, one KV subscriber per worker publisher, the
upstream connection pools and the metrics. ``start()``/``stop()`` bring the
background tasks up and down; nothing is left running after ``stop()``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from typing import Any

import aiohttp
import msgspec

from mmroute.config import RouterConfig
from mmroute.errors import RouterError
from mmroute.kv.subscriber import KVCollector, KVSubscriber
from mmroute.media.fetch import MediaFetcher
from mmroute.media.resolve import ImageRef, resolve_image
from mmroute.metrics import Metrics
from mmroute.models.files import ModelFiles
from mmroute.proxy.upstream import Upstream
from mmroute.render.renderer import RenderedPrompt, Renderer
from mmroute.routing.index import PrefixIndex
from mmroute.routing.scheduler import Scheduler
from mmroute.workers.registry import Worker, WorkerRegistry

log = logging.getLogger("mmroute")

DEFAULT_BLOCK_SIZE = 16
# Media errors that mean "could not get the image" (route on the text prefix, let the
# worker decide) rather than "the client sent something bad" (400).
_SOFT_MEDIA_CODES = {"image_fetch_failed", "image_unreachable", "image_timeout", "image_http_error"}


class _StateCollector:
    """Scrape-time view of state the index and subscribers already count: per-worker
    index outcomes (unknown parents, block-size mismatches, other tiers...) and the
    age of the last applied KV event."""

    def __init__(self, ctx: "AppContext"):
        self.ctx = ctx

    def describe(self) -> list[Any]:
        return []  # registered without describing: metrics appear once there is state

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ctx = self.ctx
        outcomes = CounterMetricFamily("mmroute_index_events", "KV events by index outcome (applied, unknown_parent, "
                                       "bad_block_size, skipped_medium, skipped_group, unknown_hash, ...)",
                                       labels=["worker", "type", "status"])
        lag = GaugeMetricFamily("mmroute_kv_event_lag_seconds", "Seconds since the last applied KV event per worker",
                                labels=["worker"])
        now = time.monotonic()
        for wid in ctx.registry.workers:
            for (etype, status), n in ctx.index.counters(wid).items():
                outcomes.add_metric([wid, etype, status], n)
            last = [k.get("last_event_time") for k in ctx.kv_state(wid) if k.get("last_event_time") is not None]
            if last:
                lag.add_metric([wid], now - max(last))
        yield outcomes
        yield lag


class AppContext:
    def __init__(self, config: RouterConfig, *, renderer: Renderer | None = None, rng: random.Random | None = None):
        config.validate()
        self.config = config
        self.metrics = Metrics()
        if renderer is None:
            files = ModelFiles.load(config.model)
            renderer = Renderer.from_files(files, chat_template=config.chat_template,
                                           mm_processor_kwargs=config.mm_processor_kwargs)
        self.renderer = renderer
        if config.max_model_len:
            renderer.max_model_len = config.max_model_len
        self.lora_names: set[str] = set(config.lora_modules)
        self.index = PrefixIndex(block_size=config.block_size, on_unknown_parent=self._on_unknown_parent)
        self.scheduler = Scheduler(
            policy=config.policy,
            w_prefill=config.w_prefill,
            w_decode=config.w_decode,
            temperature=config.temperature,
            booking_ttl=config.booking_ttl,
            rng=rng,
            on_booking_expired=lambda w: self.metrics.bookings_expired.labels(w).inc(),
        )
        self.registry = WorkerRegistry(
            config.workers,
            metrics=self.metrics,
            health_interval=config.health_interval,
            allow_page_size_1=config.allow_page_size_1,
        )
        self.registry.on_change.append(self._on_worker_change)
        self.upstream = Upstream(connect_timeout=config.connect_timeout, request_timeout=config.request_timeout)
        self.fetcher = MediaFetcher(
            max_bytes=config.media_max_bytes,
            timeout=config.media_fetch_timeout,
            allow_hosts=config.media_allow_hosts,
        )
        self.subscribers: dict[tuple[str, int], KVSubscriber] = {}
        self.collector: KVCollector | None = None
        self.rng = rng or random.Random()
        self._tasks: set[asyncio.Task] = set()
        self._tok_sem = asyncio.Semaphore(64)
        self._tok_cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self._tok_rr = 0
        self._sglang_mm_misses: dict[str, int] = {}
        self._adapters_checked = float("-inf")
        self.started_at = time.time()
        self.metrics.registry.register(_StateCollector(self))
        self._log_mm_status()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self.config.kv_events_bind:
            topics = {w.id: w.id for w in self.registry.workers.values()}
            replays = {w.id: w.spec.replay_endpoint for w in self.registry.workers.values() if w.spec.replay_endpoint}
            self.collector = KVCollector(self.config.kv_events_bind, self.index, topics,
                                         replay_endpoints=replays, metrics=self.metrics)
            self.collector.start()
        await self.registry.start()
        self._spawn(self._sweeper(), "booking-sweeper")
        self._spawn(self._adapter_refresher(), "adapter-refresher")

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registry.stop()
        subs = list(self.subscribers.values())
        self.subscribers.clear()
        await asyncio.gather(*(s.stop() for s in subs), return_exceptions=True)
        if self.collector is not None:
            await self.collector.stop()
        await self.upstream.close()
        await self.fetcher.close()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def _sweeper(self) -> None:
        # Expire stale bookings and refresh per-worker gauges even when no request comes.
        while True:
            await asyncio.sleep(1.0)
            self.scheduler.sweep()
            self.refresh_gauges()

    def refresh_gauges(self) -> None:
        loads = self.scheduler.loads()
        for wid in self.registry.workers:
            ld = loads.get(wid)
            self.metrics.in_flight.labels(wid).set(ld.requests if ld else 0)
            self.metrics.in_flight_tokens.labels(wid).set(ld.prefill_tokens if ld else 0)
            self.metrics.indexed_blocks.labels(wid).set(self.index.block_count(wid))

    # ---------------------------------------------------------------- KV subscriptions
    def _on_worker_change(self, worker: Worker, what: str) -> None:
        if what in ("backend", "up") and not worker.mm_hashes_ok:
            # Back after being down, or re-detected (a restart, maybe an upgrade): give
            # mm_hashes another chance.
            worker.mm_hashes_ok = True
            self._sglang_mm_misses.pop(worker.id, None)
        if what == "kv_sources" and self.collector is None:  # collector: publishers dial us
            self._resubscribe(worker)

    def _resubscribe(self, worker: Worker) -> None:
        wanted = {(worker.id, s.dp_rank): s for s in worker.kv_sources}
        for key in [k for k in self.subscribers if k[0] == worker.id and k not in wanted]:
            sub = self.subscribers.pop(key)
            self._spawn(sub.stop(), f"kv-stop:{key}")
        for key, src in wanted.items():
            cur = self.subscribers.get(key)
            if cur is not None and cur.endpoint == src.endpoint and cur.replay_endpoint == src.replay_endpoint:
                continue
            if cur is not None:
                self._spawn(cur.stop(), f"kv-stop:{key}")
                self.index.clear(worker.id, src.dp_rank)
            sub = KVSubscriber(worker.id, src.endpoint, self.index, replay_endpoint=src.replay_endpoint,
                               dp_rank=src.dp_rank, topic=src.topic, metrics=self.metrics)
            self.subscribers[key] = sub
            sub.start()
            log.info("worker %s: subscribed to KV events at %s (replay %s)", worker.id, src.endpoint,
                     src.replay_endpoint or "none")

    def _on_unknown_parent(self, worker_id: str, dp_rank: int) -> None:
        # A store whose parent the index never saw: ask that stream for a resync.
        if self.collector is not None:
            self.collector.request_resync(worker_id, dp_rank)
            return
        sub = self.subscribers.get((worker_id, dp_rank))
        if sub is not None:
            sub.request_resync(dp_rank)

    def kv_state(self, worker_id: str) -> list[dict[str, Any]]:
        if self.collector is not None:
            st = self.collector.stats_for(worker_id)
            return [{"mode": "collector", "last_seq": st.last_seq if st else None,
                     "events_seen": st.events_seen if st else 0,
                     "last_event_time": st.last_event_time if st else None}]
        return [dict(sub.snapshot(), dp_rank=rank) for (wid, rank), sub in self.subscribers.items() if wid == worker_id]

    # ---------------------------------------------------------------- LoRA adapters
    async def refresh_adapters(self, min_interval: float = 1.0) -> None:
        """Learn the LoRA adapters the workers serve from their ``/v1/models`` (vLLM lists
        each adapter with ``parent`` = the base model), so adapters loaded at run time are
        routed (and keyed with their name) without ``--lora-modules``. Rate-limited."""
        now = time.monotonic()
        if now - self._adapters_checked < min_interval:
            return
        self._adapters_checked = now

        async def one(w: Worker) -> set[str]:
            try:
                session = self.upstream.session(w)
                async with session.get(w.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=3)) as r:
                    data = await r.json(content_type=None) if r.status == 200 else {}
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return set()
            cards = data.get("data") if isinstance(data, dict) else None
            return {c["id"] for c in cards or [] if isinstance(c, dict) and isinstance(c.get("id"), str)
                    and c.get("parent") and c["id"] not in self.config.model_names}

        found = await asyncio.gather(*(one(w) for w in self.registry.healthy_workers()))
        for names in found:
            new = names - self.lora_names
            if new:
                log.info("LoRA adapters discovered on the workers: %s", ", ".join(sorted(new)))
                self.lora_names |= new

    async def _adapter_refresher(self) -> None:
        while True:
            await self.refresh_adapters()
            await asyncio.sleep(30.0)

    # ---------------------------------------------------------------- helpers for the pipeline
    def block_size(self) -> int:
        if self.index.block_size:
            return self.index.block_size
        if self.config.block_size:
            return self.config.block_size
        for w in self.registry.workers.values():
            if w.page_size:
                return w.page_size
        return DEFAULT_BLOCK_SIZE

    async def resolve_images(self, urls: list[str]) -> list[ImageRef | RouterError]:
        """Identify and size every image. A bad image is a 400 (raised); one the router
        cannot fetch comes back as its error, and the request falls back to text-prefix
        routing (the worker may still reach it)."""

        async def one(url: str) -> ImageRef | RouterError:
            try:
                ref = await resolve_image(url, self.fetcher, self.config.media_max_pixels,
                                          max_bytes=self.config.media_max_bytes)
                self.metrics.media_fetch.labels("ok").inc()
                return ref
            except RouterError as exc:
                if exc.code in _SOFT_MEDIA_CODES:
                    self.metrics.media_fetch.labels(str(exc.code)).inc()
                    log.info("image not resolved (%s): routing on the text prefix", exc.message)
                    return exc
                self.metrics.media_fetch.labels("rejected").inc()
                raise

        return list(await asyncio.gather(*(one(u) for u in urls)))

    def _log_mm_status(self) -> None:
        r = self.renderer
        if r.mm_enabled:
            log.info("model %s: multimodal routing enabled (family %s)", self.config.model, r.family.name)
        else:
            log.info("model %s: multimodal routing disabled: %s", self.config.model, r.mm_reason)

    # ---------------------------------------------------------------- remote tokenization
    def _tokenize_worker(self) -> Worker:
        ws = [w for w in self.registry.healthy_workers() if w.backend != "sglang"]
        if not ws:
            raise RouterError(503, "No healthy vLLM worker can tokenize this request; retry later.",
                              code="no_healthy_worker", headers={"Retry-After": "1"})
        self._tok_rr += 1
        return ws[self._tok_rr % len(ws)]

    async def remote_tokenize(self, payload: dict[str, Any], worker: Worker | None = None) -> list[int]:
        """POST a worker's ``/tokenize`` (bounded concurrency, timeout, small cache).
        A worker's 4xx becomes the same error for the client."""
        key = msgspec.json.encode(payload)
        hit = self._tok_cache.get(key)
        if hit is not None:
            self._tok_cache.move_to_end(key)
            self.metrics.remote_tokenize.labels("cache_hit").inc()
            return hit
        w = worker or self._tokenize_worker()
        async with self._tok_sem:
            try:
                session = self.upstream.session(w)
                async with session.post(w.url + "/tokenize", json=payload,
                                        timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout + 5)) as resp:
                    data = await resp.json(content_type=None)
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                self.metrics.remote_tokenize.labels("error").inc()
                raise RouterError(502, f"worker {w.id} could not tokenize the request: {exc or type(exc).__name__}",
                                  code="tokenize_failed") from None
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
            self.metrics.remote_tokenize.labels("rejected").inc()
            msg = data.get("error", {}).get("message") if isinstance(data, dict) and isinstance(data.get("error"), dict) else None
            raise RouterError(status if 400 <= status < 500 else 502, msg or f"worker {w.id} /tokenize answered {status}",
                              code="tokenize_rejected")
        self.metrics.remote_tokenize.labels("ok").inc()
        tokens = [int(t) for t in data["tokens"]]
        self._tok_cache[key] = tokens
        if len(self._tok_cache) > 1024:
            self._tok_cache.popitem(last=False)
        return tokens

    @staticmethod
    def tokenize_payload(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        if endpoint == "chat":
            keys = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                    "chat_template", "chat_template_kwargs", "tools", "documents")
        else:
            keys = ("model", "prompt", "add_special_tokens")
        return {k: body[k] for k in keys if k in body}

    async def remote_tokens(self, prep: Any) -> RenderedPrompt | None:
        if prep.endpoint == "completions" and not isinstance(prep.body.get("prompt"), str):
            return self.renderer.render_completion(prep.body)  # token ids: nothing to ask
        tokens = await self.remote_tokenize(self.tokenize_payload(prep.endpoint, prep.body))
        if prep.image_urls:
            # /tokenize gives expanded ids but no spans or identifiers: key only the
            # text before the first image, which is exact.
            fam = self.renderer.family
            if fam is None:
                return RenderedPrompt(token_ids=[], mm_items=[], text=None, fallback="remote_tokenize_images",
                                      num_images=len(prep.image_urls))
            cut = tokens.index(fam.image_token_id) if fam.image_token_id in tokens else len(tokens)
            return RenderedPrompt(token_ids=tokens[:cut], mm_items=[], text=None, fallback="remote_tokenize_images",
                                  num_images=len(prep.image_urls))
        return RenderedPrompt(token_ids=tokens, mm_items=[], text=None, fallback=None, num_images=0)

    async def verify_tokenization(self, prep: Any) -> None:
        """Off the critical path: compare local tokens with the worker's ``/tokenize``."""
        local = prep.prompt.token_ids if prep.prompt is not None else None
        if local is None or prep.prompt.fallback:
            return
        try:
            remote = await self.remote_tokenize(self.tokenize_payload(prep.endpoint, prep.body))
        except RouterError as exc:
            self.metrics.tokenization_verify.labels("error").inc()
            log.debug("tokenization check failed: %s", exc.message)
            return
        if remote == local:
            self.metrics.tokenization_verify.labels("match").inc()
            return
        self.metrics.tokenization_verify.labels("mismatch").inc()
        pos = next((i for i, (a, b) in enumerate(zip(local, remote)) if a != b), min(len(local), len(remote)))
        log.warning("tokenization mismatch at position %d (local %d tokens, worker %d): local %s worker %s",
                    pos, len(local), len(remote), local[pos:pos + 8], remote[pos:pos + 8])

    def maybe_verify(self, prep: Any) -> None:
        rate = self.config.verify_tokenization
        if rate > 0 and self.config.tokenize == "local" and self.rng.random() < rate:
            self._spawn(self.verify_tokenization(prep), "verify-tokenization")

    # ---------------------------------------------------------------- SGLang mm_hashes check
    def check_sglang_mm_hashes(self, worker: Worker, keys: list[int], first_image_offset: int, bs: int) -> None:
        """An SGLang build that ignores ``mm_hashes`` keys image pages with its own pad
        values, so its events never carry the image-page keys we computed with ours.
        After an image request, watch for the first image page's key; when it does not
        show up twice in a row, stop keying image pages for that worker (logged, counted)."""
        blk = first_image_offset // bs
        if not worker.mm_hashes_ok or blk >= len(keys):
            return
        self._spawn(self._await_image_key(worker, keys[blk]), f"mm-hash-check:{worker.id}")

    async def _await_image_key(self, worker: Worker, key: int, timeout: float = 5.0) -> None:
        subs = [s for (wid, _), s in self.subscribers.items() if wid == worker.id]
        if not subs:
            return
        seen = await subs[0].wait_for(lambda _s: self.index.holds(worker.id, key), timeout)
        if seen:
            self._sglang_mm_misses[worker.id] = 0
            return
        n = self._sglang_mm_misses[worker.id] = self._sglang_mm_misses.get(worker.id, 0) + 1
        if n >= 2 and worker.mm_hashes_ok:
            worker.mm_hashes_ok = False
            self.metrics.mm_fallback.labels("sglang_ignores_mm_hashes").inc()
            log.warning("worker %s (SGLang %s) does not honour mm_hashes: its image pages are now routed on "
                        "their text prefix only", worker.id, worker.version)
