"""LLaVA-NeXT (v1.6) "anyres": tiles, unpadding and newline slots (ENGINES.md §5.1).

vLLM 0.33 ``model_executor/models/llava_next.py``
(``LlavaNextProcessingInfo.get_num_image_tokens`` / ``_get_num_unpadded_features``)
with transformers ``image_processing_utils.select_best_resolution``:

1. best pinpoint (height, width): largest effective resolution
   ``min(int(w*s) * int(h*s), w*h)`` with ``s = min(W/w, H/h)``, ties to least waste;
2. a grid of ``H // tile`` x ``W // tile`` tiles of ``tile // patch`` features each side;
3. remove the letterbox padding (``int(round(x, 7))`` on a float ratio) from the
   longer padded side;
4. N = unpadded features + one newline slot per feature row + the base image (576).

All positions hold the image token (32000); the span is the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from mmroute.models.base import Encode, ExpansionError, ImageInput, MMItem
from mmroute.models.common import TokenLookup, check_size, expand_repeated, require_image_token_id
from mmroute.models.llava import PLACEHOLDER, base_feature_size, vision_geometry

# transformers LlavaNextConfig default image_grid_pinpoints (height, width).
_DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def select_best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    best: tuple[int, int] | None = None
    best_effective = 0
    best_waste = float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = ph * pw - effective
        if effective > best_effective or (effective == best_effective and waste < best_waste):
            best, best_effective, best_waste = (ph, pw), effective, waste
    if best is None:  # transformers finds no fit either (the image rounds to 0 pixels)
        raise ExpansionError("image_size", f"image {width}x{height} fits no grid pinpoint")
    return best


def unpadded_features(height: int, width: int, per_tile: int, tiles_h: int, tiles_w: int) -> tuple[int, int]:
    """(feature rows, feature columns) left after removing the padding; the float
    expressions keep vLLM's operand order so rounding matches."""
    cur_h = per_tile * tiles_h
    cur_w = per_tile * tiles_w
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= 2 * ((cur_h - new_h) // 2)
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= 2 * ((cur_w - new_w) // 2)
    return cur_h, cur_w


def _pinpoints(config: Mapping[str, Any], preprocessor: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    raw = config.get("image_grid_pinpoints") or preprocessor.get("image_grid_pinpoints") or _DEFAULT_PINPOINTS
    points = tuple((int(p[0]), int(p[1])) for p in raw)
    if not points or any(h <= 0 or w <= 0 for h, w in points):
        raise ValueError(f"llava_next: invalid image_grid_pinpoints {raw!r}")
    return points


@dataclass(frozen=True)
class LlavaNextFamily:
    image_token_id: int
    pinpoints: tuple[tuple[int, int], ...]  # (height, width)
    tile_size: int  # vision image_size (336)
    features_per_tile: int  # image_size // patch_size (24)
    base_tokens: int  # the downscaled whole image (576)
    name: str = "llava_next"

    needs_text: ClassVar[bool] = False

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], preprocessor: Mapping[str, Any], vocab: TokenLookup | None
    ) -> "LlavaNextFamily":
        token = require_image_token_id(config, vocab, PLACEHOLDER, "llava_next")
        image_size, patch, _ = vision_geometry(config, preprocessor)
        return cls(token, _pinpoints(config, preprocessor), image_size, image_size // patch,
                   base_feature_size(config, preprocessor))

    def placeholder(self, index: int) -> str:
        return PLACEHOLDER

    def num_image_tokens(self, width: int, height: int) -> int:
        check_size(width, height)
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        rows, cols = unpadded_features(
            height, width, self.features_per_tile, best_h // self.tile_size, best_w // self.tile_size
        )
        return rows * cols + rows + self.base_tokens

    def expand(
        self, token_ids: Sequence[int], images: Sequence[ImageInput], encode: Encode
    ) -> tuple[list[int], list[MMItem]]:
        return expand_repeated(token_ids, images, self.image_token_id, self.num_image_tokens)
