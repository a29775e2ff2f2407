"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: smart_resize token counts (ENGINES.md §5.1).

vLLM 0.33 ``model_executor/models/qwen2_vl.py`` (``_get_vision_info``; Qwen3-VL
inherits it) resizes with transformers' ``smart_resize`` using
``factor = vision_config.patch_size * vision_config.spatial_merge_size`` and the image
processor's ``size`` limits, then ``N = grid_h * grid_w // merge**2``. The template
emits ``<|vision_start|><|image_pad|><|vision_end|>``; the single ``<|image_pad|>``
(config ``image_token_id``) becomes N copies and the span is those copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from mmroute.models.base import Encode, ExpansionError, ImageInput, MMItem
from mmroute.models.common import TokenLookup, as_int, check_size, expand_repeated, require_image_token_id

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
MAX_RATIO = 200  # transformers smart_resize rejects a longer/shorter side ratio above this

# transformers Qwen2VLImageProcessor class defaults, used only when the checkpoint's
# preprocessor_config.json leaves a field out.
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers ``qwen2_vl/image_processing_qwen2_vl.py::smart_resize`` (5.x), as a rule:
    Python ``round`` (half-even) to the factor, then scale down (floor, at least one
    factor) above ``max_pixels`` or up (ceil) below ``min_pixels``."""
    check_size(width, height)
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ExpansionError(
            "aspect_ratio",
            f"image {width}x{height}: aspect ratio above {MAX_RATIO} is rejected by the processor",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pixel_limits(preprocessor: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """(min_pixels, max_pixels) as the image processor builds ``size``: ``size``'s
    shortest_edge/longest_edge (old files: min_pixels/max_pixels inside ``size``),
    overridden by top-level ``min_pixels``/``max_pixels``, then by
    ``--mm-processor-kwargs``."""
    size = preprocessor.get("size") if isinstance(preprocessor.get("size"), dict) else {}
    lo = as_int(size.get("shortest_edge", size.get("min_pixels")), _DEFAULT_MIN_PIXELS)
    hi = as_int(size.get("longest_edge", size.get("max_pixels")), _DEFAULT_MAX_PIXELS)
    lo = as_int(preprocessor.get("min_pixels"), lo)
    hi = as_int(preprocessor.get("max_pixels"), hi)
    if overrides:
        osize = overrides.get("size") if isinstance(overrides.get("size"), dict) else {}
        lo = as_int(overrides.get("min_pixels", osize.get("shortest_edge")), lo)
        hi = as_int(overrides.get("max_pixels", osize.get("longest_edge")), hi)
    return lo, hi


@dataclass(frozen=True)
class QwenVLFamily:
    name: str  # "qwen2_vl" | "qwen2_5_vl" | "qwen3_vl"
    image_token_id: int
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    needs_text: ClassVar[bool] = False

    @classmethod
    def from_config(
        cls,
        name: str,
        config: Mapping[str, Any],
        preprocessor: Mapping[str, Any],
        vocab: TokenLookup | None,
        overrides: Mapping[str, Any] | None = None,
    ) -> "QwenVLFamily":
        default_patch = 16 if name.startswith("qwen3") else 14
        vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
        # vLLM reads patch/merge from the model config; the processor file carries the same.
        patch = as_int(vision.get("patch_size"), as_int(preprocessor.get("patch_size"), default_patch))
        merge = as_int(vision.get("spatial_merge_size"), as_int(preprocessor.get("merge_size"), 2))
        lo, hi = pixel_limits(preprocessor, overrides)
        token = require_image_token_id(config, vocab, IMAGE_PAD, name)
        return cls(name, token, patch, merge, lo, hi)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def placeholder(self, index: int) -> str:
        return PLACEHOLDER

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The processor's (height, width) after smart_resize."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` of one image (t is 1: a still image fills one temporal patch)."""
        h, w = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, width: int, height: int) -> int:
        t, gh, gw = self.grid(width, height)
        return t * gh * gw // (self.merge_size * self.merge_size)

    def expand(
        self, token_ids: Sequence[int], images: Sequence[ImageInput], encode: Encode
    ) -> tuple[list[int], list[MMItem]]:
        return expand_repeated(token_ids, images, self.image_token_id, self.num_image_tokens)
