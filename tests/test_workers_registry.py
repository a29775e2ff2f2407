"""WorkerRegistry against real fake workers on 127.0.0.1: detection, discovery, health."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import pytest
from aiohttp import web

from mmroute.config import ConfigError, WorkerSpec
from mmroute.metrics import Metrics
from mmroute.workers.registry import (
    KVSource,
    WorkerRegistry,
    offset_port,
    parse_engine_load,
    substitute_host,
)
from proxy_helpers import free_port, serve

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""

SGLANG_METRICS = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0"} 9.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0"} 0.5
"""


class FakeWorker:
    """A configurable engine-like HTTP server (vLLM or SGLang surface)."""

    def __init__(self, kind: str, *, server_info: dict | None = None, kv_sources: dict | None = None,
                 alias_only: bool = False, version: str = "0.33.0") -> None:
        self.kind = kind
        self.health_status = 200
        self.health_hangs = False
        self.server_info = server_info
        self.kv_sources = kv_sources
        self.hits: dict[str, int] = {}
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.version = version
        if kind == "vllm":
            app.router.add_get("/version", self._version)
            if kv_sources is not None:
                app.router.add_get("/kv_event_sources", self._kv_sources)
        elif kind == "sglang":
            if not alias_only:
                app.router.add_get("/server_info", self._server_info)
            app.router.add_get("/get_server_info", self._server_info)
        self.app = app

    async def _version(self, request: web.Request) -> web.Response:
        return await self._json(request, {"version": self.version})

    async def _kv_sources(self, request: web.Request) -> web.Response:
        return await self._json(request, self.kv_sources)

    async def _server_info(self, request: web.Request) -> web.Response:
        return await self._json(request, self.server_info)

    async def _json(self, request: web.Request, obj: dict) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        return web.json_response(obj)

    async def _health(self, request: web.Request) -> web.Response:
        self.hits["/health"] = self.hits.get("/health", 0) + 1
        if self.health_hangs:
            await asyncio.Event().wait()
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = {"vllm": VLLM_METRICS, "sglang": SGLANG_METRICS}.get(self.kind, "")
        return web.Response(text=text, content_type="text/plain")


def sglang_info(page_size: int = 16, dp_size: int = 2, host: str = "*", base: int = 6100, version: str = "0.5.23") -> dict:
    return {
        "model_path": "Qwen/Qwen2.5-VL-7B-Instruct",
        "page_size": page_size,
        "dp_size": dp_size,
        "version": version,
        "incremental_streaming_output": False,
        "kv_events": {
            "publisher": "zmq", "endpoint_host": host, "endpoint_port_base": base,
            "topic": "", "block_size": page_size, "dp_size": dp_size,
        },
    }


@contextlib.asynccontextmanager
async def running(reg: WorkerRegistry) -> AsyncIterator[WorkerRegistry]:
    """``reg`` started (a failed start raises, nothing to stop), stopped on exit."""
    await reg.start()
    try:
        yield reg
    finally:
        await reg.stop()


async def test_vllm_detection_kv_event_sources_and_metrics():
    fw = FakeWorker("vllm", kv_sources={
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5601",
              "replay_endpoint": "tcp://*:5602", "topic": "kv-events"},
        "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://0.0.0.0:5603",
              "replay_endpoint": None, "topic": "kv-events"},
    })
    metrics = Metrics()
    async with serve(fw.app) as url:
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=a")], metrics=metrics, health_interval=60)
        seen: list[tuple[str, str]] = []
        reg.on_change.append(lambda w, what: seen.append((w.id, what)))
        async with running(reg):
            w = reg.get("a")
            assert (w.backend, w.version, w.healthy, w.usable) == ("vllm", "0.33.0", True, True)
            assert w.kv_sources == [
                KVSource(0, "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602", "kv-events"),
                KVSource(1, "tcp://127.0.0.1:5603", None, "kv-events"),
            ]
            assert (w.reported_running, w.reported_waiting, w.kv_usage) == (5, 5, 0.5)
            assert ("a", "kv_sources") in seen and ("a", "backend") in seen and ("a", "up") in seen
            assert metrics.registry.get_sample_value("mmroute_worker_up", {"worker": "a"}) == 1.0
            snap = reg.snapshot()[0]
            assert snap["backend"] == "vllm" and snap["healthy"] is True
            assert snap["kv_sources"][0]["endpoint"] == "tcp://127.0.0.1:5601"
            assert fw.hits.get("/server_info") is None  # 404 on a vLLM: not SGLang


async def test_vllm_default_and_explicit_kv():
    fw = FakeWorker("vllm", kv_sources={"0": {"endpoint": "tcp://*:7000", "publisher": "zmq"}})
    plain = FakeWorker("vllm")  # no /kv_event_sources (vLLM < 0.33)
    async with serve(fw.app) as url, serve(plain.app) as url2:
        reg = WorkerRegistry(
            [
                WorkerSpec.parse(f"{url},name=explicit,kv=tcp://10.1.2.3:9999,replay=tcp://10.1.2.3:9998"),
                WorkerSpec.parse(f"{url2},name=default,replay=tcp://127.0.0.1:5558"),
            ],
            health_interval=60,
        )
        async with running(reg):
            assert reg.get("explicit").kv_sources == [KVSource(0, "tcp://10.1.2.3:9999", "tcp://10.1.2.3:9998", "")]
            assert fw.hits.get("/kv_event_sources") is None  # kv= given: discovery never asked
            assert reg.get("default").kv_sources == [KVSource(0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "")]
            assert reg.get("default").backend == "vllm"


async def test_sglang_discovery_host_substitution_and_dp_ports():
    fw = FakeWorker("sglang", server_info=sglang_info(dp_size=2, base=6100))
    async with serve(fw.app) as url:
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=s,replay=tcp://127.0.0.1:6200")], health_interval=60)
        async with running(reg):
            w = reg.get("s")
            assert (w.backend, w.version, w.page_size, w.dp_size) == ("sglang", "0.5.23", 16, 2)
            assert w.kv_sources == [
                KVSource(0, "tcp://127.0.0.1:6100", "tcp://127.0.0.1:6200", ""),
                KVSource(1, "tcp://127.0.0.1:6101", "tcp://127.0.0.1:6201", ""),
            ]
            assert (w.reported_running, w.reported_waiting, w.kv_usage) == (7, 9, 0.5)
            assert w.incremental_stream is False


async def test_sglang_alias_explicit_host_and_explicit_kv():
    fw = FakeWorker("sglang", server_info=sglang_info(dp_size=1, host="10.9.8.7", base=5557), alias_only=True)
    async with serve(fw.app) as url:
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=s")], health_interval=60)
        async with running(reg):
            w = reg.get("s")
            assert w.backend == "sglang"  # found through /get_server_info
            assert w.kv_sources == [KVSource(0, "tcp://10.9.8.7:5557", None, "")]
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=s,kv=tcp://127.0.0.1:7777")], health_interval=60)
        async with running(reg):
            assert reg.get("s").kv_sources == [KVSource(0, "tcp://127.0.0.1:7777", None, "")]
            assert reg.get("s").page_size == 16


async def test_sglang_page_size_1_refused_with_hint():
    fw = FakeWorker("sglang", server_info=sglang_info(page_size=1, dp_size=1))
    async with serve(fw.app) as url:
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=p1")], health_interval=60)
        with pytest.raises(ConfigError) as ei:
            await reg.start()
        msg = str(ei.value)
        assert "p1" in msg and "--page-size 16" in msg and "page size of 1" in msg
        assert reg.get("p1").usable is False
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=p1")], health_interval=60, allow_page_size_1=True)
        async with running(reg):
            assert reg.get("p1").usable and reg.get("p1").page_size == 1


async def test_backend_override_and_unrecognised_worker():
    fw = FakeWorker("sglang", server_info=sglang_info(dp_size=1))
    bare = FakeWorker("none")  # answers /health only
    async with serve(fw.app) as url, serve(bare.app) as url2:
        reg = WorkerRegistry(
            [WorkerSpec.parse(f"{url},name=forced,backend=vllm"), WorkerSpec.parse(f"{url2},name=bare")],
            health_interval=60,
        )
        async with running(reg):
            assert reg.get("forced").backend == "vllm"
            assert fw.hits.get("/server_info") is None
            assert reg.get("bare").backend == "vllm" and reg.get("bare").version is None
            assert reg.get("bare").healthy


async def test_dead_worker_does_not_block_and_is_detected_later():
    port = free_port()
    fw = FakeWorker("sglang", server_info=sglang_info(dp_size=1, base=6300))
    reg = WorkerRegistry([WorkerSpec.parse(f"http://127.0.0.1:{port},name=late")], health_interval=0.05)
    seen: list[str] = []
    reg.on_change.append(lambda w, what: seen.append(what))
    async with running(reg):
        w = reg.get("late")
        assert (w.backend, w.healthy, w.detected) == ("unknown", False, False)
        assert w.error and "unreachable" in w.error
        assert w.kv_sources == [KVSource(0, "tcp://127.0.0.1:5557", None, "")]  # the spec default meanwhile
        async with serve(fw.app, port=port):
            await reg.wait_healthy(1, timeout=20)
            assert (w.backend, w.detected) == ("sglang", True)
            assert w.kv_sources == [KVSource(0, "tcp://127.0.0.1:6300", None, "")]
            assert "kv_sources" in seen and "up" in seen


async def test_health_flaps_mark_failed_and_restart_rediscovery():
    fw = FakeWorker("sglang", server_info=sglang_info(dp_size=1, base=6400))
    metrics = Metrics()
    async with serve(fw.app) as url:
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=f")], metrics=metrics, health_interval=3600)
        events: list[str] = []
        await reg.start()
        reg.on_change.append(lambda w, what: events.append(what))
        try:
            w = reg.get("f")
            assert w.healthy
            fw.health_status = 503
            await reg.check_now()
            assert not w.healthy and w.error == "/health answered 503"
            assert metrics.registry.get_sample_value("mmroute_worker_up", {"worker": "f"}) == 0.0
            # The worker restarts with two DP ranks: rediscovered on recovery.
            fw.server_info = sglang_info(dp_size=2, base=6400)
            fw.health_status = 200
            await reg.check_now()
            assert w.healthy and [s.endpoint for s in w.kv_sources] == ["tcp://127.0.0.1:6400", "tcp://127.0.0.1:6401"]
            reg.mark_failed("f", "connection refused")
            assert not w.healthy and not w.usable and w.error == "connection refused"
            with pytest.raises(TimeoutError, match="connection refused"):
                await reg.wait_healthy(1, timeout=0)
            await reg.check_now()
            assert w.healthy
            assert events == ["down", "backend", "kv_sources", "up", "down", "up"]
            assert metrics.registry.get_sample_value("mmroute_worker_up", {"worker": "f"}) == 1.0
        finally:
            await reg.stop()


async def test_slow_health_keeps_state():
    fw = FakeWorker("sglang", server_info=sglang_info(dp_size=1))
    async with serve(fw.app) as url:
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=busy")], health_interval=3600, health_read_timeout=0.1)
        async with running(reg):
            assert reg.get("busy").healthy
            fw.health_hangs = True  # a busy SGLang: connected, /health generation still running
            await reg.check_now()
            assert reg.get("busy").healthy and reg.get("busy").error is None


async def test_async_on_change_callback_and_stop_is_clean():
    fw = FakeWorker("vllm")
    async with serve(fw.app) as url:
        reg = WorkerRegistry([WorkerSpec.parse(f"{url},name=x")], health_interval=0.01)
        got = asyncio.Event()

        async def cb(w, what):
            if what == "up":
                got.set()

        reg.on_change.append(cb)
        await reg.start()
        await asyncio.wait_for(got.wait(), 10)
        await reg.stop()
        assert reg._tasks == [] and all(t.done() for t in reg._cb_tasks)


def test_parse_engine_load_edge_cases():
    text = (
        '# HELP vllm:num_requests_waiting x\n'
        'vllm:num_requests_waiting{model_name="a b} c",engine="0"} 2.0 1700000000000\n'
        'vllm:num_requests_waiting 3\n'
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
        'vllm:num_requests_waiting_other 100\n'
        'garbage line\n'
    )
    load = parse_engine_load(text)
    assert (load.waiting, load.running, load.kv_usage) == (5, None, 0.1)
    assert parse_engine_load("") == parse_engine_load("# nothing\n")


def test_endpoint_helpers():
    assert substitute_host("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert substitute_host("tcp://0.0.0.0:5557", "::1") == "tcp://[::1]:5557"
    assert substitute_host("tcp://[::]:5557", "host.example") == "tcp://host.example:5557"
    assert substitute_host("tcp://10.1.1.1:5557", "x") == "tcp://10.1.1.1:5557"
    assert substitute_host("ipc:///tmp/kv", "x") == "ipc:///tmp/kv"
    assert offset_port("tcp://h:5558", 0) == "tcp://h:5558"
    assert offset_port("tcp://h:5558", 3) == "tcp://h:5561"
    assert offset_port(None, 3) is None
