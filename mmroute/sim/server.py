"""The simulated worker process: engine + KV-event publisher + HTTP server (aiohttp).

``SimWorker(config)`` wires the pieces; ``await worker.start()`` binds everything
(ephemeral ports resolved) and ``worker.ready_info()`` says where. ``run_sim_worker``
is the CLI entry: it prints one machine-readable line once serving::

    SIM_READY {"port": 43121, "url": "http://127.0.0.1:43121", "kv_endpoint": "tcp://127.0.0.1:50931", ...}
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mmroute.errors import RouterError
from mmroute.sim.config import SimConfig, validate
from mmroute.sim.processor import Processor, filler_tokens
from mmroute.sim.publisher import EventPublisher, PublisherConfig
from mmroute.sim.runner import Runner
from mmroute.sim.sglang_engine import SglangEngine
from mmroute.sim.vllm_engine import VllmEngine
from mmroute.sim.vllm_hash import VllmBlockHasher
from mmroute.sim.wire import Record, WireEncoder

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024 * 1024


@web.middleware
async def _errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except RouterError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # a bug: say so, keep serving
        log.exception("sim worker: unhandled error on %s", request.path)
        return web.json_response(RouterError(500, f"internal error: {type(exc).__name__}").body(), status=500)


class _Metrics:
    """Scrape-time collector reading the worker's live state."""

    def __init__(self, worker: "SimWorker"):
        self.w = worker

    def collect(self):  # noqa: ANN201 - prometheus collector protocol
        w = self.w
        eng = w.engine
        name = w.config.model_name
        # vLLM labels every metric with the engine index too.
        vllm = w.config.backend == "vllm"
        labels, vals = (["model_name", "engine"], [name, "0"]) if vllm else (["model_name"], [name])

        def g(metric: str, doc: str, v: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(metric, doc, labels=labels)
            m.add_metric(vals, v)
            return m

        def c(metric: str, doc: str, v: float) -> CounterMetricFamily:
            m = CounterMetricFamily(metric, doc, labels=labels)
            m.add_metric(vals, v)
            return m

        if vllm:
            yield g("vllm:num_requests_running", "Number of requests in model execution batches.", w.runner.running)
            yield g("vllm:num_requests_waiting", "Number of requests waiting to be processed.", w.runner.waiting)
            yield g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.usage())
            yield c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                    eng.prefix_queries)
            yield c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", eng.prefix_hits)
            yield c("vllm:prompt_tokens", "Number of prefill tokens processed.", eng.prompt_tokens)
            yield c("vllm:generation_tokens", "Number of generation tokens processed.", eng.generation_tokens)
            yield c("vllm:request_success", "Count of successfully processed requests.", w.runner.finished_requests)
        else:
            hit_rate = eng.prefix_hits / eng.prefix_queries if eng.prefix_queries else 0.0
            yield g("sglang:num_running_reqs", "The number of running requests.", w.runner.running)
            yield g("sglang:num_queue_reqs", "The number of requests in the waiting queue.", w.runner.waiting)
            yield g("sglang:token_usage", "The token usage.", eng.usage())
            yield g("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
            yield c("sglang:prompt_tokens", "Number of prefill tokens processed.", eng.prompt_tokens)
            yield c("sglang:generation_tokens", "Number of generation tokens processed.", eng.generation_tokens)
            yield c("sglang:cached_tokens", "Number of cached prompt tokens.", eng.prefix_hits)
            yield c("sglang:num_requests", "Number of requests processed.", w.runner.finished_requests)


class SimWorker:
    def __init__(
        self,
        config: SimConfig,
        *,
        clock: Callable[[], float] = time.time,
        processor: Processor | None = None,
    ):
        validate(config)
        self.config = config
        self.clock = clock
        # A processor may be shared by several workers of one model (tests, demos).
        self.processor = processor or Processor(config.model, max_model_len=config.max_model_len)
        self._own_processor = processor is None
        self.encoder = WireEncoder(config.flavor)
        self.publisher = EventPublisher(
            PublisherConfig(
                endpoint=config.kv_endpoint,
                force_bind=config.kv_bind,
                replay_endpoint=config.replay_endpoint,
                topic=config.topic,
                replay_layout=config.replay_layout,
                buffer_steps=config.buffer_steps,
            )
        )
        self._started = False
        self.engine: Any = None
        self.runner: Runner | None = None  # type: ignore[assignment]
        self.loras = {m.name: m for m in config.lora_modules}
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_Metrics(self))

    # --- events ---------------------------------------------------------------------------

    def _emit(self, records: list[Record]) -> None:
        self.publisher.publish(self.encoder.encode(self.clock(), records))

    def _build_engine(self) -> Any:
        cfg = self.config
        if cfg.backend == "vllm":
            era = "tagged" if cfg.wire_format == "map" else "plain"
            return VllmEngine(
                cfg.num_blocks,
                cfg.block_size,
                VllmBlockHasher(cfg.hash_algo, era),
                int_hashes=cfg.int_hashes,
                hashless_first=cfg.wire_format == "map",
                emit=self._emit,
            )
        return SglangEngine(cfg.num_blocks, cfg.block_size, emit=self._emit)

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        await asyncio.to_thread(self.publisher.start)
        # The engine publishes from its first action (SGLang's start-up AllBlocksCleared).
        self.engine = self._build_engine()
        cfg = self.config
        self.runner = Runner(
            self.engine,
            filler_tokens(self.processor.renderer),
            max_concurrency=cfg.max_concurrency,
            prefill_ms_per_token=cfg.prefill_ms_per_token,
            decode_ms_per_token=cfg.decode_ms_per_token,
        )
        app = self.build_app()
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        await site.start()
        self.port = _bound_port(self._runner, cfg.port)
        self._started = True

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._own_processor:
            await self.processor.close()
        await asyncio.to_thread(self.publisher.close)
        self._started = False

    async def __aenter__(self) -> "SimWorker":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        return self.publisher.bound_endpoint or self.config.kv_endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_bound_endpoint

    def ready_info(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "url": self.url,
            "backend": self.config.backend,
            "version": self.config.engine_version,
            "model": self.config.model_name,
            "kv_endpoint": self.kv_endpoint,
            "kv_bind": self.publisher.bound_endpoint is not None,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.config.topic,
            "block_size": self.config.block_size,
        }

    # --- app ----------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        from mmroute.sim import sglang_api, vllm_api

        app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        # Simulator-only introspection and fault injection (not engine endpoints).
        app.router.add_get("/sim/state", self.sim_state)
        app.router.add_post("/sim/drop_kv_batches", self.sim_drop_kv_batches)
        if self.config.backend == "vllm":
            vllm_api.add_routes(app, self)
        else:
            sglang_api.add_routes(app, self)
        return app

    async def sim_state(self, request: web.Request) -> web.Response:
        """What was published so far: ``kv_seq`` is the last seq sent (after draining the queue)."""
        await asyncio.to_thread(self.publisher.drain)
        return web.json_response({"kv_seq": self.publisher.last_seq, "published": self.publisher.published,
                                  "backend": self.config.backend})

    async def sim_drop_kv_batches(self, request: web.Request) -> web.Response:
        """Drop the next N live batches (``?n=``, default 1); they stay in the replay buffer."""
        try:
            n = int(request.query.get("n", "1"))
        except ValueError:
            return web.json_response({"error": {"message": "n must be an integer"}}, status=400)
        await asyncio.to_thread(self.publisher.drain)
        self.publisher.drop_live = max(0, n)
        return web.json_response({"drop_live": self.publisher.drop_live})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": "text/plain; version=0.0.4"})

    def max_tokens_cap(self, prompt_len: int, requested: int, explicit: bool) -> int:
        """Explicit max_tokens must fit (checked by the caller); the default is capped."""
        limit = self.processor.max_model_len
        if explicit or limit is None:
            return requested
        return max(1, min(requested, limit - prompt_len))


def _bound_port(runner: web.AppRunner, requested: int) -> int:
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return requested


async def serve(config: SimConfig, *, out=None) -> None:  # noqa: ANN001 - a text stream
    """Run until SIGINT/SIGTERM; print the SIM_READY line once serving."""
    out = out or sys.stdout
    worker = SimWorker(config)
    await worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-POSIX
            pass
    print("SIM_READY " + json.dumps(worker.ready_info(), separators=(",", ":")), file=out, flush=True)
    try:
        await stop.wait()
    finally:
        await worker.stop()
