"""The simulated worker over real HTTP (127.0.0.1, ephemeral ports) and real ZMQ sockets.

Events are read back through the replay ROUTER (deterministic: no slow-joiner race)
and decoded with a plain msgpack decoder, never with the router's own decoder.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq
from PIL import Image

from mmroute.media.identity import image_identifier
from mmroute.sim.config import SimConfig, LoraModule
from mmroute.sim.processor import Processor
from mmroute.sim.publisher import END_SEQ
from mmroute.sim.server import SimWorker
from mmroute.sim.sglang_hash import fill_span, pad_values
from proxy_helpers import serve
from sim_helpers import replay_frames

REPO = Path(__file__).resolve().parent.parent
MODEL = str(REPO / "mmroute" / "demo_model")  # Qwen2.5-VL files
IMAGE_TOKEN = 151655

_PROCESSOR: Processor | None = None


def processor() -> Processor:
    global _PROCESSOR
    if _PROCESSOR is None:
        _PROCESSOR = Processor(MODEL)
    return _PROCESSOR


def png(w: int, h: int, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_chat(url: str, uuid: str | None = None, **extra) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is in this image?"}]}], **extra}


TEXT_CHAT = {"messages": [{"role": "system", "content": "You are a careful assistant. " * 4},
                          {"role": "user", "content": "Name three colours."}], "max_tokens": 4}


async def replay_events(worker: SimWorker, start: int = 0) -> list[tuple[int, list]]:
    """All buffered batches from ``start`` via the replay ROUTER: [(seq, events)]."""
    assert await asyncio.to_thread(worker.publisher.drain)

    msgs = await asyncio.to_thread(replay_frames, zmq.Context.instance(), worker.replay_endpoint, start)
    out = []
    for m in msgs[:-1]:
        seq_b, payload = m[-2], m[-1]
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank == 0
        out.append((int.from_bytes(seq_b, "big"), events))
    return out


def stores(batches) -> list:
    return [e for _, evs in batches for e in evs if (e["type"] if isinstance(e, dict) else e[0]) == "BlockStored"]


@pytest.fixture
async def vllm_worker():
    cfg = SimConfig(model=MODEL, served_model_name="demo", num_blocks=256, topic="kv-events",
                    lora_modules=(LoraModule("sql", "/adapters/sql", 1),))
    async with SimWorker(cfg, processor=processor()) as w:
        async with aiohttp.ClientSession(base_url=w.url) as http:
            yield w, http


async def test_vllm_chat_cached_tokens_and_events(vllm_worker):
    w, http = vllm_worker
    async with http.post("/v1/chat/completions", json={**TEXT_CHAT, "model": "demo"}) as r:
        assert r.status == 200
        first = await r.json()
    P = first["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == 4
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert first["choices"][0]["finish_reason"] == "length" and first["choices"][0]["message"]["content"]
    async with http.post("/v1/chat/completions", json={**TEXT_CHAT, "return_token_ids": True}) as r:
        second = await r.json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (P - 1) // 16 * 16
    prompt_ids = second["prompt_token_ids"]
    assert len(prompt_ids) == P
    batches = await replay_events(w)
    assert [s for s, _ in batches] == list(range(len(batches)))
    st = stores(batches)
    assert st[0]["parent_block_hash"] is None and st[0]["token_ids"] == prompt_ids[: P // 16 * 16]
    assert list(st[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                           "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in st[0]["block_hashes"])


async def test_vllm_image_uuid_is_the_block_key(vllm_worker):
    w, http = vllm_worker
    img = png(640, 480)
    async with http.post("/v1/chat/completions", json=image_chat(data_url(img), "img-A", max_tokens=2)) as r:
        assert r.status == 200
        body = await r.json()
    assert body["usage"]["prompt_tokens"] == 418  # ENGINES.md §2.2 worked example
    # the uuid alone (no media) now works: the worker has seen it
    part = {"type": "image_url", "image_url": None, "uuid": "img-A"}
    req = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is in this image?"}]}],
           "max_tokens": 2}
    async with http.post("/v1/chat/completions", json=req) as r:
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 416
    # without a uuid the engine's own content id is used, and it is not mmroute's
    async with http.post("/v1/chat/completions", json=image_chat(data_url(img), max_tokens=2)) as r:
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    st = stores(await replay_events(w))
    assert st[0]["extra_keys"][:3] == [[["img-A", 15]], [["img-A", -1]], [["img-A", -17]]]
    assert len(st[0]["block_hashes"]) == 26
    other = st[-1]["extra_keys"][0][0][0]
    assert other != "img-A" and other != image_identifier(img) and len(other) == 64


async def test_vllm_fetches_http_images_like_an_engine(vllm_worker):
    """The engine fetches the URL itself, loopback included (no router-side SSRF guard)."""
    from aiohttp import web

    w, http = vllm_worker
    img = png(320, 240, (10, 200, 10))
    async def serve_png(request: web.Request) -> web.Response:
        return web.Response(body=img, content_type="image/png")

    app = web.Application()
    app.router.add_get("/cat.png", serve_png)
    async with serve(app, handler_cancellation=False) as base:
        req = image_chat(f"{base}/cat.png", "cat-1", max_tokens=1)
        async with http.post("/tokenize", json=req) as r:
            by_url = await r.json()
        async with http.post("/tokenize", json=image_chat(data_url(img), "cat-1")) as r:
            by_data = await r.json()
        assert r.status == 200 and by_url["tokens"] == by_data["tokens"]
        assert by_url["tokens"].count(IMAGE_TOKEN) == processor().family.num_image_tokens(320, 240)


async def test_vllm_lora_salt_tokenize_and_errors(vllm_worker):
    w, http = vllm_worker
    async with http.post("/v1/chat/completions", json={**TEXT_CHAT, "model": "sql", "cache_salt": "t1"}) as r:
        assert r.status == 200
    st = stores(await replay_events(w))
    assert st[0]["lora_name"] == "sql" and st[0]["lora_id"] == 1
    assert st[0]["extra_keys"][0] == ["sql", "t1"] and st[0]["extra_keys"][1] == ["sql"]
    async with http.post("/v1/chat/completions", json={**TEXT_CHAT, "model": "nope"}) as r:
        assert r.status == 404
        err = await r.json()
        assert "does not exist" in err["error"]["message"] and err["error"]["code"] == 404
    async with http.post("/v1/chat/completions", json={**TEXT_CHAT, "stream_options": {"include_usage": True}}) as r:
        assert r.status == 400
        assert "Stream options can only be defined when `stream=True`" in (await r.json())["error"]["message"]
    async with http.post("/v1/chat/completions", data=b"{not json") as r:
        assert r.status == 400
    async with http.post("/v1/chat/completions", json={**TEXT_CHAT, "max_tokens": 10**6}) as r:
        assert r.status == 400 and "maximum context length" in (await r.json())["error"]["message"]
    async with http.post("/tokenize", json=image_chat(data_url(png(640, 480)), "x")) as r:
        tok = await r.json()
    assert tok["count"] == 418 and tok["tokens"].count(IMAGE_TOKEN) == 391 and tok["max_model_len"] == 128000
    async with http.post("/tokenize", json={"prompt": "Hello world"}) as r:
        assert (await r.json())["tokens"] == [9707, 1879]
    async with http.get("/version") as r:
        assert await r.json() == {"version": "0.33.0"}
    async with http.get("/v1/models") as r:
        ids = [m["id"] for m in (await r.json())["data"]]
        assert ids == ["demo", "sql"]


async def test_vllm_streaming_usage_and_reset(vllm_worker):
    w, http = vllm_worker
    req = {**TEXT_CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with http.post("/v1/chat/completions", json=req) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    chunks = [c[len("data: "):] for c in raw.split("\n\n") if c]
    assert chunks[-1] == "[DONE]"
    objs = [json.loads(c) for c in chunks[:-1]]
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 4
    assert "prompt_tokens_details" in objs[-1]["usage"]
    assert objs[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" in o for o in objs)  # continuous usage stats
    async with http.post("/v1/completions", json={"prompt": "Once upon a time " * 5, "max_tokens": 3, "stream": True}) as r:
        text = (await r.read()).decode()
    assert text.endswith("data: [DONE]\n\n") and '"object":"text_completion"' in text
    async with http.post("/reset_prefix_cache") as r:
        assert r.status == 200
    batches = await replay_events(w)
    assert batches[-1][1] == [{"type": "AllBlocksCleared"}]
    async with http.get("/metrics") as r:
        metrics = await r.text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"):
        assert f"\n{name}{{" in metrics


async def test_vllm_array_wire_format_replays_without_topic():
    cfg = SimConfig(model=MODEL, wire_format="array", topic="t", num_blocks=64)
    async with SimWorker(cfg, processor=processor()) as w:
        async with aiohttp.ClientSession(base_url=w.url) as http:
            async with http.post("/v1/completions", json={"prompt": list(range(100, 140)), "max_tokens": 2}) as r:
                assert r.status == 200
            async with http.get("/version") as r:
                assert (await r.json())["version"] == "0.23.0"
        assert await asyncio.to_thread(w.publisher.drain)

        msgs = await asyncio.to_thread(replay_frames, zmq.Context.instance(), w.replay_endpoint, 0)
        assert [len(m) for m in msgs] == [3, 3]  # [b"", seq, payload], then [b"", END, b""]
        assert msgs[-1] == [b"", END_SEQ, b""]
        ev = msgspec.msgpack.decode(msgs[0][2])[1][0]
        assert ev[0] == "BlockStored" and len(ev) == 12 and ev[3] == list(range(100, 132))


@pytest.fixture
async def sglang_worker():
    cfg = SimConfig(model=MODEL, backend="sglang", sglang_version="0.5.23", num_blocks=128)
    async with SimWorker(cfg, processor=processor()) as w:
        async with aiohttp.ClientSession(base_url=w.url) as http:
            yield w, http


async def test_sglang_server_info_and_generate_with_mm_hashes(sglang_worker):
    w, http = sglang_worker
    async with http.get("/server_info") as r:
        info = await r.json()
    assert info["page_size"] == 16 and info["dp_size"] == 1 and info["version"] == "0.5.23"
    kv = info["kv_events"]
    assert kv["publisher"] == "zmq" and kv["endpoint_host"] == "127.0.0.1" and kv["block_size"] == 16
    assert w.kv_endpoint.endswith(f":{kv['endpoint_port_base']}")
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this image?<|im_end|>\n<|im_start|>assistant\n"
    img = data_url(png(224, 168))
    req = {"text": prompt, "image_data": [img], "mm_hashes": ["deadbeefcafe1234"], "sampling_params": {"max_new_tokens": 3}}
    async with http.post("/generate", json=req) as r:
        assert r.status == 200
        out = await r.json()
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["cached_tokens"] == 0
    L = meta["prompt_tokens"]
    async with http.post("/generate", json=req) as r:
        assert (await r.json())["meta_info"]["cached_tokens"] == (L - 1) // 16 * 16
    # a count mismatch ignores the list: content-hash pads, so only the text before the image matches
    async with http.post("/generate", json={**req, "mm_hashes": ["aa", "bb"]}) as r:
        assert (await r.json())["meta_info"]["cached_tokens"] == 0
    batches = await replay_events(w)
    assert batches[0] == (0, [{"type": "AllBlocksCleared"}])  # start-up reset
    first = stores(batches)[0]
    assert list(first) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
    toks = first["token_ids"]
    start = toks.index(151652) + 1  # after <|vision_start|>
    pads = pad_values(0xDEADBEEFCAFE1234, "0.5.23")
    assert toks[start : start + 8] == fill_span(pads, 8)
    assert all(isinstance(h, int) and -(2**63) <= h < 2**63 for h in first["block_hashes"])


async def test_sglang_streaming_is_cumulative_and_flush(sglang_worker):
    w, http = sglang_worker
    req = {"input_ids": list(range(1000, 1040)), "sampling_params": {"max_new_tokens": 3}, "stream": True}
    async with http.post("/generate", json=req) as r:
        raw = (await r.read()).decode()
    chunks = [c[len("data: "):] for c in raw.split("\n\n") if c]
    assert chunks[-1] == "[DONE]"
    objs = [json.loads(c) for c in chunks[:-1]]
    assert [len(o["output_ids"]) for o in objs] == [1, 2, 3]
    assert objs[1]["text"].startswith(objs[0]["text"]) and objs[0]["meta_info"]["finish_reason"] is None
    assert objs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    chat = {"messages": [{"role": "user", "content": "Hello there, how are you today? " * 3}], "max_tokens": 2}
    async with http.post("/v1/chat/completions", json=chat) as r:
        assert (await r.json())["usage"]["prompt_tokens_details"] is None  # cache report only when > 0
    async with http.post("/v1/chat/completions", json=chat) as r:
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    async with http.post("/flush_cache") as r:
        assert r.status == 200
    assert (await replay_events(w))[-1][1] == [{"type": "AllBlocksCleared"}]
    async with http.get("/metrics") as r:
        metrics = await r.text()
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"):
        assert f"\n{name}{{" in metrics


async def test_sglang_legacy_pads_for_0_5_22():
    cfg = SimConfig(model=MODEL, backend="sglang", sglang_version="0.5.22")
    async with SimWorker(cfg, processor=processor()) as w:
        async with aiohttp.ClientSession(base_url=w.url) as http:
            prompt = "<|vision_start|><|image_pad|><|vision_end|>" + "describe this image please " * 4
            req = {"text": prompt, "image_data": data_url(png(224, 168)), "mm_hashes": ["deadbeefcafe1234"],
                   "sampling_params": {"max_new_tokens": 1}}
            async with http.post("/generate", json=req) as r:
                assert r.status == 200
        toks = stores(await replay_events(w))[0]["token_ids"]
        assert toks[1:49] == [185422964] * 48  # 224x168 -> 48 image tokens, legacy single value


async def test_waiting_requests_queue_behind_capacity():
    """A request that does not fit next to a running one waits (vllm:num_requests_waiting)."""
    # 8 usable blocks; each request needs ceil((40 + 20 - 1) / 16) = 4 over its lifetime
    cfg = SimConfig(model=MODEL, num_blocks=9, max_concurrency=8, decode_ms_per_token=1.0)
    async with SimWorker(cfg, processor=processor()) as w:
        async with aiohttp.ClientSession(base_url=w.url) as http:
            req = {"prompt": list(range(100, 140)), "max_tokens": 20}
            rs = await asyncio.gather(*[http.post("/v1/completions", json={**req, "prompt": list(range(k, k + 40))})
                                        for k in (100, 300, 500)])
            bodies = [await r.json() for r in rs]
            assert all(r.status == 200 for r in rs)
            assert all(b["usage"]["completion_tokens"] == 20 for b in bodies)
            async with http.post("/v1/completions", json={"prompt": list(range(200)), "max_tokens": 1}) as r:
                assert r.status == 400 and "KV cache" in (await r.json())["error"]["message"]
        assert w.runner.waiting == 0 and w.runner.running == 0


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise AssertionError("no SIM_READY line within the timeout")
        return proc.stdout.readline()
    finally:
        sel.close()


def test_cli_prints_ready_line_and_serves():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmroute.sim", "--backend", "sglang", "--port", "0", "--block-size", "32"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )
    try:
        line = _readline(proc, timeout=60)  # the worker prints it once serving
        assert line.startswith("SIM_READY "), (line, proc.stderr.read() if proc.poll() is not None else "")
        info = json.loads(line[len("SIM_READY "):])
        assert info["backend"] == "sglang" and info["block_size"] == 32 and info["kv_endpoint"].startswith("tcp://")

        async def probe() -> tuple[int, dict]:
            async with aiohttp.ClientSession() as http:
                async with http.get(info["url"] + "/health") as r:
                    status = r.status
                async with http.get(info["url"] + "/server_info") as r:
                    return status, await r.json()

        status, server_info = asyncio.run(probe())
        assert status == 200 and server_info["page_size"] == 32
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def test_cli_rejects_bad_flags():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "mmroute.sim", "--backend", "sglang", "--bytes-hashes"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert r.returncode == 2 and "--bytes-hashes" in r.stderr
