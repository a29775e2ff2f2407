"""Request body → the engine's prompt token ids (the vLLM view), built once per model.

``Renderer.from_files`` loads the tokenizer, compiles the model's templates and
detects the vision family once; per request there is no file access and no
template compilation (request-supplied templates are compiled once and cached).

Chat messages are converted the way vLLM 0.33 does before templating
(``renderers/chat_utils/parse_chat_message_content.py``): for "openai"-format
templates every part becomes ``{"type": "text", "text": …}`` or ``{"type": "image"}``;
for "string"-format templates each message's images become the family's placeholder
strings, put before the text and joined with ``"\\n"`` (ENGINES.md §4.3).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import jinja2

from mmroute.errors import RouterError
from mmroute.models.base import ExpansionError, ImageInput, MMItem, VisionFamily
from mmroute.models.files import ModelFiles
from mmroute.render.template import (
    CONTENT_FORMATS,
    CompiledTemplate,
    TemplateCompiler,
    load_chat_template_arg,
    merge_template_kwargs,
    render_template,
    select_template,
)
from mmroute.render.tokenizer import ModelTokenizer

try:  # written in parallel by the models owner; text rendering works without it
    from mmroute.models.registry import detect_family as _detect_family
except ImportError:  # pragma: no cover - only while the registry does not exist
    _detect_family = None

log = logging.getLogger(__name__)

# Part types vLLM treats as text, and the field holding their text.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
_IMAGE_PARTS = ("image_url", "input_image")
_OTHER_MEDIA = ("audio_url", "input_audio", "video_url", "image_embeds", "audio_embeds", "video_embeds",
                "image_pil", "prompt_embeds", "file")
# Fields of OpenAI/vLLM content parts; anything else is passed to the template as-is.
_KNOWN_PART_FIELDS = frozenset({"type", "text", "image_url", "input_audio", "audio_url", "video_url", "uuid",
                                "image_embeds", "audio_embeds", "video_embeds", "image_pil", "refusal", "file",
                                "thinking", "name", "data"})


class UnroutablePrompt(Exception):
    """The body is valid but has no single prompt to key (several prompts, prompt
    embeds, media the router cannot place): route it on load alone."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


@dataclass
class RenderedPrompt:
    token_ids: list[int]  # the vLLM view: image spans filled with the image token
    mm_items: list[MMItem] = field(default_factory=list)
    text: str | None = None  # rendered prompt, one unexpanded placeholder per image
    fallback: str | None = None  # why not exact; token_ids is then a safe prefix
    num_images: int = 0
    num_tokens: int | None = None  # best known prompt length (fallbacks: a lower bound)
    # Seconds spent per stage ("render": chat template, "tokenize": ids + image expansion).
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.num_tokens if self.num_tokens is not None else len(self.token_ids)


def _stages(t0: float, t1: float) -> dict[str, float]:
    """Stage timings of a render that started at ``t0`` and finished templating at ``t1``."""
    return {"render": t1 - t0, "tokenize": time.perf_counter() - t1}


def image_url_of(part: Mapping[str, Any]) -> str | None:
    """The URL of an image part (``image_url`` as ``{"url": …}`` or a plain string)."""
    iu = part.get("image_url")
    if isinstance(iu, Mapping):
        iu = iu.get("url")
    return iu if isinstance(iu, str) else None


def _part_kind(part: Any) -> str:
    """"text" | "image" | "tool_reference" | "media" (other modality) | "unknown"
    (vLLM rejects it)."""
    if isinstance(part, str):
        return "text"
    ptype = part.get("type")
    if ptype is None or part.get("uuid") is not None:
        if "image_url" in part or "image_pil" in part:
            return "image"
        if any(k in part for k in _OTHER_MEDIA):
            return "media"
        if ptype is None:
            return "unknown"
    if ptype in _TEXT_PARTS:
        return "text"
    if ptype == "tool_reference":
        return "tool_reference"
    if ptype in _IMAGE_PARTS:
        return "image"
    if ptype in _OTHER_MEDIA or ptype == "image_pil":
        return "media"
    return "unknown"


def _lcp(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Renderer:
    def __init__(
        self,
        files: ModelFiles,
        tokenizer: ModelTokenizer,
        family: VisionFamily | None,
        family_reason: str,
        *,
        chat_template: str | None = None,
        content_format: str = "auto",
        max_model_len: int | None = None,
        default_template_kwargs: Mapping[str, Any] | None = None,
    ):
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"content_format must be one of {CONTENT_FORMATS}")
        self.files = files
        self.tokenizer = tokenizer
        self.family = family
        self.mm_enabled = family is not None
        self.mm_reason = "" if family is not None else (family_reason or "no vision family detected")
        self.max_model_len = max_model_len if max_model_len is not None else files.max_model_len
        self.templates = files.chat_templates
        self.flag_template = chat_template
        self.content_format = content_format
        self.default_template_kwargs = dict(default_template_kwargs or {})
        self.compiler = TemplateCompiler()
        self.template_errors: dict[str, str] = {}
        for src in self._model_template_sources():
            try:
                self.compiler.compile(src, pin=True)
            except jinja2.TemplateError as exc:  # surfaced per request as a 400
                self.template_errors[src] = str(exc)
                log.warning("%s: chat template does not compile: %s", files.source, exc)

    @classmethod
    def from_files(
        cls,
        files: ModelFiles,
        chat_template: str | None = None,
        *,
        content_format: str = "auto",
        max_model_len: int | None = None,
        default_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> "Renderer":
        """``mm_processor_kwargs``: the workers' ``--mm-processor-kwargs`` (e.g. max_pixels),
        which change how many tokens an image becomes."""
        tokenizer = ModelTokenizer.from_files(files)
        if _detect_family is None:
            family, reason = None, "vision family registry not available"
        else:
            try:
                family, reason = _detect_family(files, tokenizer, dict(mm_processor_kwargs or {}) or None)
            except Exception as exc:  # a family bug must not stop text routing
                log.exception("vision family detection failed")
                family, reason = None, f"family detection failed: {type(exc).__name__}: {exc}"
        return cls(
            files,
            tokenizer,
            family,
            reason,
            chat_template=load_chat_template_arg(chat_template),
            content_format=content_format,
            max_model_len=max_model_len,
            default_template_kwargs=default_template_kwargs,
        )

    def _model_template_sources(self) -> list[str]:
        out: list[str] = []
        for t in (self.flag_template, self.templates.processor, self.templates.tokenizer):
            if isinstance(t, str):
                out.append(t)
            elif isinstance(t, dict):
                out.extend(t.values())
        return list(dict.fromkeys(out))

    # ---- images -------------------------------------------------------------------

    def image_parts(self, messages: Any) -> list[dict[str, Any]]:
        """Every image content part, in conversation order (what ``images`` aligns with)."""
        out: list[dict[str, Any]] = []
        if not isinstance(messages, list):
            return out
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                if isinstance(part, dict) and _part_kind(part) == "image":
                    out.append(part)
        return out

    # ---- chat ---------------------------------------------------------------------

    def render_chat(self, body: Mapping[str, Any], images: Sequence[ImageInput | None]) -> RenderedPrompt:
        messages = _validate_messages(body.get("messages"))
        tools = _normalise_tools(body.get("tools"))
        kwargs = merge_template_kwargs(body, self.default_template_kwargs)
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise RouterError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        add_special = body.get("add_special_tokens", False)
        if not isinstance(add_special, bool):
            raise RouterError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        req_tpl = body.get("chat_template")
        if req_tpl is not None and not isinstance(req_tpl, str):
            raise RouterError(400, "'chat_template' must be a string", param="chat_template")
        try:
            return self._render_chat(body, images, messages, tools, kwargs, add_special)
        except UnroutablePrompt as exc:
            # Media the router cannot place (audio, video, embeddings): no safe prefix.
            return RenderedPrompt([], [], None, exc.reason, len(images), None)

    def _render_chat(
        self,
        body: Mapping[str, Any],
        images: Sequence[ImageInput | None],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
        add_special: bool,
    ) -> RenderedPrompt:
        req_tpl = body.get("chat_template")
        source = select_template(
            self.templates, request_template=req_tpl, flag_template=self.flag_template, has_tools=tools is not None
        )
        compiled = self._compile(source)
        fmt = compiled.content_format if self.content_format == "auto" else self.content_format

        conversation, n_images = self._conversation(messages, fmt, drop_images=False)
        if len(images) != n_images:
            raise ValueError(f"render_chat got {len(images)} images for {n_images} image parts")
        t0 = time.perf_counter()
        text = self._render(compiled, conversation, tools, kwargs)
        t1 = time.perf_counter()
        ids = self.tokenizer.encode(text, add_special)
        if n_images == 0:
            return RenderedPrompt(ids, [], text, None, 0, len(ids), _stages(t0, t1))

        family = self.family
        if family is None:
            reason = "mm_disabled"
        elif any(im is None for im in images):
            reason = "unresolved_image"
        else:
            try:
                resolved = [im for im in images if im is not None]
                expanded, items = self._expand(family, text, ids, resolved, add_special)
                return RenderedPrompt(expanded, items, text, None, n_images, len(expanded), _stages(t0, t1))
            except ExpansionError as exc:
                reason = exc.reason or "expansion"
                log.debug("image expansion failed (%s): %s", reason, exc)
        prefix = self._fallback_prefix(compiled, messages, fmt, tools, kwargs, text, ids, add_special)
        return RenderedPrompt(prefix, [], text, reason, n_images, len(ids), _stages(t0, t1))

    def _expand(
        self, family: VisionFamily, text: str, ids: list[int], images: Sequence[ImageInput], add_special: bool
    ) -> tuple[list[int], list[MMItem]]:
        if getattr(family, "needs_text", False):
            # Phi-3-V re-tokenizes the prompt text (ENGINES.md §4.6).
            return family.expand_text(text, images, self.tokenizer.encode)  # type: ignore[attr-defined]
        return family.expand(ids, images, self.tokenizer.encode)

    def _fallback_prefix(
        self,
        compiled: CompiledTemplate,
        messages: list[dict[str, Any]],
        fmt: str,
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
        text: str,
        ids: list[int],
        add_special: bool,
    ) -> list[int]:
        """Ids that are surely a prefix of the engine's view and end before the first
        image. The text before the first image is where the rendering with images and
        the rendering without any image part first differ."""
        try:
            bare, _ = self._conversation(messages, fmt, drop_images=True)
            bare_text = self._render(compiled, bare, tools, kwargs)
        except RouterError:
            return []
        cut = _lcp(text, bare_text)
        prefix_text = text[:cut]
        family = self.family
        if family is not None:
            # Let the family place one probe image right there: its own rules decide the
            # ids before the span (Phi-3-V's BOS per chunk, Gemma-3's newline merge).
            placeholder = family.placeholder(1)
            probe = [ImageInput("probe", 336, 336)]
            try:
                probe_ids = self.tokenizer.encode(prefix_text + placeholder, add_special)
                got, items = self._expand(family, prefix_text + placeholder, probe_ids, probe, add_special)
            except ExpansionError:
                return []
            if len(items) != 1:
                return []
            out = got[: items[0].offset]
            if text[cut : cut + len(placeholder)] != placeholder and out:
                out = out[:-1]  # the cut is not at the placeholder: the last piece may merge on
            if not getattr(family, "needs_text", False):
                out = out[: _lcp(out, ids)]
            return out
        pre = self.tokenizer.encode(prefix_text, add_special)
        out = pre[: _lcp(pre, ids)]
        return out[:-1]  # an unknown family may rewrite the token next to the image

    def _compile(self, source: str) -> CompiledTemplate:
        if source in self.template_errors:
            raise RouterError(400, f"the chat template does not compile: {self.template_errors[source]}")
        try:
            return self.compiler.compile(source)
        except jinja2.TemplateError as exc:
            raise RouterError(400, f"invalid chat template: {exc}", param="chat_template") from None

    def _render(
        self,
        compiled: CompiledTemplate,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        try:
            return render_template(
                compiled, conversation, tools=tools, kwargs=kwargs, special_tokens=self.tokenizer.special_tokens
            )
        except RouterError:
            raise
        except jinja2.TemplateError as exc:  # raise_exception(...) and jinja errors
            raise RouterError(400, str(exc) or type(exc).__name__) from None
        except Exception as exc:  # vLLM turns any template failure into a 400 ValueError
            raise RouterError(400, f"chat template failed: {type(exc).__name__}: {exc}") from None

    def _conversation(
        self, messages: list[dict[str, Any]], fmt: str, *, drop_images: bool
    ) -> tuple[list[dict[str, Any]], int]:
        """vLLM's ConversationMessage list; returns it and the number of images."""
        out: list[dict[str, Any]] = []
        n_images = 0
        for msg in messages:
            role = msg["role"]
            content = msg.get("content")
            parts: list[Any]
            if content is None:
                parts = []
            elif isinstance(content, str):
                parts = [content]
            else:
                parts = list(content)
            if role == "system":
                parts = _strip_billing_header(parts)
            texts: list[Any] = []
            placeholders: list[str] = []
            for part in parts:
                kind = _part_kind(part)
                if kind == "text":
                    if isinstance(part, str):
                        value: Any = part
                        extra: dict[str, Any] = {}
                    else:
                        value = part.get(_TEXT_PARTS.get(part.get("type") or "text", "text"))
                        if value is None:
                            continue  # vLLM skips text parts without text
                        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
                    texts.append({"type": "text", "text": value, **extra} if fmt == "openai" else value)
                elif kind == "image":
                    n_images += 1
                    if drop_images:
                        continue
                    if fmt == "openai":
                        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
                        texts.append({"type": "image", **extra})
                    else:
                        placeholders.append(self._placeholder(n_images))
                elif kind == "tool_reference":  # deferred-tool reference, passed through
                    name = part.get("name")
                    if name:
                        texts.append({"type": "tool_reference", "name": name} if fmt == "openai" else name)
                elif kind == "media":
                    raise UnroutablePrompt("unsupported_modality", "only image media can be routed exactly")
                else:
                    raise RouterError(400, f"Unsupported chat content part type: {part.get('type')!r}.",
                                      param="messages")
            conv: dict[str, Any] = {"role": role}
            if fmt == "openai":
                conv["content"] = texts
            else:
                conv["content"] = _join_string_content(texts, placeholders)
            _copy_message_fields(msg, conv)
            out.append(conv)
        return out, n_images

    def _placeholder(self, index: int) -> str:
        if self.family is not None:
            return self.family.placeholder(index)
        return f"<##IMAGE_{index}##>"  # no family: the request falls back anyway

    # ---- completions --------------------------------------------------------------

    def render_completion(self, body: Mapping[str, Any]) -> RenderedPrompt:
        if "prompt" not in body or body.get("prompt") is None:
            if body.get("prompt_embeds") is not None:
                raise UnroutablePrompt("prompt_embeds", "prompt embeddings carry no token ids")
            raise RouterError(400, "'prompt' is required", param="prompt")
        prompt = body["prompt"]
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise RouterError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > 1:
                raise UnroutablePrompt("multi_prompt", "several prompts in one request")
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if prompt == "":
                raise RouterError(400, "The prompt cannot be empty.", param="prompt")
            t0 = time.perf_counter()
            ids = self.tokenizer.encode(prompt, add_special)
            return RenderedPrompt(ids, [], prompt, None, 0, len(ids), _stages(t0, t0))
        if isinstance(prompt, list):
            if not prompt:
                raise RouterError(400, "The prompt cannot be empty.", param="prompt")
            vocab = self.tokenizer.vocab_size
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise RouterError(400, "'prompt' must be a string, a list of token ids or a list of those",
                                      param="prompt")
                if not 0 <= t < vocab:
                    raise RouterError(400, f"Token id {t} is out of vocabulary", param="prompt")
            ids = list(prompt)
            return RenderedPrompt(ids, [], None, None, 0, len(ids))
        raise RouterError(400, "'prompt' must be a string, a list of token ids or a list of those", param="prompt")

    # ---- limits -------------------------------------------------------------------

    def check_length(self, prompt: RenderedPrompt | int, max_tokens: int | None = None) -> None:
        """400 when the prompt (plus requested output) exceeds ``max_model_len``, as vLLM
        rejects it (``renderers/params.py::TokenizeParams``)."""
        limit = self.max_model_len
        if limit is None:
            return
        n = prompt if isinstance(prompt, int) else prompt.length
        out = max_tokens or 0
        if out > limit:
            raise RouterError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {out}. This model's maximum context "
                f"length is {limit} tokens.",
                param="max_tokens",
            )
        if n > limit - out:
            extra = f" and requested {out} output tokens" if out else ""
            raise RouterError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has {n} input "
                f"tokens{extra}. Please reduce the length of the input messages.",
                param="messages",
            )


# ---- request validation / normalisation (vLLM protocol semantics) --------------------


_BILLING_HEADER = "x-anthropic-billing-header"


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """Drop Claude Code's attribution line from system text parts, as vLLM does (main,
    ``renderers/chat_utils/parse_chat_message_content.py::_strip_claude_code_billing_header``,
    PR #36829): its ``cch=`` value changes per request and would defeat every prefix hit.
    A part starting with the header keeps what follows its first newline, if anything."""
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RouterError(400, "'messages' must be a non-empty list", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RouterError(400, f"messages[{i}] must be an object", param="messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise RouterError(400, f"messages[{i}] needs a string 'role'", param="messages")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise RouterError(400, f"messages[{i}] ({role}) needs 'content'", param="messages")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, (dict, str)):
                    raise RouterError(400, f"messages[{i}].content[{j}] must be an object", param="messages")
        elif not isinstance(content, str):
            raise RouterError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise RouterError(400, f"messages[{i}].tool_calls must be a list", param="messages")
    return messages


def _join_string_content(texts: list[str], placeholders: list[str]) -> str:
    """vLLM ``_get_full_multimodal_text_prompt`` (interleaving off): placeholders the
    text does not already contain go in front, one per image, joined with "\\n"."""
    text = "\n".join(texts)
    if not placeholders:
        return text
    counts: dict[str, int] = {}
    for ph in placeholders:
        counts[ph] = counts.get(ph, 0) + 1
    missing: list[str] = []
    for ph, n in counts.items():
        n -= text.count(ph)
        if n < 0:
            raise RouterError(400, f"Found more '{ph}' placeholders in input prompt than actual multimodal data "
                                   "items.", param="messages")
        missing.extend([ph] * n)
    return "\n".join([*missing, text] if text else missing)


def _copy_message_fields(msg: Mapping[str, Any], conv: dict[str, Any]) -> None:
    """The fields vLLM keeps next to role/content (``_parse_chat_message_content``)."""
    role = msg["role"]
    if role == "assistant":
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            calls = _normalise_tool_calls(tool_calls)
            if calls:  # vLLM drops an empty list (templates take the plain path)
                conv["tool_calls"] = calls
        reasoning = msg.get("reasoning")
        if reasoning is None:
            reasoning = msg.get("reasoning_content")
        if reasoning is not None:
            conv["reasoning"] = reasoning
            conv["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in msg:
            conv["tool_call_id"] = msg["tool_call_id"]
        content = conv.get("content")
        if isinstance(content, list):  # text-only tool results become one string
            if all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                conv["content"] = "\n".join(p.get("text", "") for p in content)
    if isinstance(msg.get("name"), str):
        conv["name"] = msg["name"]
    if isinstance(msg.get("task"), str):
        conv["task"] = msg["task"]
    if role == "developer":
        conv["tools"] = msg.get("tools")


def _normalise_tool_calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    """Arguments as dicts (vLLM ``_postprocess_messages``): JSON strings are parsed;
    invalid or non-object JSON becomes ``{}``."""
    out: list[dict[str, Any]] = []
    for item in tool_calls:
        if not isinstance(item, dict):
            raise RouterError(400, "assistant tool_calls entries must be objects.", param="tool_calls")
        function = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(function, dict):
            raise RouterError(400, "chat completions only support assistant tool_calls of type 'function'.",
                              param="tool_calls")
        args = function.get("arguments")
        if args:
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = None
            else:
                parsed = args
            if not isinstance(parsed, dict):
                parsed = {}
        else:
            parsed = {}
        out.append({**item, "function": {**function, "arguments": parsed}})
    return out


def _normalise_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``[tool.model_dump() for tool in request.tools]``: declared fields first (with
    their defaults), then extra fields in the client's order. ``[]`` counts as no tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RouterError(400, "'tools' must be a list", param="tools")
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise RouterError(400, f"tools[{i}] must be an object with a 'function' object", param="tools")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str):
            raise RouterError(400, f"tools[{i}].function needs a string 'name'", param="tools")
        if tool.get("type", "function") != "function":
            raise RouterError(400, f"tools[{i}].type must be 'function'", param="tools")
        function: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        defer = fn.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")  # the tool-level flag propagates down
        if defer is not None:
            function["defer_loading"] = defer
        function.update({k: v for k, v in fn.items() if k not in function and k != "defer_loading"})
        entry: dict[str, Any] = {"type": "function", "function": function}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)  # vLLM's serializer keeps only declared tool-level fields
    return out
