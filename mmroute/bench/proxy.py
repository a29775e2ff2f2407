"""Proxy overhead: the same requests sent straight to a simulated worker and through
the router (full path: parse, render, keys, lookup, schedule, proxy), side by side.

    python -m mmroute.bench.proxy --requests 2000 --concurrency 1 16

The simulated worker answers at once (no latency model), so the difference is the
router's own cost. Client, router and worker share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp

from mmroute.demo import SimProcess, demo_model_path

BODY = {"model": "bench", "max_tokens": 4,
        "messages": [{"role": "system", "content": "You are a terse assistant."},
                     {"role": "user", "content": "Name three prime numbers."}]}


async def _load(url: str, n: int, concurrency: int) -> dict[str, Any]:
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def one() -> None:
            t = time.perf_counter()
            async with s.post(url + "/v1/chat/completions", json=BODY) as r:
                await r.read()
                assert r.status == 200
            lat.append(time.perf_counter() - t)

        for _ in range(20):  # warm-up: connections, caches
            await one()
        lat.clear()
        t0 = time.perf_counter()
        queue = iter(range(n))

        async def worker() -> None:
            for _ in queue:
                await one()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"req_per_s": round(n / wall), "p50_ms": round(lat[len(lat) // 2] * 1e3, 3),
            "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 3), "mean_ms": round(statistics.mean(lat) * 1e3, 3)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("router did not become ready")
            await asyncio.sleep(0.1)


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    sim = await loop.run_in_executor(None, SimProcess.start, ["--model", demo_model_path(), "--served-model-name",
                                                              "bench", "--port", "0", "--log-level", "warning"])
    port = _free_port()
    # The router in its own process, as deployed: the load generator must not share its loop.
    router = subprocess.Popen([sys.executable, "-m", "mmroute", "serve", "--model", demo_model_path(),
                               "--served-model-name", "bench", "--port", str(port), "--log-level", "warning",
                               "--workers", sim.spec(name="w0")])
    rows = []
    try:
        url = f"http://127.0.0.1:{port}"
        await _wait_ready(url)
        for c in args.concurrency:
            direct = await _load(sim.url, args.requests, c)
            routed = await _load(url, args.requests, c)
            rows.append({"concurrency": c, "direct": direct, "routed": routed,
                         "added_p50_ms": round(routed["p50_ms"] - direct["p50_ms"], 3)})
    finally:
        router.terminate()
        router.wait(10)
        sim.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    print(json.dumps(asyncio.run(_main(p.parse_args())), indent=2))


if __name__ == "__main__":
    main()
