"""The simulated worker's "processor": prompt rendering, image sizing and identity.

It turns requests into the token ids the engine would cache, the way the engine's
own processor would: chat template + tokenizer + the model family's placeholder
expansion (``mmroute.render`` / ``mmroute.models``, shared with the router so the
simulator is exactly as faithful as the router's parity tests prove them to be).

Image identity is the *engine's*, never the router's:

* vLLM: the part's ``uuid`` verbatim (vLLM >= 0.26 default), else a content hash that
  deliberately differs from mmroute's own identifier (vLLM hashes its kwargs with
  blake3, not the bare bytes): a router must send uuids to get image-block hits.
* SGLang: the ``mm_hashes`` entry (16 hex digits), else a hash of the image content
  standing in for SGLang's pixel-tensor hash; spans then hold that hash's pad values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import blake3

from mmroute.errors import RouterError
from mmroute.media.fetch import MediaFetcher
from mmroute.media.resolve import ImageRef, resolve_image
from mmroute.models.base import ExpansionError, ImageInput, MMItem
from mmroute.models.files import ModelFiles
from mmroute.render.renderer import Renderer, RenderedPrompt, UnroutablePrompt, image_url_of
from mmroute.sim.sglang_hash import fill_span, pad_values, parse_mm_hash

FILLER_WORDS = ("This", " is", " a", " simulated", " response", " from", " the", " engine", ".")


@dataclass(frozen=True)
class Prompt:
    """What the engine caches: token ids (image spans filled as the engine fills them)
    and each image's span with the engine's identifier."""

    token_ids: list[int]
    mm_items: list[MMItem]
    num_images: int = 0


def filler_tokens(renderer: Renderer) -> list[tuple[int, str]]:
    """Deterministic output: ordinary words that are single tokens in this vocabulary."""
    out: list[tuple[int, str]] = []
    for word in FILLER_WORDS:
        ids = renderer.tokenizer.encode(word, False)
        if len(ids) == 1:
            out.append((ids[0], word))
    if not out:  # an exotic vocabulary: fall back to whatever a plain letter encodes to
        out = [(i, renderer.tokenizer.id_to_token(i) or "") for i in renderer.tokenizer.encode("a", False)[:1]]
    if not out:
        raise ValueError("the tokenizer cannot encode any filler text")
    return out


class Processor:
    def __init__(self, model: str, *, max_model_len: int | None = None, model_id: str | None = None):
        self.files = ModelFiles.load(model)
        self.renderer = Renderer.from_files(self.files, max_model_len=max_model_len)
        self.model_id = model_id or model
        self.max_model_len = self.renderer.max_model_len
        self._fetcher: MediaFetcher | None = None
        # uuid -> size, so a later request may omit the media (vLLM's processor cache).
        self._sizes: dict[str, tuple[int, int]] = {}

    @property
    def family(self):  # noqa: ANN201 - VisionFamily | None
        return self.renderer.family

    async def close(self) -> None:
        if self._fetcher is not None:
            await self._fetcher.close()

    def _fetcher_(self) -> MediaFetcher:
        if self._fetcher is None:
            # An engine fetches whatever URL it is given (no SSRF guard inside a cluster).
            self._fetcher = MediaFetcher(allow_hosts=("0.0.0.0/0", "::/0"))
        return self._fetcher

    async def resolve(self, url: str) -> ImageRef:
        return await resolve_image(url, self._fetcher_())

    # --- vLLM ------------------------------------------------------------------------

    def vllm_content_id(self, data: bytes) -> str:
        # Stand-in for vLLM's hash_kwargs(model_id=..., image=...): blake3 hex over the
        # model id and the bytes, never equal to mmroute's blake3(bytes).
        return blake3.blake3(b"vllm-sim\x00" + self.model_id.encode() + b"\x00" + data).hexdigest()

    async def vllm_image(self, part: Mapping[str, Any]) -> ImageInput:
        uuid = part.get("uuid")
        uuid = None if uuid is None else str(uuid)
        url = image_url_of(part)
        if url is None:
            if uuid is not None and uuid in self._sizes:
                w, h = self._sizes[uuid]
                return ImageInput(uuid, w, h)
            raise RouterError(400, "image_url without data needs the uuid of an image this worker has seen",
                              param="messages")
        ref = await self.resolve(url)
        ident = uuid if uuid is not None else self.vllm_content_id(ref.data)
        self._sizes[ident] = (ref.width, ref.height)
        return ImageInput(ident, ref.width, ref.height)

    async def vllm_chat(self, body: Mapping[str, Any]) -> Prompt:
        parts = self.renderer.image_parts(body.get("messages"))
        images = [await self.vllm_image(p) for p in parts]
        return self.exact(self.renderer.render_chat(body, images))

    def completion(self, body: Mapping[str, Any]) -> Prompt:
        try:
            rendered = self.renderer.render_completion(body)
        except UnroutablePrompt as exc:
            raise RouterError(400, f"the simulator serves one token prompt per request ({exc.reason})",
                              param="prompt") from None
        return self.exact(rendered)

    def exact(self, rendered: RenderedPrompt) -> Prompt:
        if rendered.fallback:
            raise RouterError(400, f"this model cannot process the request exactly: {rendered.fallback}")
        if not rendered.token_ids:
            raise RouterError(400, "The prompt cannot be empty.")
        return Prompt(list(rendered.token_ids), list(rendered.mm_items), rendered.num_images)

    # --- SGLang ---------------------------------------------------------------------------

    @staticmethod
    def sglang_content_hash(data: bytes) -> int:
        # Stand-in for SGLang's sha256 over the processor's pixel tensors.
        return int.from_bytes(hashlib.sha256(b"sglang-sim-pixels\x00" + data).digest()[:8], "big")

    async def sglang_images(self, image_data: Any) -> list[ImageRef]:
        if image_data is None:
            return []
        items = image_data if isinstance(image_data, list) else [image_data]
        refs = []
        for item in items:
            url = item.get("url") if isinstance(item, Mapping) else item
            if not isinstance(url, str):
                raise RouterError(400, "image_data entries must be URLs or data URIs", param="image_data")
            refs.append(await self.resolve(url))
        return refs

    def sglang_hashes(self, refs: Sequence[ImageRef], mm_hashes: Any) -> list[int]:
        """Per image: the ``mm_hashes`` entry; a count mismatch ignores the whole list and
        an unparsable entry falls back for that item (SGLang's behaviour)."""
        given: list[Any] | None = mm_hashes if isinstance(mm_hashes, list) else None
        if given is not None and len(given) != len(refs):
            given = None
        out = []
        for i, ref in enumerate(refs):
            h = parse_mm_hash(given[i]) if given is not None else None
            out.append(h if h is not None else self.sglang_content_hash(ref.data))
        return out

    def expand(self, token_ids: list[int], text: str | None, images: Sequence[ImageInput]) -> tuple[list[int], list[MMItem]]:
        """One unexpanded placeholder per image -> the engine's expanded ids and spans."""
        family = self.family
        if not images:
            return token_ids, []
        if family is None:
            raise RouterError(400, f"this model does not accept images ({self.renderer.mm_reason})")
        try:
            if getattr(family, "needs_text", False):
                if text is None:
                    raise RouterError(400, "this model needs the prompt text to place images")
                return family.expand_text(text, images, self.renderer.tokenizer.encode)
            return family.expand(token_ids, images, self.renderer.tokenizer.encode)
        except ExpansionError as exc:
            raise RouterError(400, str(exc)) from None

    def sglang_view(self, token_ids: list[int], items: Sequence[MMItem], hashes: Sequence[int], version: str) -> list[int]:
        """Swap each image span for its pad values (schedule_batch pad_input_ids)."""
        out = list(token_ids)
        for item, h in zip(items, hashes):
            out[item.offset : item.offset + item.length] = fill_span(pad_values(h, version), item.length)
        return out
