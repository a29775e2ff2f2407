"""Worker registry: backend detection, KV-event source discovery, health and load.

Every worker is detected from itself (ENGINES.md §3.5, §1.1, §2.6): an SGLang server
answers ``/server_info`` (alias ``/get_server_info``) with its server args (``page_size``,
``dp_size``, ``version`` and, since SGLang PR #25844, a ``kv_events`` section); a vLLM
server answers ``/version`` and, from 0.33, ``/kv_event_sources``. ``backend=`` in the
worker spec only overrides the guess. A worker that is down at start-up is not waited
for: it stays ``unknown``/unhealthy and the health loop detects it when it comes up.

The health loop polls ``/health`` and scrapes ``/metrics`` for the engine's own queue
(``vllm:num_requests_waiting`` / ``sglang:num_queue_reqs`` ...), which the scheduler
blends into its cost. ``on_change`` callbacks tell the api when kv sources become known
or change (to (re)start KV subscribers) and when health flips.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from mmroute.config import ConfigError, WorkerSpec
from mmroute.metrics import Metrics

log = logging.getLogger("mmroute.workers")

BACKEND_VLLM = "vllm"
BACKEND_SGLANG = "sglang"
BACKEND_UNKNOWN = "unknown"

# on_change reasons.
CHANGE_KV_SOURCES = "kv_sources"  # kv_sources first known (start) or changed
CHANGE_BACKEND = "backend"  # backend / version / page size first known or changed
CHANGE_UP = "up"
CHANGE_DOWN = "down"

# Hosts a publisher binds to that a subscriber cannot dial: replaced by the worker's host.
_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}

PAGE_SIZE_1_HINT = (
    "SGLang worker {wid} runs with a page size of 1 token: its KV events would carry one "
    "event per token and block-level routing cannot use them. Restart the worker with "
    "--page-size 16 (or more), or pass --allow-page-size-1 to the router to accept it."
)


@dataclass(frozen=True)
class KVSource:
    """One KV-event publisher of a worker (one per data-parallel rank)."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass
class Worker:
    spec: WorkerSpec
    id: str = ""
    url: str = ""
    backend: str = BACKEND_UNKNOWN
    version: str | None = None
    healthy: bool = False
    kv_sources: list[KVSource] = field(default_factory=list)
    page_size: int | None = None  # SGLang page size / vLLM block size when discoverable
    dp_size: int | None = None
    reported_waiting: int | None = None
    reported_running: int | None = None
    kv_usage: float | None = None
    last_ok: float | None = None  # time.time() of the last good health check
    error: str | None = None
    mm_hashes_ok: bool = True  # flipped off by the api for SGLang builds ignoring mm_hashes
    # SGLang --incremental-streaming-output: /generate streams text deltas, not cumulative text.
    incremental_stream: bool = False
    detected: bool = False  # backend/kv discovery ran against the live worker
    unusable: str | None = None  # a configuration problem (e.g. page size 1): never routed to

    def __post_init__(self) -> None:
        if not self.id:
            self.id = self.spec.id
        if not self.url:
            self.url = self.spec.url.rstrip("/")
        if self.backend == BACKEND_UNKNOWN and self.spec.backend != "auto":
            self.backend = self.spec.backend
        if not self.kv_sources:
            self.kv_sources = _spec_sources(self.spec)

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def usable(self) -> bool:
        """Healthy and not refused for a configuration problem: may be routed to."""
        return self.healthy and self.unusable is None

    def snapshot(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "backend": self.backend,
            "backend_override": self.spec.backend if self.spec.backend != "auto" else None,
            "version": self.version,
            "healthy": self.healthy,
            "usable": self.usable,
            "error": self.unusable or self.error,
            "last_ok": self.last_ok,
            "page_size": self.page_size,
            "dp_size": self.dp_size,
            "kv_sources": [
                {"dp_rank": s.dp_rank, "endpoint": s.endpoint, "replay_endpoint": s.replay_endpoint, "topic": s.topic}
                for s in self.kv_sources
            ],
            "reported_waiting": self.reported_waiting,
            "reported_running": self.reported_running,
            "kv_usage": self.kv_usage,
            "mm_hashes_ok": self.mm_hashes_ok,
            "incremental_stream": self.incremental_stream,
        }


ChangeCallback = Callable[[Worker, str], Any]


class _Unreachable(Exception):
    """The worker did not answer at all (connection refused, timeout, reset)."""


class _Slow(Exception):
    """Connected, but the answer did not come within the read timeout."""


_SOCKET_READ_TIMEOUT = getattr(aiohttp, "SocketTimeoutError", ())


class WorkerRegistry:
    """All workers of one router; owns the detection and health tasks."""

    def __init__(
        self,
        specs: Iterable[WorkerSpec],
        *,
        session: aiohttp.ClientSession | None = None,
        metrics: Metrics | None = None,
        health_interval: float = 2.0,
        allow_page_size_1: bool = False,
        probe_timeout: float = 5.0,
        health_read_timeout: float = 30.0,
    ) -> None:
        self.workers: dict[str, Worker] = {}
        for spec in specs:
            w = Worker(spec)
            if w.id in self.workers:
                raise ConfigError(f"duplicate worker id {w.id!r} (give each a name=)")
            self.workers[w.id] = w
        self._session = session
        self._own_session = session is None
        self.metrics = metrics
        self.health_interval = health_interval
        self.allow_page_size_1 = allow_page_size_1
        self.probe_timeout = probe_timeout
        self.health_read_timeout = health_read_timeout
        self.on_change: list[ChangeCallback] = []
        self._tasks: list[asyncio.Task] = []
        self._cb_tasks: set[asyncio.Task] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._state_event: asyncio.Event | None = None
        self._started = False
        self._quiet = False

    # ---- public ---------------------------------------------------------------------------

    def get(self, worker_id: str) -> Worker:
        return self.workers[worker_id]

    def healthy_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.usable]

    async def start(self) -> None:
        """Detect every worker concurrently, run one health check, start the health loops.

        Raises ``ConfigError`` when a reachable worker is configured in a way the router
        must refuse (SGLang page size 1 without ``allow_page_size_1``). Dead workers do
        not block: they stay unhealthy and are detected when they come up.
        ``on_change`` callbacks registered before ``start`` see the initial state
        (``kv_sources`` and ``backend`` for every worker, ``up`` for healthy ones).
        """
        if self._started:
            return
        self._started = True
        if self._state_event is None:
            self._state_event = asyncio.Event()
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.probe_timeout),
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=4),
            )
        for w in self.workers.values():
            if self.metrics is not None:
                self.metrics.worker_up.labels(w.id).set(0)
        # Callbacks see the settled initial state once, not every intermediate step.
        self._quiet = True
        try:
            await asyncio.gather(*(self._check(w) for w in self.workers.values()))
        finally:
            self._quiet = False
        refused = [w.unusable for w in self.workers.values() if w.unusable]
        if refused:
            await self.stop()
            raise ConfigError("; ".join(refused))
        for w in self.workers.values():
            self._emit(w, CHANGE_BACKEND)
            self._emit(w, CHANGE_KV_SOURCES)
            if w.healthy:
                self._emit(w, CHANGE_UP)
        self._tasks = [asyncio.create_task(self._loop(w), name=f"health:{w.id}") for w in self.workers.values()]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        cbs = list(self._cb_tasks)
        for t in cbs:
            t.cancel()
        await asyncio.gather(*tasks, *cbs, return_exceptions=True)
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
        self._started = False

    async def check_now(self, worker_id: str | None = None) -> None:
        """One detection/health round right now (all workers, or one)."""
        ws = [self.workers[worker_id]] if worker_id else list(self.workers.values())
        await asyncio.gather(*(self._check(w) for w in ws))

    def mark_failed(self, worker_id: str, reason: str) -> None:
        """The proxy could not reach the worker: unhealthy until the next good check."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.error = reason
        if w.healthy:
            log.warning("worker %s marked down: %s", w.id, reason)
            self._set_health(w, False)

    async def wait_healthy(self, n: int = 1, timeout: float = 30.0) -> None:
        """Wait until at least ``n`` workers are usable; ``TimeoutError`` says which are not."""
        if self._state_event is None:
            self._state_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.healthy_workers()) < n:
            left = deadline - loop.time()
            ev = self._state_event
            try:
                await asyncio.wait_for(ev.wait(), max(left, 0.0))
            except asyncio.TimeoutError:
                down = ", ".join(f"{w.id}: {w.unusable or w.error or 'not healthy'}" for w in self.workers.values() if not w.usable)
                raise TimeoutError(f"fewer than {n} healthy workers after {timeout}s ({down})") from None

    def snapshot(self) -> list[dict[str, Any]]:
        return [w.snapshot() for w in self.workers.values()]

    # ---- health loop ----------------------------------------------------------------------

    async def _loop(self, w: Worker) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self._check(w)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad answer kill the loop
                log.exception("health check of %s failed", w.id)

    async def _check(self, w: Worker) -> None:
        lock = self._locks.setdefault(w.id, asyncio.Lock())
        async with lock:
            try:
                # Re-detect when the worker comes back: a restart may change its version,
                # page size or (vLLM tcp://*:0) its event ports.
                if not w.detected or not w.healthy:
                    await self._detect(w)
                status = await self._health_status(w)
            except _Unreachable as exc:
                w.error = f"unreachable: {exc}"
                self._set_health(w, False)
                return
            if status is None:
                log.debug("worker %s: /health is slow; keeping its state", w.id)
                return
            if status != 200:
                w.error = f"/health answered {status}"
                self._set_health(w, False)
                return
            w.error = None
            w.last_ok = time.time()
            await self._scrape_metrics(w)
            self._set_health(w, w.unusable is None)

    def _set_health(self, w: Worker, healthy: bool) -> None:
        if self.metrics is not None:
            self.metrics.worker_up.labels(w.id).set(1 if healthy else 0)
        if healthy == w.healthy:
            return
        w.healthy = healthy
        self._emit(w, CHANGE_UP if healthy else CHANGE_DOWN)

    def _emit(self, w: Worker, what: str) -> None:
        if self._state_event is not None:
            self._state_event.set()
            self._state_event = asyncio.Event()
        if self._quiet:
            return
        for cb in list(self.on_change):
            try:
                res = cb(w, what)
                if inspect.isawaitable(res):
                    t = asyncio.ensure_future(res)
                    self._cb_tasks.add(t)
                    t.add_done_callback(self._cb_done)
            except Exception:
                log.exception("on_change callback failed for %s (%s)", w.id, what)

    def _cb_done(self, t: asyncio.Task) -> None:
        self._cb_tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("on_change callback failed", exc_info=t.exception())

    # ---- HTTP probes ----------------------------------------------------------------------

    async def _get(self, w: Worker, path: str, timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, bytes]:
        assert self._session is not None, "WorkerRegistry.start() was not called"
        try:
            async with self._session.get(
                w.url + path, timeout=timeout or aiohttp.ClientTimeout(total=self.probe_timeout)
            ) as resp:
                return resp.status, await resp.read()
        except _SOCKET_READ_TIMEOUT as exc:
            raise _Slow(str(exc)) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _Unreachable(f"GET {path}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc

    async def _get_json(self, w: Worker, path: str) -> tuple[int, Any]:
        status, body = await self._get(w, path)
        if status != 200:
            return status, None
        try:
            return status, json.loads(body)
        except ValueError:
            return status, None

    async def _health_status(self, w: Worker) -> int | None:
        """/health status; None when the worker accepted the connection but is slow to
        answer (SGLang's /health runs a 1-token generation, ENGINES.md §3.5): busy, not down."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.probe_timeout, sock_read=self.health_read_timeout)
        try:
            status, _ = await self._get(w, "/health", timeout)
        except _Slow:
            return None
        return status

    async def _scrape_metrics(self, w: Worker) -> None:
        try:
            status, body = await self._get(w, "/metrics")
        except _Unreachable:
            return
        if status != 200:
            w.reported_waiting = w.reported_running = None
            w.kv_usage = None
            return
        load = parse_engine_load(body.decode("utf-8", "replace"))
        w.reported_waiting = load.waiting
        w.reported_running = load.running
        w.kv_usage = load.kv_usage

    # ---- detection ------------------------------------------------------------------------

    async def _detect(self, w: Worker) -> None:
        """Find backend, version, page size and kv sources; raises ``_Unreachable``."""
        before = (w.backend, w.version, w.page_size, w.dp_size)
        old_sources = list(w.kv_sources)
        forced = w.spec.backend
        info = None
        if forced in ("auto", BACKEND_SGLANG):
            for path in ("/server_info", "/get_server_info"):
                _, js = await self._get_json(w, path)
                if isinstance(js, dict) and "page_size" in js:
                    info = js
                    break
        if info is not None:
            self._apply_sglang(w, info)
        elif forced == BACKEND_SGLANG:
            log.warning("worker %s: backend=sglang but /server_info did not answer; using the spec's kv endpoint", w.id)
            w.backend = BACKEND_SGLANG
        else:
            _, js = await self._get_json(w, "/version")
            w.backend = BACKEND_VLLM
            if isinstance(js, dict) and isinstance(js.get("version"), str):
                w.version = js["version"]
            elif forced == "auto":
                log.warning(
                    "worker %s answers neither /server_info nor /version: assuming an OpenAI-compatible vLLM worker", w.id
                )
            await self._discover_vllm_sources(w)
        w.detected = True
        if (w.backend, w.version, w.page_size, w.dp_size) != before:
            log.info(
                "worker %s: backend %s version %s page size %s kv %s",
                w.id, w.backend, w.version, w.page_size, [s.endpoint for s in w.kv_sources],
            )
            self._emit(w, CHANGE_BACKEND)
        if w.kv_sources != old_sources:
            self._emit(w, CHANGE_KV_SOURCES)

    def _apply_sglang(self, w: Worker, info: dict[str, Any]) -> None:
        w.backend = BACKEND_SGLANG
        version = info.get("version")
        w.version = version if isinstance(version, str) else None
        kv = info.get("kv_events")
        kv = kv if isinstance(kv, dict) else None
        page = _as_int(info.get("page_size"))
        if page is None and kv is not None:
            page = _as_int(kv.get("block_size"))
        w.page_size = page
        w.dp_size = _as_int(info.get("dp_size"))
        w.incremental_stream = info.get("incremental_streaming_output") is True
        if page == 1 and not self.allow_page_size_1:
            w.unusable = PAGE_SIZE_1_HINT.format(wid=w.id)
            log.error("%s", w.unusable)
        else:
            w.unusable = None
        if w.spec.kv_explicit:
            return  # the operator's kv= wins over discovery
        if kv is None or _as_int(kv.get("endpoint_port_base")) is None:
            log.warning(
                "worker %s: SGLang /server_info has no kv_events section (events off or an older build); "
                "subscribing to %s", w.id, w.spec.kv_endpoint,
            )
            w.kv_sources = _spec_sources(w.spec)
            return
        w.kv_sources = sglang_kv_sources(kv, w.spec)

    async def _discover_vllm_sources(self, w: Worker) -> None:
        if w.spec.kv_explicit:
            return
        # vLLM 0.33: GET /kv_event_sources -> {dp_rank: KVEventsConfig} with resolved ports.
        try:
            _, js = await self._get_json(w, "/kv_event_sources")
        except _Unreachable:
            js = None
        found = vllm_kv_sources(js, w.spec) if isinstance(js, dict) else []
        w.kv_sources = found or _spec_sources(w.spec)


# ---- pure helpers ---------------------------------------------------------------------------


def _as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _spec_sources(spec: WorkerSpec) -> list[KVSource]:
    if not spec.kv_endpoint:
        return []
    return [KVSource(0, spec.kv_endpoint, spec.replay_endpoint, "")]


def substitute_host(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` -> ``tcp://HOST:5557`` (also 0.0.0.0 / ::): the worker binds, we dial."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://"):]
    if rest.startswith("["):
        h, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        h, _, port = rest.rpartition(":")
    if h in _WILDCARD_HOSTS or h == "::":
        h = host
    return f"tcp://{_host_for_url(h)}:{port}"


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """Data-parallel rank r publishes on base port + r (ENGINES.md §1.2, §3.1)."""
    if endpoint is None or rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    u = urlsplit(endpoint)
    if not u.port:
        return endpoint
    netloc = f"{_host_for_url(u.hostname or '')}:{u.port + rank}"
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def sglang_kv_sources(kv: dict[str, Any], spec: WorkerSpec) -> list[KVSource]:
    """KV sources from SGLang's ``/server_info.kv_events`` (ENGINES.md §3.5):
    ``tcp://{endpoint_host, '*' -> worker host}:{endpoint_port_base + r}`` for r < dp_size."""
    base = _as_int(kv.get("endpoint_port_base"))
    if base is None:
        return []
    host = kv.get("endpoint_host")
    host = spec.host if not isinstance(host, str) or host.strip("[]") in _WILDCARD_HOSTS else host.strip("[]")
    dp = max(1, _as_int(kv.get("dp_size")) or 1)
    topic = kv.get("topic") if isinstance(kv.get("topic"), str) else ""
    return [
        KVSource(r, f"tcp://{_host_for_url(host)}:{base + r}", offset_port(spec.replay_endpoint, r), topic)
        for r in range(dp)
    ]


def vllm_kv_sources(js: dict[Any, Any], spec: WorkerSpec) -> list[KVSource]:
    """KV sources from vLLM 0.33's ``/kv_event_sources`` (``{dp_rank: KVEventsConfig}``)."""
    out: list[KVSource] = []
    for key, cfg in js.items():
        rank = _as_int(key)
        if rank is None or not isinstance(cfg, dict):
            continue
        if cfg.get("enable_kv_cache_events") is False or ("publisher" in cfg and cfg["publisher"] in ("null", None)):
            continue  # events off on that rank: nothing to subscribe to
        ep = cfg.get("endpoint")
        if not isinstance(ep, str) or not ep:
            continue
        replay = cfg.get("replay_endpoint")
        replay = substitute_host(replay, spec.host) if isinstance(replay, str) and replay else spec.replay_endpoint
        topic = cfg.get("topic") if isinstance(cfg.get("topic"), str) else ""
        out.append(KVSource(rank, substitute_host(ep, spec.host), replay, topic))
    out.sort(key=lambda s: s.dp_rank)
    return out


@dataclass
class EngineLoad:
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None


# Prometheus names (ENGINES.md §2.6, §3.5): summed over label sets (DP engines), usage averaged.
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
_WANTED = {n: k for k, names in (("w", _WAITING), ("r", _RUNNING), ("u", _USAGE)) for n in names}


def parse_engine_load(text: str) -> EngineLoad:
    """Small parser for the Prometheus text format, reading only the load gauges."""
    sums = {"w": 0.0, "r": 0.0, "u": 0.0}
    counts = {"w": 0, "r": 0, "u": 0}
    for line in text.splitlines():
        if not line or line[0] == "#" or not (line.startswith("vllm:") or line.startswith("sglang:")):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            end = line.rfind("}")
            rest = line[end + 1:].split() if end != -1 else []
        else:
            name = line[:space] if space != -1 else line
            rest = line[space + 1:].split() if space != -1 else []
        key = _WANTED.get(name)
        if key is None or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        sums[key] += value
        counts[key] += 1
    return EngineLoad(
        waiting=int(sums["w"]) if counts["w"] else None,
        running=int(sums["r"]) if counts["r"] else None,
        kv_usage=sums["u"] / counts["u"] if counts["u"] else None,
    )
