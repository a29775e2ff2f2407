"""What every vision-language family module provides (pure: config files + image size).

A family module turns the prompt's *unexpanded* token ids (one placeholder per
image, as the chat template and tokenizer produce them) into the ids the engine's
processor produces, plus each image's placeholder span. Nothing here touches the
network or decodes pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence


@dataclass(frozen=True)
class ImageInput:
    """An image as the family sees it: its content identifier and decoded size."""

    identifier: str
    width: int
    height: int


@dataclass(frozen=True)
class MMItem:
    """One image's placeholder span in the expanded prompt (vLLM's PlaceholderRange)."""

    identifier: str
    offset: int
    length: int


class ExpansionError(ValueError):
    """The prompt cannot be expanded exactly (e.g. placeholder count != image count).
    ``reason`` is a short metric label; ``str()`` is the human message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# encode(text, add_special_tokens) -> ids, as the model's tokenizer does it.
Encode = Callable[[str, bool], list[int]]


class VisionFamily(Protocol):
    """Optional: a family whose engine re-tokenizes the prompt text (Phi-3-vision) sets
    ``needs_text = True`` and offers ``expand_text(text, images, encode) -> (ids,
    spans)`` taking the rendered prompt string; its ``expand`` raises ExpansionError."""

    name: str
    image_token_id: int  # the id filling image spans in the vLLM view

    def placeholder(self, index: int) -> str:
        """The text a "string"-format template gets for image ``index`` (1-based)."""

    def num_image_tokens(self, width: int, height: int) -> int:
        """Exact number of embedded image positions for one image of this size."""

    def expand(
        self, token_ids: Sequence[int], images: Sequence[ImageInput], encode: Encode
    ) -> tuple[list[int], list[MMItem]]:
        """Expand placeholders in order; raise ExpansionError when it cannot be exact."""
