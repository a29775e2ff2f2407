"""Prefix-index micro-benchmark: ``python -m mmroute.bench.index_bench``.

Fills a ``PrefixIndex`` with ~100k blocks over 16 workers through real
``BlockStored`` events (128-block chains sharing a few system prompts, like chat
traffic), then times event application, request keying and lookup for a 2k-token
request, and eviction. Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc

from mmroute.kv.events import BlockRemoved, BlockStored, EventBatch
from mmroute.routing.index import PrefixIndex
from mmroute.routing.keys import chain_keys


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=100_000, help="total indexed blocks")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--request-tokens", type=int, default=2048)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    bs = args.block_size
    nblk = args.request_tokens // bs
    workers = [f"w{i}" for i in range(args.workers)]
    prefixes = [[rng.randrange(150_000) for _ in range(bs * 32)] for _ in range(8)]

    def request_tokens() -> list[int]:
        # 32 shared system-prompt blocks, then unique user content.
        return rng.choice(prefixes) + [rng.randrange(150_000) for _ in range(args.request_tokens - bs * 32)]

    # Build the events first so only apply() is timed.
    batches: list[tuple[str, EventBatch, list[int]]] = []
    total = 0
    hseq = 0
    while total < args.blocks:
        toks = request_tokens()
        hashes = list(range(hseq, hseq + nblk))
        hseq += nblk
        ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks, block_size=bs, medium="GPU")
        batches.append((rng.choice(workers), EventBatch(ts=0.0, events=[ev], dp_rank=0), hashes))
        total += nblk

    idx = PrefixIndex(block_size=bs)
    t0 = time.perf_counter()
    for w, b, _ in batches:
        idx.apply(w, 0, b)
    dt = time.perf_counter() - t0
    print(f"apply: {len(batches)} BlockStored events, {total} blocks in {dt * 1e3:.1f} ms "
          f"-> {len(batches) / dt:,.0f} events/s, {total / dt:,.0f} blocks/s "
          f"(keying included: {dt / total * 1e6:.2f} us/block)")
    print(f"index: {idx.total_keys:,} distinct keys, {sum(idx.block_count(w) for w in workers):,} worker-blocks")

    # Memory: rebuild under tracemalloc (events already exist, so only the index counts).
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem_idx = PrefixIndex(block_size=bs)
    for w, b, _ in batches:
        mem_idx.apply(w, 0, b)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"memory: {used / 2**20:.1f} MiB -> {used / total:.0f} bytes per indexed block")
    del mem_idx

    # Lookups: half are repeats of stored requests (long overlap), half new (prefix only).
    reqs = [rng.choice(batches)[1].events[0].token_ids if i % 2 else request_tokens() for i in range(args.lookups)]
    key_t, look_t, runs = [], [], []
    for toks in reqs:
        t1 = time.perf_counter()
        keys = chain_keys(toks, bs)
        t2 = time.perf_counter()
        ov = idx.overlaps(keys, workers)
        t3 = time.perf_counter()
        key_t.append(t2 - t1)
        look_t.append(t3 - t2)
        runs.append(max(ov.values()))
    print(f"request keys ({args.request_tokens} tokens, {nblk} blocks): "
          f"p50 {statistics.median(key_t) * 1e6:.1f} us, p99 {_pct(key_t, 0.99) * 1e6:.1f} us")
    print(f"overlaps over {len(workers)} workers: p50 {statistics.median(look_t) * 1e6:.1f} us, "
          f"p99 {_pct(look_t, 0.99) * 1e6:.1f} us (mean best run {statistics.mean(runs):.1f} blocks)")

    # Speculative inserts + lookups (the routed burst path).
    now = 0.0
    t0 = time.perf_counter()
    for i, toks in enumerate(reqs[:500]):
        keys = chain_keys(toks, bs)
        idx.insert_speculative(workers[i % len(workers)], keys, ttl_s=2.0, now=now)
        idx.overlaps(keys, workers, now=now)
        now += 0.01
    dt = time.perf_counter() - t0
    print(f"speculative insert+lookup: {dt / 500 * 1e6:.1f} us per request")

    # Eviction: remove everything, one hash per event (vLLM style).
    t0 = time.perf_counter()
    n = 0
    for w, _, hashes in batches:
        idx.apply(w, 0, EventBatch(ts=0.0, events=[BlockRemoved([h], medium="GPU") for h in hashes], dp_rank=0))
        n += len(hashes)
    dt = time.perf_counter() - t0
    print(f"remove: {n} BlockRemoved events in {dt * 1e3:.1f} ms -> {n / dt:,.0f} events/s; "
          f"left {idx.total_keys} keys")


if __name__ == "__main__":
    main()
