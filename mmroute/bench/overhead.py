"""Routing-decision overhead by stage (``mmroute bench``; figures in docs/performance.md).

Runs the router's real request path -- ``api.pipeline.prepare`` (validate, media,
render: template + tokenizer + image expansion) and ``decide`` (hash, lookup,
schedule) -- in-process against an index filled with real BlockStored events for
N workers, and reports p50/p90/p99 per stage. No HTTP, no proxy: this is the cost
the router adds before forwarding.

Scenarios:
  warm   2k-token chat whose system prompt and history were seen before (the case
         KV routing exists for); only the last user turn is new each time.
  cold   2k-token chat never seen before (every word new each time).
  image  warm chat plus one 1280x720 PNG sent as base64 (new picture each time),
         photo-like (~1.4 MB); image-noise: incompressible noise (~2.7 MB), the worst case.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import platform
import random
import statistics
import struct
import time
import zlib
from typing import Any

from mmroute.api.context import AppContext
from mmroute.api.pipeline import decide, prepare
from mmroute.config import RouterConfig, WorkerSpec
from mmroute.demo import demo_model_path
from mmroute.kv.events import BlockStored, EventBatch

_WORDS = ("router cache block prefix worker token engine latency request stream image model vision "
          "schedule index event batch replay sequence chat template assistant system user memory "
          "throughput prefill decode queue cluster fleet replica kernel tensor").split()


def _text(rng: random.Random, n_words: int) -> str:
    # Random word order: every call is a never-seen segment, with ordinary token density.
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


_PNG_CACHE: dict[tuple[int, int, int], bytes] = {}


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def _png(width: int, height: int, seed: int, noise_bits: int = 4) -> bytes:
    """A valid PNG: a vertical gradient plus ``noise_bits`` of noise per channel.
    4 bits compresses like a photo (~1.4 MB at 1280x720); 8 bits is incompressible
    (~2.7 MB), the worst case. Pixels are made once per kind; each seed adds a text
    chunk so the bytes (and the image identifier) differ per request."""
    key = (width, height, noise_bits)
    if key not in _PNG_CACHE:
        rnd = random.Random(0)
        mask = (1 << noise_bits) - 1
        rows = []
        for y in range(height):
            base = (y * (256 - mask - 1)) // max(1, height - 1)
            table = bytes(base + (v & mask) for v in range(256))
            rows.append(b"\x00" + rnd.randbytes(3 * width).translate(table))
        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        _PNG_CACHE[key] = _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"".join(rows), 6))
    text = _chunk(b"tEXt", b"Comment\x00request %d" % seed)
    return b"\x89PNG\r\n\x1a\n" + _PNG_CACHE[key] + text + _chunk(b"IEND", b"")


def _chat(rng: random.Random, history: list[dict[str, Any]], fresh: bool, image: bytes | None) -> dict[str, Any]:
    last: Any = _text(rng, 80)
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        last = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": last}]
    msgs = [dict(m) for m in history] if not fresh else _history(rng)
    return {"model": "bench", "max_tokens": 64, "messages": msgs + [{"role": "user", "content": last}]}


def _history(rng: random.Random) -> list[dict[str, Any]]:
    msgs = [{"role": "system", "content": _text(rng, 780)}]
    for _ in range(3):
        msgs.append({"role": "user", "content": _text(rng, 150)})
        msgs.append({"role": "assistant", "content": _text(rng, 200)})
    return msgs


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = RouterConfig(model=args.model or demo_model_path(), served_model_name=["bench"],
                       workers=[WorkerSpec.parse(f"http://127.0.0.1:{9000 + i},name=w{i}") for i in range(args.workers)],
                       block_size=16)
    ctx = AppContext(cfg, rng=random.Random(0))
    for w in ctx.registry.workers.values():
        w.healthy, w.backend = True, "vllm"  # no live workers: the decision path only
    rng = random.Random(1)
    history = _history(rng)
    results: dict[str, Any] = {}
    for scenario in args.scenarios:
        # Index the shared prefix on worker 0 with real BlockStored events, as a worker would publish them.
        seed_body = _chat(random.Random(2), history, fresh=False, image=None)
        seed_prep = await prepare(ctx, "chat", seed_body)
        toks = seed_prep.prompt.token_ids
        n = len(toks) // 16
        ctx.index.apply("w0", 0, EventBatch(time.time(), [BlockStored(
            block_hashes=list(range(1, n + 1)), parent_block_hash=None, token_ids=toks[: n * 16], block_size=16)]))
        stages: dict[str, list[float]] = {}
        totals: list[float] = []
        tokens: list[int] = []
        for i in range(args.warmup + args.iterations):
            image = None
            if scenario.startswith("image"):
                image = _png(1280, 720, i, noise_bits=8 if scenario == "image-noise" else 4)
            body = _chat(rng, history, fresh=(scenario == "cold"), image=image)
            t0 = time.perf_counter()
            prep = await prepare(ctx, "chat", body)
            t1 = time.perf_counter()
            route = decide(ctx, prep)
            t2 = time.perf_counter()
            if i < args.warmup:
                continue
            totals.append(t2 - t0)
            tokens.append(prep.prompt_tokens)
            stages.setdefault("prepare (validate+media+render)", []).append(t1 - t0)
            for k, v in route.stages.items():
                stages.setdefault(k, []).append(v)
            if scenario != "cold" and route.overlaps.get("w0", 0) == 0:
                raise RuntimeError("benchmark sanity: the warm prefix was not found in the index")
        results[scenario] = {
            "prompt_tokens_mean": round(statistics.mean(tokens)),
            "total_ms": {q: round(_pct(totals, p) * 1e3, 3) for q, p in (("p50", .5), ("p90", .9), ("p99", .99))},
            "stages_ms_p50": {k: round(_pct(v, .5) * 1e3, 3) for k, v in stages.items()},
        }
    results["machine"] = {"python": platform.python_version(), "platform": platform.platform(),
                          "processor": platform.processor() or platform.machine()}
    results["segment_cache"] = ctx.renderer.tokenizer.cache_enabled
    await ctx.fetcher.close()
    await ctx.upstream.close()
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the embedded demo model)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--scenarios", nargs="+", default=["warm", "cold", "image", "image-noise"], choices=["warm", "cold", "image", "image-noise"])
    p.add_argument("--json", action="store_true", help="print JSON only")


def run_bench(args: argparse.Namespace) -> int:
    res = asyncio.run(_run(args))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"mmroute routing overhead ({args.iterations} requests per scenario, {args.workers} workers)")
    for name in args.scenarios:
        r = res[name]
        t = r["total_ms"]
        print(f"  {name:11s} ~{r['prompt_tokens_mean']} tokens: p50 {t['p50']:.3f} ms  p90 {t['p90']:.3f} ms  "
              f"p99 {t['p99']:.3f} ms")
        for k, v in r["stages_ms_p50"].items():
            print(f"        {k:34s} p50 {v:.3f} ms")
    print(f"  segment cache enabled: {res['segment_cache']}; {res['machine']}")
    return 0


def main() -> None:  # python -m mmroute.bench.overhead
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    raise SystemExit(run_bench(p.parse_args()))


if __name__ == "__main__":
    main()
