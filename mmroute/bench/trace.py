"""Routing quality on a real request trace: KV-aware vs load-only policies, side by side.

Replays a Mooncake trace (FAST'25 release; one JSON object per request with
``hash_ids`` naming 512-token prefix blocks) through the router in front of
simulated vLLM workers with a finite KV cache and a latency model, once per
policy, and reports the prefix-cache hit rate the workers *reported*
(``cached_tokens``), time to first token and throughput. Equal hash ids become
equal synthetic text, so shared prefixes in the trace are shared prefixes here.

    python -m mmroute.bench.trace --trace tests/fixtures/traces/mooncake_conversation_head2000.jsonl.xz

The workers are separate processes (``mmroute sim-worker``); nothing leaves loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import lzma
import random
import statistics
import time
from typing import Any

import aiohttp

from mmroute.api.app import start_background
from mmroute.api.context import AppContext
from mmroute.config import RouterConfig, WorkerSpec
from mmroute.demo import SimProcess, demo_model_path

_WORDS = ("river stone maple cloud lantern harbor meadow copper violet thunder willow ember falcon "
          "orchard quartz saddle tunnel velvet glacier pepper cobalt juniper marble nectar").split()


def load_trace(path: str, limit: int) -> list[dict[str, Any]]:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as fh:
        return [json.loads(line) for _, line in zip(range(limit), fh)]


def block_text(hash_id: int, words: int) -> str:
    rng = random.Random(hash_id * 7919 + 17)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def request_body(rec: dict[str, Any], words_per_block: int, max_tokens: int) -> dict[str, Any]:
    prompt = " ".join(block_text(h, words_per_block) for h in rec["hash_ids"])
    return {"model": "bench", "prompt": prompt, "max_tokens": max(1, min(max_tokens, rec.get("output_length", 16))),
            "stream": True, "stream_options": {"include_usage": True}}


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": r.status}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "usage": usage}


async def run_policy(policy: str, sims: list[SimProcess], records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        for sim in sims:  # every policy starts from cold caches
            async with s.post(sim.url + "/reset_prefix_cache") as r:
                r.raise_for_status()
    cfg = RouterConfig(model=demo_model_path(), served_model_name=["bench"], port=0, policy=policy,
                       workers=[WorkerSpec.parse(sim.spec(name=f"w{i}")) for i, sim in enumerate(sims)])
    ctx = AppContext(cfg, rng=random.Random(0))
    runner, port = await start_background(cfg, ctx)
    url = f"http://127.0.0.1:{port}"
    results: list[dict[str, Any]] = []
    try:
        await ctx.registry.wait_healthy(len(sims), 60)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for rec in records:
            queue.put_nowait(rec)
        t0 = time.perf_counter()
        conn = aiohttp.TCPConnector(limit=args.concurrency)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def worker() -> None:
                while not queue.empty():
                    rec = queue.get_nowait()
                    results.append(await _one(session, url, request_body(rec, args.words_per_block, args.max_tokens)))

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        text = ctx.metrics.render().decode()
    finally:
        await runner.cleanup()
    ok = [r for r in results if r.get("usage")]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for r in ok)
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    mismatch = sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("mmroute_prediction_mismatch_total{"))
    return {
        "policy": policy,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_mean_s": round(statistics.mean(ttfts), 4) if ttfts else None,
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4) if ttfts else None,
        "ttft_p90_s": round(ttfts[int(len(ttfts) * 0.9)], 4) if ttfts else None,
        "wall_s": round(wall, 2),
        "prompt_tokens_per_s": round(prompt / wall),
        "prediction_mismatches": int(mismatch),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake JSONL trace (.jsonl or .jsonl.xz)")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--words-per-block", type=int, default=48,
                   help="synthetic words per trace hash id (scaled down from 512 tokens to fit a CPU)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=20000, help="KV blocks per simulated worker (lower: cache pressure)")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    p.add_argument("--decode-ms-per-token", type=float, default=2.0)
    p.add_argument("--max-concurrency", type=int, default=16,
                   help="requests a simulated worker runs at once (more wait in its queue); prefills run one at a time")
    p.add_argument("--policies", nargs="+", default=["kv", "round-robin", "least-loaded", "random"])


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    records = load_trace(args.trace, args.requests)
    loop = asyncio.get_running_loop()
    sim_args = ["--model", demo_model_path(), "--served-model-name", "bench", "--port", "0", "--log-level", "warning",
                "--num-blocks", str(args.num_blocks), "--prefill-ms-per-token", str(args.prefill_ms_per_token),
                "--decode-ms-per-token", str(args.decode_ms_per_token), "--max-concurrency", str(args.max_concurrency),
                "--max-model-len", "131072"]
    sims = await asyncio.gather(*(loop.run_in_executor(None, SimProcess.start, sim_args) for _ in range(args.workers)))
    try:
        return [await run_policy(p, list(sims), records, args) for p in args.policies]
    finally:
        for s in sims:
            s.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args()
    rows = asyncio.run(_main(args))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
