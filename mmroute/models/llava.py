"""LLaVA-1.5: a fixed number of image positions per image (ENGINES.md §5.1).

vLLM 0.33 ``model_executor/models/llava.py``: ``get_num_image_tokens`` is the vision
encoder's token count (CLIP: ``(image_size // patch_size)**2 + 1`` for the class
embedding; SigLIP: no class token) minus one under the "default"
``vision_feature_select_strategy`` (``_apply_feature_select_strategy``). The single
``<image>`` id (config ``image_token_index``, 32000) becomes N copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from mmroute.models.base import Encode, ImageInput, MMItem
from mmroute.models.common import TokenLookup, as_int, check_size, expand_repeated, require_image_token_id

PLACEHOLDER = "<image>"


def vision_geometry(config: Mapping[str, Any], preprocessor: Mapping[str, Any]) -> tuple[int, int, bool]:
    """(image_size, patch_size, has_class_token) of the vision tower. Without config.json
    (some llava-hf repos ship only processor files) fall back to the processor's crop
    size and the CLIP ViT-L/14 defaults every LLaVA-1.5/NeXT checkpoint uses."""
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    crop = preprocessor.get("crop_size")
    crop_size = crop.get("height") if isinstance(crop, dict) else crop
    image_size = as_int(vision.get("image_size"), as_int(crop_size, 336))
    patch = as_int(vision.get("patch_size"), 14)
    has_cls = "siglip" not in str(vision.get("model_type", "clip_vision_model"))
    return image_size, patch, has_cls


def base_feature_size(config: Mapping[str, Any], preprocessor: Mapping[str, Any]) -> int:
    image_size, patch, has_cls = vision_geometry(config, preprocessor)
    n = (image_size // patch) ** 2 + (1 if has_cls else 0)
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy == "default":
        return n - 1
    if strategy == "full":
        return n
    raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")


@dataclass(frozen=True)
class LlavaFamily:
    image_token_id: int
    tokens_per_image: int
    name: str = "llava"

    needs_text: ClassVar[bool] = False

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], preprocessor: Mapping[str, Any], vocab: TokenLookup | None
    ) -> "LlavaFamily":
        token = require_image_token_id(config, vocab, PLACEHOLDER, "llava")
        return cls(token, base_feature_size(config, preprocessor))

    def placeholder(self, index: int) -> str:
        return PLACEHOLDER

    def num_image_tokens(self, width: int, height: int) -> int:
        check_size(width, height)
        return self.tokens_per_image

    def expand(
        self, token_ids: Sequence[int], images: Sequence[ImageInput], encode: Encode
    ) -> tuple[list[int], list[MMItem]]:
        return expand_repeated(token_ids, images, self.image_token_id, self.num_image_tokens)
