"""Phi-3-vision / Phi-3.5-vision: HD-transform counts and text-level expansion.

Counts (ENGINES.md §5.1): vLLM 0.33 ``model_executor/models/phi3v.py`` calls the HF
remote-code ``image_processing_phi3_v.py::calc_num_image_tokens_from_image_size``:
transpose to landscape, take the largest ``scale`` with ``scale * ceil(scale / r) <=
num_crops``, resize the width to ``336 * scale``, pad the height up to a multiple of
336, transpose back; then ``(h/336 * w/336 + 1) * num_img_tokens + 1 + (h/336 + 1) * 12``.

Expansion (ENGINES.md §4.6): ``<|image_N|>`` is not a token, and vLLM's
``Phi3VMultiModalProcessor._apply_prompt_updates`` re-tokenizes the prompt the HF
``processing_phi3_v.py`` way: split the text on ``<|image_\\d+|>``, encode every text
chunk *with* BOS, keep each tag's own ids, then replace the tag of image N (1-based)
with ``[<|image|>] * count``. That needs the prompt text, so this family says
``needs_text`` and offers ``expand_text``; ``expand`` on ids alone cannot be exact.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from mmroute.models.base import Encode, ExpansionError, ImageInput, MMItem
from mmroute.models.common import TokenLookup, as_int, check_size, placeholder_count_error, resolve_image_token_id

IMAGE_TOKEN = "<|image|>"
IMAGE_TOKEN_ID = 32044  # vLLM phi3v.py _IMAGE_TOKEN_ID: the HF config does not name it
TAG_RE = re.compile(r"<\|image_(\d+)\|>")
TILE = 336
_NEWLINE_TOKENS_PER_ROW = 12  # one separator per row of 12 merged features (sub_GN)


def hd_transform_size(width: int, height: int, num_crops: int) -> tuple[int, int]:
    """The padded (width, height) the HD transform produces."""
    check_size(width, height)
    transposed = width < height
    if transposed:
        width, height = height, width
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_w = scale * TILE
    new_h = int(new_w / ratio)
    if scale < 1 or new_h < 1:  # the processor's resize to a 0-pixel side fails
        raise ExpansionError("image_size", f"image {width}x{height}: too extreme for the HD transform")
    new_h = math.ceil(new_h / TILE) * TILE
    if transposed:
        new_w, new_h = new_h, new_w
    return new_w, new_h


def _special_strings(tokenizer_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The strings of transformers' ``special_tokens_map`` (vLLM strips the space the
    decoder leaves after each of them before splitting)."""
    out: list[str] = []
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = tokenizer_config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            out.append(value)
    for value in tokenizer_config.get("additional_special_tokens") or ():
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            out.append(value)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class Phi3VFamily:
    image_token_id: int
    num_crops: int
    num_img_tokens: int
    bos_token_id: int | None
    special_tokens: tuple[str, ...] = ()
    # encode("<s> <|image|>") with this tokenizer: vLLM drops the 2nd id when the
    # expanded prompt starts with exactly these two ids (a HF-parity fix-up).
    bos_image_prefix: tuple[int, ...] = ()
    name: str = "phi3_v"

    needs_text: ClassVar[bool] = True

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        preprocessor: Mapping[str, Any],
        tokenizer_config: Mapping[str, Any],
        vocab: TokenLookup | None,
        overrides: Mapping[str, Any] | None = None,
    ) -> "Phi3VFamily":
        token = resolve_image_token_id(config, vocab, IMAGE_TOKEN)
        if token is None:
            token = IMAGE_TOKEN_ID
        crops = as_int(preprocessor.get("num_crops"), 16)
        if overrides:
            crops = as_int(overrides.get("num_crops"), crops)
        img_tokens = as_int(preprocessor.get("num_img_tokens"), 144)
        specials = _special_strings(tokenizer_config)
        bos = tokenizer_config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        bos_id = vocab.token_to_id(bos) if (vocab is not None and isinstance(bos, str)) else None
        prefix = tuple(vocab.encode("<s> <|image|>", False)) if vocab is not None else ()
        return cls(token, crops, img_tokens, bos_id, specials, prefix)

    def placeholder(self, index: int) -> str:
        return f"<|image_{index}|>"

    def hd_size(self, width: int, height: int) -> tuple[int, int]:
        return hd_transform_size(width, height, self.num_crops)

    def num_image_tokens(self, width: int, height: int) -> int:
        w, h = self.hd_size(width, height)
        return (h // TILE * w // TILE + 1) * self.num_img_tokens + 1 + (h // TILE + 1) * _NEWLINE_TOKENS_PER_ROW

    def expand(
        self, token_ids: Sequence[int], images: Sequence[ImageInput], encode: Encode
    ) -> tuple[list[int], list[MMItem]]:
        raise ExpansionError("needs_text", "Phi-3-vision expansion re-tokenizes the prompt text: use expand_text")

    def expand_text(
        self, text: str, images: Sequence[ImageInput], encode: Encode
    ) -> tuple[list[int], list[MMItem]]:
        """``text`` is the prompt string as rendered (what vLLM recovers by decoding the
        ids, minus a leading BOS). Returns the engine's ids and, per image in image
        order, its span of ``<|image|>`` ids. The tag ``<|image_N|>`` takes image N; a
        tag whose image was already placed, or with no such image, stays as text."""
        if not images:
            return list(encode(text, False)), []
        counts = [self.num_image_tokens(im.width, im.height) for im in images]
        ids: list[int] = []
        spans: dict[int, MMItem] = {}
        pos = 0
        for match in TAG_RE.finditer(text):
            ids.extend(encode(text[pos : match.start()], True))
            k = int(match.group(1)) - 1
            if 0 <= k < len(images) and k not in spans:
                spans[k] = MMItem(images[k].identifier, len(ids), counts[k])
                ids.extend([self.image_token_id] * counts[k])
            else:
                ids.extend(encode(match.group(0), False))
            pos = match.end()
        ids.extend(encode(text[pos:], True))
        if len(spans) != len(images):
            missing = [f"<|image_{k + 1}|>" for k in range(len(images)) if k not in spans]
            raise placeholder_count_error(len(spans), len(images), f"missing {', '.join(missing)}")
        items = [spans[k] for k in range(len(images))]
        prefix = self.bos_image_prefix
        if len(prefix) == 2 and tuple(ids[:2]) == prefix:
            ids = [ids[0], *ids[2:]]
            items = [MMItem(it.identifier, it.offset - 1, it.length) for it in items]
        return ids, items

    def text_from_ids(self, token_ids: Sequence[int], decode: Any) -> str:
        """The text vLLM splits: drop a leading BOS, ``decode(ids)`` (special tokens kept),
        then remove the space the decoder leaves after each special token. For a
        renderer that holds ids rather than the rendered string."""
        ids = list(token_ids)
        if ids and self.bos_token_id is not None and ids[0] == self.bos_token_id:
            ids = ids[1:]
        text = decode(ids)
        for tok in self.special_tokens:
            text = text.replace(tok + " ", tok)
        return text
