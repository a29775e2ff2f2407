"""vLLM 0.33's HTTP surface on the simulated engine (ENGINES.md §2.4-2.6)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from aiohttp import web

from mmroute.errors import RouterError
from mmroute.sim import openai
from mmroute.sim.api_common import EngineApi, read_json
from mmroute.sim.vllm_engine import VllmSeq
from mmroute.sim.vllm_hash import LoraRef, MMSpan

if TYPE_CHECKING:
    from mmroute.sim.server import SimWorker


def add_routes(app: web.Application, worker: "SimWorker") -> None:
    api = _VllmApi(worker)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/version", api.version)
    app.router.add_post("/reset_prefix_cache", api.reset_prefix_cache)
    app.router.add_get("/kv_event_sources", api.kv_event_sources)


class _VllmApi(EngineApi):
    def _lora(self, body: Mapping[str, Any]) -> LoraRef | None:
        """The adapter named by ``model`` (vLLM serves LoRAs under their own name)."""
        model = body.get("model")
        if model is None or model == self.w.config.model_name:
            return None
        mod = self.w.loras.get(model) if isinstance(model, str) else None
        if mod is None:
            raise RouterError(404, f"The model `{model}` does not exist.", param="model", err_type="NotFoundError")
        return LoraRef(mod.name, mod.int_id, mod.path)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await read_json(request)
        lora = self._lora(body)
        stream_options = openai.check_stream_options(body)
        if body.get("n") not in (None, 1):
            raise RouterError(400, "the simulator serves n=1 only", param="n")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise RouterError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
        prompt = await self.proc.vllm_chat(body) if chat else self.proc.completion(body)
        n = self._openai_max_tokens(body, prompt.token_ids, chat)
        seq = VllmSeq(
            openai.new_id("sim-"),
            prompt.token_ids,
            mm=[MMSpan(m.identifier, m.offset, m.length) for m in prompt.mm_items],
            lora=lora,
            cache_salt=salt,
        )
        extra = {"prompt_token_ids": list(prompt.token_ids)} if body.get("return_token_ids") else None
        return await self._openai_answer(
            request, body, seq, prompt.token_ids, n,
            chat=chat, stream_options=stream_options, always_details=True, extra_response=extra,
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if body.get("model") is not None:
            self._lora(body)
        if "messages" in body:
            prompt = await self.proc.vllm_chat(body)
        else:
            prompt = self.proc.completion(body)
        ids = prompt.token_ids
        strs = [self.proc.renderer.tokenizer.id_to_token(i) for i in ids] if body.get("return_token_strs") else None
        return web.json_response(
            {"count": len(ids), "max_model_len": self.proc.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RouterError(400, "'tokens' must be a list of token ids", param="tokens")
        text = self.proc.renderer.tokenizer.tokenizer.decode(tokens, skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.w.config

        def card(mid: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": mid,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": self.proc.max_model_len,
                "permission": [],
            }

        data = [card(cfg.model_name, cfg.model, None)]
        data += [card(m.name, m.path, cfg.model_name) for m in cfg.lora_modules]
        return web.json_response({"object": "list", "data": data})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.w.config.engine_version})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.w.engine.reset_prefix_cache():
            raise RouterError(409, "the prefix cache cannot be reset while requests hold KV blocks")
        return web.Response(status=200)

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        cfg = self.w.config
        return web.json_response(
            {
                "0": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": self.w.kv_endpoint,
                    "replay_endpoint": self.w.replay_endpoint,
                    "buffer_steps": cfg.buffer_steps,
                    "topic": cfg.topic,
                }
            }
        )
