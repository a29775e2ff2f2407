"""The routing decision for one request: body → token view → keys → overlaps → pick.

This is the request's path through the house (api → render → media → routing)
without any HTTP: the handlers call ``prepare`` then ``decide``; ``/router/explain``
calls the same two and stops there, so what explain shows is what routing does.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmroute.errors import RouterError, bad_request
from mmroute.media.resolve import ImageRef
from mmroute.models.base import MMItem
from mmroute.proxy.sglang import generate_unsupported
from mmroute.render.renderer import RenderedPrompt, UnroutablePrompt
from mmroute.routing import views
from mmroute.routing.scheduler import Candidate, Decision, NoEligibleWorker, RequestSize

if TYPE_CHECKING:
    from mmroute.api.context import AppContext
    from mmroute.workers.registry import Worker

DEFAULT_DECODE_TOKENS = 256  # expected output when the client set no max_tokens


@dataclass
class Prepared:
    """A parsed, rendered request, ready to be scored."""

    endpoint: str  # "chat" | "completions"
    body: dict[str, Any]
    model: str
    stream: bool
    lora_name: str | None = None
    cache_salt: str | None = None
    prompt: RenderedPrompt | None = None  # None: routed on load alone
    images: list[ImageRef | None] = field(default_factory=list)
    image_urls: list[str] = field(default_factory=list)
    fallback: str | None = None  # why routing is not exact (None: exact)
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    # Why SGLang's /generate cannot serve this chat (tools, logprobs, n>1): image requests
    # then go to its OpenAI endpoint, where mm_hashes cannot travel.
    generate_unsupported: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.length if self.prompt is not None else 0

    @property
    def has_mm(self) -> bool:
        return self.prompt is not None and bool(self.prompt.mm_items)


@dataclass
class ViewKeys:
    """The keys of one backend's token view, shared by the workers that use it."""

    name: str  # "vllm" | "sglang:wide" | "sglang:legacy" | "sglang:text" | "none"
    keys: list[int]
    mm_exact: bool  # image blocks are keyed exactly in this view
    added: int = 0  # tokens the engine adds to our prompt in this view (SGLang's BOS)


@dataclass
class Route:
    prepared: Prepared
    decision: Decision
    block_size: int
    overlaps: dict[str, int]
    views: dict[str, ViewKeys]  # worker id -> its view
    stages: dict[str, float]

    @property
    def worker_id(self) -> str:
        return self.decision.worker_id

    def request_blocks(self) -> int:
        p = self.prepared.prompt_tokens
        return math.ceil(p / self.block_size) if p else 0

    def prompt_tokens_for(self, worker_id: str) -> int:
        """Prompt length as that worker's engine counts it (its view may add a BOS)."""
        v = self.views.get(worker_id)
        return self.prepared.prompt_tokens + (v.added if v is not None else 0)

    def predicted_cached_tokens(self, worker_id: str) -> int:
        """What the worker should report as cached: block-aligned, last token recomputed
        (ENGINES.md §2.5, §3.4)."""
        p = self.prompt_tokens_for(worker_id)
        if p == 0:
            return 0
        bs = self.block_size
        return min(self.overlaps.get(worker_id, 0) * bs, ((p - 1) // bs) * bs)


def _model_and_lora(ctx: "AppContext", body: dict[str, Any]) -> tuple[str, str | None]:
    model = body.get("model")
    names = ctx.config.model_names
    if model is None:
        return names[0], None
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    if model in names:
        return model, None
    if model in ctx.lora_names:
        return model, model  # vLLM keys a LoRA request's blocks with the adapter name
    raise RouterError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model",
                      err_type="NotFoundError")


def _int_field(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise bad_request(f"'{name}' must be a non-negative integer", param=name)
    return v


def _validate_common(body: dict[str, Any]) -> tuple[bool, str | None, int]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            # vLLM: "Stream options can only be defined when `stream=True`."
            raise bad_request("Stream options can only be defined when `stream=True`.", param="stream_options")
        if not isinstance(so, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 1024):
        raise bad_request("'cache_salt' must be a string of 1 to 1024 characters", param="cache_salt")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise bad_request("'n' must be a positive integer", param="n")
    mt = _int_field(body, "max_completion_tokens")
    if mt is None:
        mt = _int_field(body, "max_tokens")
    return stream, salt, mt if mt is not None else DEFAULT_DECODE_TOKENS


async def prepare(ctx: "AppContext", endpoint: str, body: Any) -> Prepared:
    """Validate and render. Raises RouterError (4xx) for bad input."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if isinstance(model, str) and model not in ctx.config.model_names and model not in ctx.lora_names:
        await ctx.refresh_adapters()  # an adapter loaded on the workers since we last looked?
    model, lora = _model_and_lora(ctx, body)
    stream, salt, decode = _validate_common(body)
    prep = Prepared(endpoint, body, model, stream, lora, salt, decode_tokens=decode,
                    generate_unsupported=generate_unsupported(body) if endpoint == "chat" else None)
    t0 = time.perf_counter()
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", param="messages")
        parts = ctx.renderer.image_parts(messages)
        prep.image_urls = [_part_url(p) for p in parts]
        soft_error: str | None = None
        if parts:
            t1 = time.perf_counter()
            resolved = await ctx.resolve_images(prep.image_urls)
            ctx.metrics.observe_stage("media", time.perf_counter() - t1)
            prep.images = [r if isinstance(r, ImageRef) else None for r in resolved]
            soft_error = next((str(r.code) for r in resolved if isinstance(r, RouterError)), None)
        if ctx.config.tokenize == "remote":
            prep.prompt = await ctx.remote_tokens(prep)
        else:
            inputs = [img.to_input() if img is not None else None for img in prep.images]
            prep.prompt = ctx.renderer.render_chat(body, inputs)
            if soft_error and prep.prompt.fallback:
                prep.prompt.fallback = soft_error  # say *why* the image was not resolved
    elif endpoint == "completions":
        if "prompt" not in body:
            raise bad_request("'prompt' is required", param="prompt")
        try:
            if ctx.config.tokenize == "remote":
                prep.prompt = await ctx.remote_tokens(prep)
            else:
                prep.prompt = ctx.renderer.render_completion(body)
        except UnroutablePrompt as exc:
            prep.fallback = exc.reason
    else:  # pragma: no cover - handlers only pass the two
        raise bad_request(f"unknown endpoint {endpoint!r}")
    if prep.prompt is not None and prep.prompt.stage_seconds:
        for stage, secs in prep.prompt.stage_seconds.items():
            ctx.metrics.observe_stage(stage, secs)
    else:  # remote /tokenize, or nothing to render
        ctx.metrics.observe_stage("tokenize", time.perf_counter() - t0)
    if prep.prompt is not None:
        _truncate(ctx, prep)
    if prep.prompt is not None:
        ctx.renderer.check_length(prep.prompt, _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens"))
        if prep.prompt.fallback:
            prep.fallback = prep.prompt.fallback
            ctx.metrics.mm_fallback.labels(prep.prompt.fallback).inc()
    if prep.fallback:
        ctx.metrics.fallback.labels(prep.fallback).inc()
    return prep


def _truncate(ctx: "AppContext", prep: Prepared) -> None:
    """``truncate_prompt_tokens`` as vLLM applies it before the engine sees the prompt
    (``TokenizeParams``: -1 = the context length; ``truncation_side`` left keeps the last
    N ids). A truncated multimodal prompt may cut an image: routed on load alone."""
    body, p = prep.body, prep.prompt
    n = body.get("truncate_prompt_tokens")
    if n is None or p is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < -1 or n == 0:
        raise bad_request("'truncate_prompt_tokens' must be -1 or a positive integer", param="truncate_prompt_tokens")
    side = body.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise bad_request("'truncation_side' must be 'left' or 'right'", param="truncation_side")
    if n == -1:
        n = ctx.renderer.max_model_len or p.length
    if p.length <= n:
        return
    if p.mm_items or p.fallback:
        prep.prompt, prep.fallback = None, "truncated_multimodal"
        return
    ids = p.token_ids[-n:] if side == "left" else p.token_ids[:n]
    prep.prompt = RenderedPrompt(ids, [], p.text, None, p.num_images, len(ids), p.stage_seconds)


def _cache_bypassed(body: dict[str, Any]) -> bool:
    """vLLM skips reading the prefix cache when prompt logprobs are wanted
    (``prompt_logprobs``, or ``echo`` with logprobs): such a request gains nothing from
    an overlap and reports no cached tokens."""
    return body.get("prompt_logprobs") is not None or bool(
        body.get("echo") and (body.get("logprobs") or body.get("top_logprobs")))


def _part_url(part: dict[str, Any]) -> str:
    iu = part.get("image_url")
    if isinstance(iu, dict):
        iu = iu.get("url")
    if not isinstance(iu, str) or not iu:
        raise bad_request("image_url parts need a non-empty 'url'", param="messages")
    return iu


def _view_for(ctx: "AppContext", prep: Prepared, w: "Worker", bs: int, cache: dict[str, ViewKeys]) -> ViewKeys:
    p = prep.prompt
    if p is None:
        return cache.setdefault("none", ViewKeys("none", [], False))
    if w.backend != "sglang":
        v = cache.get("vllm")
        if v is None:
            keys = views.vllm_view_keys(p.token_ids, p.mm_items, bs, prep.lora_name, prep.cache_salt)
            v = cache["vllm"] = ViewKeys("vllm", keys, True)
        return v
    # SGLang publishes no extra keys: salted / LoRA requests cannot be matched (ENGINES.md §3.1).
    if prep.lora_name or prep.cache_salt is not None:
        return cache.setdefault("sglang:nomatch", ViewKeys("sglang:nomatch", [], False))
    scheme = views.sglang_scheme_for_version(w.version or "") if p.mm_items else None
    # Families whose SGLang token view differs from vLLM's beyond pad values (Gemma-3:
    # SGLang expands in text and pads only the soft tokens) are keyed on text only there.
    sglang_exact = getattr(ctx.renderer.family, "sglang_exact", True)
    if p.mm_items and (scheme is None or not w.mm_hashes_ok or prep.generate_unsupported or not sglang_exact):
        # Image pages unmatchable on this worker: key the text before the first image only.
        name = "sglang:text"
        if name not in cache:
            # Sent to /generate (SGLang's tokenization rule) unless /generate cannot serve it.
            tokens, items = (p.token_ids, p.mm_items) if prep.generate_unsupported else _sglang_generate_ids(ctx, p)
            first = min(it.offset for it in items)
            cache[name] = ViewKeys(name, views.sglang_view_keys(tokens[:first], [], bs, None), False,
                                   added=len(tokens) - len(p.token_ids))
        return cache[name]
    name = f"sglang:{scheme or 'plain'}"
    if name not in cache:
        tokens, items = p.token_ids, p.mm_items
        if items:
            tokens, items = _sglang_generate_ids(ctx, p)
        cache[name] = ViewKeys(name, views.sglang_view_keys(tokens, items, bs, scheme), True,
                               added=len(tokens) - len(p.token_ids))
    return cache[name]


def _sglang_generate_ids(ctx: "AppContext", p: RenderedPrompt) -> tuple[list[int], list[Any]]:
    """The ids SGLang builds from the ``/generate`` text: it tokenizes with special tokens
    unless the text already starts with the BOS string (SGLang main
    ``multimodal/processors/base_processor.py::process_mm_data``), so Llama-style
    tokenizers whose template writes no BOS (LLaVA) get one more leading token."""
    tok = ctx.renderer.tokenizer
    if not tok.prefix_ids or (tok.bos_token and (p.text or "").startswith(tok.bos_token)):
        return p.token_ids, p.mm_items
    shift = len(tok.prefix_ids)
    items = [MMItem(it.identifier, it.offset + shift, it.length) for it in p.mm_items]
    return [*tok.prefix_ids, *p.token_ids, *tok.suffix_ids], items


def decide(ctx: "AppContext", prep: Prepared, exclude: set[str] | frozenset[str] = frozenset()) -> Route:
    """Score every worker and pick one. Raises RouterError(503) when none is usable."""
    stages: dict[str, float] = {}
    workers = list(ctx.registry.workers.values())
    bs = ctx.block_size()
    t0 = time.perf_counter()
    cache: dict[str, ViewKeys] = {}
    per_worker = {w.id: _view_for(ctx, prep, w, bs, cache) for w in workers}
    t1 = time.perf_counter()
    stages["hash"] = t1 - t0
    # Overlaps are looked up under every policy: the load-only policies ignore them for
    # the choice, but explain and the prediction metrics stay truthful.
    overlaps: dict[str, int] = {}
    by_view: dict[str, list[str]] = {}
    for wid, v in per_worker.items():
        by_view.setdefault(v.name, []).append(wid)
    if _cache_bypassed(prep.body):
        overlaps = {w.id: 0 for w in workers}
    else:
        for name, wids in by_view.items():
            overlaps.update(ctx.index.overlaps(cache[name].keys, wids))
    t2 = time.perf_counter()
    stages["lookup"] = t2 - t1
    candidates = [
        Candidate(
            worker_id=w.id,
            overlap_blocks=overlaps.get(w.id, 0),
            indexed_blocks=ctx.index.block_count(w.id),
            healthy=w.usable,
            queued_reqs_reported=w.reported_waiting,
        )
        for w in workers
    ]
    size = RequestSize(prompt_tokens=prep.prompt_tokens, block_size=bs, decode_tokens=prep.decode_tokens)
    try:
        decision = ctx.scheduler.choose(candidates, size, exclude)
    except NoEligibleWorker:
        raise RouterError(503, "No healthy worker is available to serve this request; retry later.",
                          code="no_healthy_worker", headers={"Retry-After": "1"}) from None
    stages["schedule"] = time.perf_counter() - t2
    for stage, secs in stages.items():
        ctx.metrics.observe_stage(stage, secs)
    return Route(prep, decision, bs, overlaps, per_worker, stages)


def forward_chat_body(ctx: "AppContext", prep: Prepared, worker: "Worker") -> dict[str, Any]:
    """The chat body a vLLM worker receives: unchanged, plus each image's identifier as
    the part's ``uuid`` so vLLM keys its blocks with it verbatim (ENGINES.md §2.1).
    No uuid at all when the router could not make the images exact."""
    body = prep.body
    if prep.endpoint != "chat" or not prep.has_mm or worker.backend == "sglang":
        return body
    body = dict(body)
    body["messages"] = copy.deepcopy(prep.body["messages"])
    # The renderer's own notion of an image part (image_url, input_image, untyped parts
    # with image_url/uuid), in the same order as prep.images: ids never shift parts.
    for part, img in zip(ctx.renderer.image_parts(body["messages"]), prep.images):
        if img is not None:
            part["uuid"] = img.identifier
    return body
