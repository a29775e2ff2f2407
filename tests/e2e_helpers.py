"""End-to-end fleet: simulated workers in separate processes + the router in-process.

Synchronisation is on explicit signals only:
- a worker counts as subscribed once the router has applied one of its messages
  (``warm_up`` publishes a harmless AllBlocksCleared probe until one is seen --
  the ZMQ slow-joiner window closes then);
- after a request, ``sync`` waits until the router has applied every batch the
  worker reports having published (``GET /sim/state`` → ``kv_seq``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

import aiohttp

from mmroute.api.app import start_background
from mmroute.api.context import AppContext
from mmroute.config import RouterConfig, WorkerSpec
from mmroute.demo import SimProcess

HERE = os.path.dirname(__file__)
MODELS = os.path.join(HERE, "fixtures", "models")
QWEN25_VL = os.path.join(MODELS, "Qwen__Qwen2.5-VL-7B-Instruct")
WAIT = 30.0


def start_sims(n: int, model: str, extra: list[str] | None = None, per_worker: list[list[str]] | None = None) -> list[SimProcess]:
    def one(i: int) -> SimProcess:
        args = ["--model", model, "--served-model-name", "m", "--port", "0", "--log-level", "warning",
                *(extra or []), *((per_worker or [[]] * n)[i])]
        return SimProcess.start(args)

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


@contextlib.contextmanager
def running_sims(n: int, model: str, extra: list[str] | None = None) -> Iterator[list[SimProcess]]:
    """``start_sims``, stopped again on exit (the body of a module-scoped fixture)."""
    procs = start_sims(n, model, extra)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@dataclass
class Fleet:
    sims: list[SimProcess]
    ctx: AppContext
    runner: Any
    port: int
    session: aiohttp.ClientSession
    names: list[str] = field(default_factory=list)
    own_sims: bool = False  # stop the worker processes on close

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any, Any]:
        async with self.session.post(self.url + path, json=body, **kw) as r:
            data = await r.json(content_type=None) if r.content_type != "text/event-stream" else await r.text()
            return r.status, data, r.headers

    async def chat(self, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, dict[str, Any]]:
        status, data, headers = await self.post("/v1/chat/completions",
                                                {"model": "m", "messages": messages, "max_tokens": 4, **extra})
        assert status == 200, data
        return headers["x-mmroute-worker"], data

    async def explain(self, body: dict[str, Any]) -> dict[str, Any]:
        status, data, _ = await self.post("/router/explain?tokens=1", body)
        assert status == 200, data
        return data

    async def metrics_text(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            return await r.text()

    def sim(self, name: str) -> SimProcess:
        return self.sims[self.names.index(name)]

    async def sim_state(self, name: str) -> dict[str, Any]:
        async with self.session.get(self.sim(name).url + "/sim/state") as r:
            assert r.status == 200
            return await r.json()

    def _subs(self, name: str) -> list[Any]:
        return [s for (wid, _), s in self.ctx.subscribers.items() if wid == name]

    async def warm_up(self) -> None:
        """Probe each worker's publisher until the router has applied one of its messages."""
        await self.ctx.registry.wait_healthy(len(self.sims), WAIT)
        for name, sim in zip(self.names, self.sims):
            probe = "/flush_cache" if "--backend" in sim.proc.args and "sglang" in sim.proc.args else "/reset_prefix_cache"
            for _ in range(400):
                subs = self._subs(name)
                if subs and subs[0].messages_applied > 0:
                    break
                async with self.session.post(sim.url + probe) as r:
                    assert r.status == 200, await r.text()
                if subs:
                    await subs[0].wait_for(lambda s: s.messages_applied > 0, 0.05)
                else:
                    await asyncio.sleep(0.05)  # registry has not created the subscriber yet
            else:
                raise AssertionError(f"router never saw a KV event from {name}")

    async def sync(self) -> None:
        """Wait until the router has applied every batch each worker has published."""
        for name in self.names:
            want = (await self.sim_state(name))["kv_seq"]
            if want is None:
                continue
            sub = self._subs(name)[0]
            ok = await sub.wait_for(lambda s: s.last_seq is not None and s.last_seq >= want, WAIT)
            assert ok, f"router did not catch up with {name}: seq {sub.last_seq} < {want}"

    async def close(self) -> None:
        await self.session.close()
        await self.runner.cleanup()
        if self.own_sims:
            for s in self.sims:
                s.stop()


async def start_fleet(sims: list[SimProcess], model: str, *, names: list[str] | None = None,
                      replay: bool = True, own_sims: bool = False, bare_specs: bool = False, **cfg: Any) -> Fleet:
    """``bare_specs``: only URL and name, the rest discovered from the worker (SGLang)."""
    names = names or [f"w{i}" for i in range(len(sims))]
    specs = [f"{s.url},name={n}" if bare_specs else s.spec(name=n, replay=replay) for s, n in zip(sims, names)]
    config = RouterConfig(model=model, served_model_name=["m"], port=0,
                          workers=[WorkerSpec.parse(s) for s in specs],
                          health_interval=0.5, **cfg)
    ctx = AppContext(config)
    runner, port = await start_background(config, ctx)
    fleet = Fleet(sims, ctx, runner, port, aiohttp.ClientSession(), names, own_sims)
    try:
        await fleet.warm_up()
    except BaseException:
        await fleet.close()
        raise
    return fleet


def png_bytes(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30), fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(url: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total
