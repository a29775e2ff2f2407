"""What the simulated vLLM and SGLang HTTP surfaces share: reading the JSON body, the
``max_tokens`` rules, admission into the engine and the OpenAI-shaped answer."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Mapping

from aiohttp import web

from mmroute.errors import RouterError
from mmroute.sim import openai
from mmroute.sim.engine_common import CapacityError

if TYPE_CHECKING:
    from mmroute.sim.processor import Processor
    from mmroute.sim.server import SimWorker


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RouterError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RouterError(400, "the request body must be a JSON object")
    return body


class EngineApi:
    """Base of the two surfaces: holds the worker; subclasses add the engine's routes."""

    def __init__(self, worker: "SimWorker"):
        self.w = worker
        self.created = int(time.time())

    @property
    def proc(self) -> "Processor":
        return self.w.processor

    def _check(self, ids: list[int], n: int, explicit: bool) -> int:
        """``n`` output tokens after a prompt of ``ids``: a default is capped to the context,
        an explicit value must fit (400 otherwise)."""
        n = self.w.max_tokens_cap(len(ids), n, explicit)
        self.proc.renderer.check_length(len(ids), n)
        return n

    def _openai_max_tokens(self, body: Mapping[str, Any], ids: list[int], chat: bool) -> int:
        explicit = body.get("max_tokens") is not None or (chat and body.get("max_completion_tokens") is not None)
        return self._check(ids, openai.parse_max_tokens(body, self.w.config.default_max_tokens, chat=chat), explicit)

    async def _admit(self, seq: Any, n: int) -> int:
        """Wait for room in the engine and prefill ``seq``; its cached tokens."""
        try:
            return await self.w.runner.admit(seq, n)
        except CapacityError as exc:
            raise RouterError(400, f"the request does not fit in the KV cache: {exc}") from None

    async def _openai_answer(
        self,
        request: web.Request,
        body: Mapping[str, Any],
        seq: Any,
        ids: list[int],
        n: int,
        *,
        chat: bool,
        stream_options: tuple[bool, bool, bool],
        always_details: bool,
        extra_response: Mapping[str, Any] | None = None,
    ) -> web.StreamResponse:
        """Admit ``seq`` (prompt ``ids``), generate ``n`` tokens and answer as OpenAI does;
        the request's KV is released however the answer ends."""
        cached = await self._admit(seq, n)
        runner = self.w.runner
        stream, include_usage, continuous = stream_options
        try:
            return await openai.respond(
                request,
                chat=chat,
                model=body.get("model") or self.w.config.model_name,
                prompt_tokens=len(ids),
                cached=cached,
                tokens=runner.generate(seq, len(ids), cached, n),
                stream=stream,
                include_usage=include_usage,
                continuous_usage=continuous,
                always_details=always_details,
                extra_response=extra_response,
            )
        finally:
            runner.release(seq)
