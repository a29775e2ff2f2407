"""End to end across vision families: for each fixture VLM, a two-worker simulated
vLLM fleet serves an image conversation twice; the repeat lands on the holder and the
worker-reported cached tokens equal the router's prediction. This runs each family's
expansion and the per-block extra keys (uuid + offset) through the engine's own keying
in the simulator, including Phi-3-V's BOS after each image and Gemma-3's overlapping
spans of adjacent images."""

from __future__ import annotations

import pytest

from tests.e2e_helpers import data_url, metric_value, png_bytes, start_fleet, start_sims
from tests.fixture_models import GEMMA3, LLAVA15, LLAVA_NEXT, PHI3V, QWEN2_VL, QWEN3_VL, model_dir

pytestmark = pytest.mark.asyncio

BS = 16


def _parts(*sizes: tuple[int, int]) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_url(png_bytes(w, h, (w % 251, h % 241, 7)))}}
            for w, h in sizes]


# Qwen2-VL-2B is a base model whose template takes a bare list of parts, not chat
# messages: vLLM renders no placeholder for a chat request, and the router falls back
# (tested below). Qwen2.5-VL runs end to end in test_e2e_multimodal.py.
CASES = {
    # model: (expected family name part, image sizes)
    QWEN3_VL: ("qwen3_vl", [(500, 500), (100, 2000)]),
    LLAVA15: ("llava", [(336, 336)]),
    LLAVA_NEXT: ("llava_next", [(640, 480)]),
    PHI3V: ("phi3", [(640, 480), (320, 200)]),
    GEMMA3: ("gemma3", [(640, 480), (480, 640)]),  # adjacent images share a merged newline
}


@pytest.mark.parametrize("model", list(CASES))
async def test_family_image_repeat_hits(model):
    family, sizes = CASES[model]
    path = model_dir(model)
    messages = [{"role": "user", "content": [*_parts(*sizes), {"type": "text", "text": "Compare these pictures."}]}]
    sims = start_sims(2, path, ["--num-blocks", "4096"])
    fleet = await start_fleet(sims, path, own_sims=True)
    try:
        assert fleet.ctx.renderer.mm_enabled and family in fleet.ctx.renderer.family.name.lower()
        ex = await fleet.explain({"model": "m", "messages": messages})
        assert ex["fallback"] is None, ex["fallback"]
        assert len(ex["mm_items"]) == len(sizes)
        p = ex["prompt_tokens"]
        worker, data = await fleet.chat(messages)
        assert data["usage"]["prompt_tokens"] == p  # the worker expanded exactly as the router did
        await fleet.sync()
        ex = await fleet.explain({"model": "m", "messages": messages})
        assert {c["worker"]: c["overlap_blocks"] for c in ex["candidates"]}[worker] == p // BS
        worker2, data2 = await fleet.chat(messages)
        assert worker2 == worker
        assert data2["usage"]["prompt_tokens_details"]["cached_tokens"] == ((p - 1) // BS) * BS
        assert metric_value(await fleet.metrics_text(), "mmroute_prediction_mismatch_total") == 0
    finally:
        await fleet.close()


async def test_base_model_template_without_placeholders_falls_back():
    path = model_dir(QWEN2_VL)
    sims = start_sims(1, path)
    fleet = await start_fleet(sims, path, own_sims=True)
    try:
        ex = await fleet.explain({"model": "m", "messages": [
            {"role": "user", "content": [*_parts((64, 64)), {"type": "text", "text": "Describe."}]}]})
        assert ex["fallback"] == "placeholder_count" and ex["mm_items"] == []
        text = await fleet.metrics_text()
        assert metric_value(text, "mmroute_mm_fallback_total", {"reason": "placeholder_count"}) == 1
    finally:
        await fleet.close()


@pytest.mark.parametrize("model,exact", [(LLAVA15, True), (GEMMA3, False)])
async def test_family_images_on_sglang(model, exact):
    """SGLang re-tokenizes the /generate text with special tokens (LLaVA gains a BOS the
    vLLM view lacks) and pads Gemma-3's soft tokens only: the router's SGLang view follows
    the first exactly and keys the second on its text prefix."""
    path = model_dir(model)
    messages = [{"role": "user", "content": [*_parts((640, 480)), {"type": "text", "text": "What is it?"}]}]
    sims = start_sims(1, path, ["--backend", "sglang", "--num-blocks", "4096"])
    fleet = await start_fleet(sims, path, own_sims=True)
    try:
        for rep in range(2):
            ex = await fleet.explain({"model": "m", "messages": messages})
            cand = ex["candidates"][0]
            _, data = await fleet.chat(messages)
            assert data["usage"]["prompt_tokens"] == ex["prompt_tokens"] + (1 if model == LLAVA15 else 0)
            cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if rep == 1:
                assert cand["view"] == ("sglang:wide" if exact else "sglang:text")
                if exact:
                    p = data["usage"]["prompt_tokens"]
                    assert cached == cand["predicted_cached_tokens"] == ((p - 1) // BS) * BS
                else:
                    first = ex["mm_items"][0]["offset"]
                    assert cand["overlap_blocks"] == first // BS
            await fleet.sync()
        assert metric_value(await fleet.metrics_text(), "mmroute_prediction_mismatch_total",
                            {"direction": "over"}) == 0
    finally:
        await fleet.close()


async def test_uuid_lands_on_the_right_part_whatever_its_type():
    """input_image parts and untyped parts count as images for vLLM too: each must carry
    its own identifier, in order."""
    from mmroute.api.context import AppContext
    from mmroute.api.pipeline import forward_chat_body, prepare
    from mmroute.config import RouterConfig, WorkerSpec
    from mmroute.media.identity import image_identifier
    from mmroute.workers.registry import Worker

    a, b, c = png_bytes(64, 64, (1, 1, 1)), png_bytes(64, 64, (2, 2, 2)), png_bytes(64, 64, (3, 3, 3))
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(a)},
        {"image_url": {"url": data_url(b)}},
        {"type": "image_url", "image_url": {"url": data_url(c)}},
        {"type": "text", "text": "Three pictures."}]}]}
    ctx = AppContext(RouterConfig(model=model_dir(QWEN3_VL), served_model_name=["m"],
                                  workers=[WorkerSpec.parse("http://127.0.0.1:1,name=w")]))
    prep = await prepare(ctx, "chat", body)
    assert [it.identifier for it in prep.prompt.mm_items] == [image_identifier(x) for x in (a, b, c)]
    out = forward_chat_body(ctx, prep, Worker(WorkerSpec.parse("http://127.0.0.1:1,name=w,backend=vllm")))
    parts = out["messages"][0]["content"]
    assert [p.get("uuid") for p in parts] == [image_identifier(a), image_identifier(b), image_identifier(c), None]
    assert "uuid" not in body["messages"][0]["content"][0]  # the client's body is not mutated
    await ctx.fetcher.close()
    await ctx.upstream.close()
