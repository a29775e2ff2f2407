"""SGLang's HTTP surface on the simulated engine (ENGINES.md §3.4-3.5).

``/generate`` takes rendered ``text`` (one placeholder per image) or ``input_ids`` plus
``image_data`` and ``mm_hashes``; the sim expands placeholders like the model's
processor and writes the release's pad values into the image spans. Streaming sends
the *cumulative* text and ids (SGLang's default), ``meta_info.cached_tokens`` always.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Hashable, Mapping
from urllib.parse import urlsplit

from aiohttp import web

from mmroute.errors import RouterError
from mmroute.models.base import ImageInput
from mmroute.sim import openai
from mmroute.sim.api_common import EngineApi, read_json
from mmroute.sim.processor import Prompt
from mmroute.sim.sglang_engine import SglangSeq

if TYPE_CHECKING:
    from mmroute.sim.server import SimWorker

_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def add_routes(app: web.Application, worker: "SimWorker") -> None:
    api = _SglangApi(worker)
    app.router.add_post("/generate", api.generate)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_get("/v1/models", api.models)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, api.server_info)
    app.router.add_get("/model_info", api.model_info)
    app.router.add_get("/get_model_info", api.model_info)
    app.router.add_get("/health_generate", worker.health)
    app.router.add_route("GET", "/flush_cache", api.flush_cache)
    app.router.add_route("POST", "/flush_cache", api.flush_cache)


def _extra_key(body: Mapping[str, Any]) -> Hashable:
    """The radix-tree namespace (cache salt, extra_key, LoRA): never hashed into events."""
    parts = tuple(body.get(k) for k in ("extra_key", "cache_salt", "lora_path"))
    return parts if any(p is not None for p in parts) else None


class _SglangApi(EngineApi):
    @property
    def version(self) -> str:
        return self.w.config.sglang_version

    def _tokenize_text(self, text: str) -> list[int]:
        # SGLang tokenizes /generate text with special tokens, except when the tokenizer
        # adds some and the text already starts with the BOS string (main,
        # multimodal/processors/base_processor.py::process_mm_data, _tokenize_texts).
        tok = self.proc.renderer.tokenizer
        bos = tok.special_tokens.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        has_specials = len(tok.encode("", True)) > 0
        return tok.encode(text, not (has_specials and isinstance(bos, str) and text.startswith(bos)))

    @property
    def _ignores_mm_hashes(self) -> bool:
        # mm_hashes exist from SGLang 0.5.18 (PR #25300); older builds drop the field.
        v = tuple(int(x) for x in re.findall(r"\d+", self.version)[:3])
        return self.w.config.ignore_mm_hashes or v < (0, 5, 18)

    # --- /generate --------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        body = await read_json(request)
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RouterError(400, "Either text or input_ids should be provided.")
        if text is not None and not isinstance(text, str):
            raise RouterError(400, "the simulator serves one prompt per request: 'text' must be a string")
        if input_ids is not None and (
            not isinstance(input_ids, list) or not input_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids)
        ):
            raise RouterError(400, "'input_ids' must be a non-empty list of token ids")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, Mapping):
            raise RouterError(400, "'sampling_params' must be an object")
        max_new = sp.get("max_new_tokens")
        explicit = max_new is not None
        if max_new is None:
            max_new = self.w.config.default_max_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise RouterError(400, "'max_new_tokens' must be a positive integer")

        refs = await self.proc.sglang_images(body.get("image_data"))
        hashes = self.proc.sglang_hashes(refs, None if self._ignores_mm_hashes else body.get("mm_hashes"))
        ids = self._tokenize_text(text) if text is not None else list(input_ids)
        images = [ImageInput(f"{h:016x}", r.width, r.height) for h, r in zip(hashes, refs)]
        expanded, items = self.proc.expand(ids, text, images)
        view = self.proc.sglang_view(expanded, items, hashes, self.version)
        n = self._check(view, max_new, explicit)
        rid = str(body.get("rid") or openai.new_id(""))
        seq = SglangSeq(rid, view, extra_key=_extra_key(body))
        cached = await self._admit(seq, n)
        runner = self.w.runner

        def meta(k: int, done: bool) -> dict[str, Any]:
            m: dict[str, Any] = {
                "id": rid,
                "finish_reason": {"type": "length", "length": k} if done else None,
                "prompt_tokens": len(view),
                "completion_tokens": k,
                "cached_tokens": cached,
                "reasoning_tokens": 0,
                "weight_version": "default",
                "num_retractions": 0,
            }
            if done:
                m["e2e_latency"] = time.monotonic() - t0
            return m

        try:
            out_ids: list[int] = []
            texts: list[str] = []
            if not body.get("stream"):
                async for tok, piece in runner.generate(seq, len(view), cached, n):
                    out_ids.append(tok)
                    texts.append(piece)
                return web.json_response({"text": "".join(texts), "output_ids": out_ids, "meta_info": meta(n, True)})
            resp = await openai.open_sse(request)
            async for tok, piece in runner.generate(seq, len(view), cached, n):
                out_ids.append(tok)
                texts.append(piece)
                done = len(out_ids) == n
                await resp.write(openai.sse({"text": "".join(texts), "output_ids": list(out_ids),
                                             "meta_info": meta(len(out_ids), done)}))
            await resp.write(openai.SSE_DONE)
            await resp.write_eof()
            return resp
        finally:
            runner.release(seq)

    # --- OpenAI ---------------------------------------------------------------------------------

    async def _chat_prompt(self, body: Mapping[str, Any]) -> Prompt:
        """Chat carries no mm_hashes: images get content-hash pad values."""
        parts = self.proc.renderer.image_parts(body.get("messages"))
        images, hashes = [], []
        for part in parts:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, Mapping) else url
            if not isinstance(url, str):
                raise RouterError(400, "image_url.url is required", param="messages")
            ref = await self.proc.resolve(url)
            h = self.proc.sglang_content_hash(ref.data)
            hashes.append(h)
            images.append(ImageInput(f"{h:016x}", ref.width, ref.height))
        rendered = self.proc.exact(self.proc.renderer.render_chat(body, images))
        view = self.proc.sglang_view(rendered.token_ids, rendered.mm_items, hashes, self.version)
        return Prompt(view, rendered.mm_items, rendered.num_images)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await read_json(request)
        stream_options = openai.check_stream_options(body)
        prompt = await self._chat_prompt(body) if chat else self.proc.completion(body)
        n = self._openai_max_tokens(body, prompt.token_ids, chat)
        seq = SglangSeq(openai.new_id(""), prompt.token_ids, extra_key=_extra_key(body))
        return await self._openai_answer(
            request, body, seq, prompt.token_ids, n, chat=chat, stream_options=stream_options, always_details=False
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    # --- discovery / admin ---------------------------------------------------------------------

    def _kv_events(self) -> dict[str, Any] | None:
        ep = self.w.kv_endpoint
        if not ep.startswith("tcp://"):
            return None
        u = urlsplit(ep)
        try:
            port = u.port
        except ValueError:
            port = None
        if port is None or self.w.config.block_size <= 0:
            return None
        host = u.hostname or "*"
        return {
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": port,
            "topic": self.w.config.topic,
            "block_size": self.w.config.block_size,
            "dp_size": 1,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.w.config
        return web.json_response(
            {
                "model_path": cfg.model,
                "tokenizer_path": cfg.model,
                "served_model_name": cfg.model_name,
                "host": cfg.host,
                "port": self.w.port,
                "page_size": cfg.block_size,
                "dp_size": 1,
                "tp_size": 1,
                "context_length": self.proc.max_model_len,
                "max_total_num_tokens": cfg.num_blocks * cfg.block_size,
                "max_running_requests": cfg.max_concurrency,
                "enable_cache_report": True,
                "enable_metrics": True,
                "disable_radix_cache": False,
                "kv_events_config": None,
                "version": cfg.sglang_version,
                "kv_events": self._kv_events(),
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.w.config
        mc = self.proc.files.config or {}
        return web.json_response(
            {
                "model_path": cfg.model,
                "tokenizer_path": cfg.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": self.proc.family is not None,
                "has_audio_understanding": False,
                "model_type": mc.get("model_type"),
                "architectures": mc.get("architectures"),
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.w.config
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "sglang",
                        "root": cfg.model_name,
                        "max_model_len": self.proc.max_model_len,
                    }
                ],
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.w.runner.waiting == 0 and self.w.engine.flush_cache()
        return web.Response(text=_FLUSH_TEXT, status=200 if ok else 400)
