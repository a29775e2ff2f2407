"""Gemma-3: 256 soft tokens per image with newline merging (ENGINES.md §5.1).

vLLM 0.33 ``model_executor/models/gemma3_mm.py``:

* ``_get_prompt_updates``: each ``<start_of_image>`` becomes the processor's
  ``full_image_sequence`` ``"\\n\\n" boi soft*256 eoi "\\n\\n"`` (pan-and-scan off);
* ``_apply_token_matches``: then newline ids merge, in three left-to-right passes
  (vLLM ``replace_token_matches``): ``[\\n, \\n\\n] -> \\n\\n\\n``,
  ``[\\n\\n, \\n] -> \\n\\n\\n``, ``[\\n\\n, \\n\\n] -> \\n\\n\\n\\n``;
* ``_find_mm_placeholders``: every ``\\n\\n\\n`` is read back as ``[\\n, \\n\\n]`` and every
  ``\\n\\n\\n\\n`` as ``[\\n\\n, \\n\\n]``; the full 260-id sequence is searched left to
  right without overlap, and each range starts at the original index of its first
  id with length 260, so adjacent images share a merged ``\\n\\n\\n\\n`` and overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from mmroute.models.base import Encode, ImageInput, MMItem
from mmroute.models.common import (
    TokenLookup,
    as_int,
    check_size,
    find_all,
    placeholder_count_error,
    require_image_token_id,
)

BOI = "<start_of_image>"
EOI = "<end_of_image>"
SOFT = "<image_soft_token>"


def replace_token_matches(ids: list[int], match: tuple[int, int], new: int) -> list[int]:
    """Non-overlapping left-to-right replacement of a 2-id pattern by one id."""
    out: list[int] = []
    i, n = 0, len(ids)
    a, b = match
    while i < n:
        if ids[i] == a and i + 1 < n and ids[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


@dataclass(frozen=True)
class Gemma3Family:
    image_token_id: int  # <image_soft_token>
    boi_id: int
    eoi_id: int
    nl1: int  # "\n"
    nl2: int  # "\n\n"
    nl3: int  # "\n\n\n"
    nl4: int  # "\n\n\n\n"
    tokens_per_image: int = 256
    boi_token: str = BOI
    name: str = "gemma3"

    needs_text: ClassVar[bool] = False
    # SGLang expands Gemma-3 images in the text (the HF processor's "\n\n" joins then
    # merge differently from vLLM's token-level newline merge) and pads only the 256
    # soft tokens (gemma3_mm.pad_input_ids): its image pages are keyed on text only.
    sglang_exact: ClassVar[bool] = False

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        tokenizer_config: Mapping[str, Any],
        vocab: TokenLookup,
    ) -> "Gemma3Family":
        def lookup(token: str) -> int:
            tid = vocab.token_to_id(token)
            if tid is None:
                raise ValueError(f"gemma3: {token!r} is not in the vocabulary")
            return tid

        boi_tok = tokenizer_config.get("boi_token") if isinstance(tokenizer_config.get("boi_token"), str) else BOI
        eoi_tok = tokenizer_config.get("eoi_token") if isinstance(tokenizer_config.get("eoi_token"), str) else EOI
        soft_tok = tokenizer_config.get("image_token") if isinstance(tokenizer_config.get("image_token"), str) else SOFT
        soft = require_image_token_id(config, vocab, soft_tok, "gemma3")
        boi = as_int(config.get("boi_token_index"), -1)
        eoi = as_int(config.get("eoi_token_index"), -1)
        return cls(
            image_token_id=soft,
            boi_id=boi if boi > 0 else lookup(boi_tok),
            eoi_id=eoi if eoi > 0 else lookup(eoi_tok),
            nl1=lookup("\n"),
            nl2=lookup("\n\n"),
            nl3=lookup("\n\n\n"),
            nl4=lookup("\n\n\n\n"),
            tokens_per_image=as_int(config.get("mm_tokens_per_image"), 256),
            boi_token=boi_tok,
        )

    @property
    def replacement(self) -> tuple[int, ...]:
        return (self.nl2, self.boi_id, *([self.image_token_id] * self.tokens_per_image), self.eoi_id, self.nl2)

    def placeholder(self, index: int) -> str:
        return self.boi_token

    def num_image_tokens(self, width: int, height: int) -> int:
        check_size(width, height)
        return self.tokens_per_image

    def expand(
        self, token_ids: Sequence[int], images: Sequence[ImageInput], encode: Encode
    ) -> tuple[list[int], list[MMItem]]:
        positions = find_all(token_ids, self.boi_id)
        if len(positions) != len(images):
            raise placeholder_count_error(len(positions), len(images), self.boi_token)
        for image in images:
            check_size(image.width, image.height)
        repl = self.replacement
        ids: list[int] = []
        prev = 0
        for pos in positions:
            ids.extend(token_ids[prev:pos])
            ids.extend(repl)
            prev = pos + 1
        ids.extend(token_ids[prev:])
        ids = replace_token_matches(ids, (self.nl1, self.nl2), self.nl3)
        ids = replace_token_matches(ids, (self.nl2, self.nl1), self.nl3)
        ids = replace_token_matches(ids, (self.nl2, self.nl2), self.nl4)
        return ids, self._find_ranges(ids, images)

    def _find_ranges(self, ids: list[int], images: Sequence[ImageInput]) -> list[MMItem]:
        # Read merged newlines back as vLLM does, remembering each id's original index.
        flat: list[int] = []
        orig: list[int] = []
        for i, t in enumerate(ids):
            if t == self.nl3:
                flat += (self.nl1, self.nl2)
                orig += (i, i)
            elif t == self.nl4:
                flat += (self.nl2, self.nl2)
                orig += (i, i)
            else:
                flat.append(t)
                orig.append(i)
        repl = list(self.replacement)
        size = len(repl)
        items: list[MMItem] = []
        start, n = 0, len(flat)
        while start + size <= n and len(items) < len(images):
            if flat[start] == repl[0] and flat[start + 1] == repl[1] and flat[start : start + size] == repl:
                items.append(MMItem(images[len(items)].identifier, orig[start], size))
                start += size
            else:
                start += 1
        if len(items) != len(images):
            # vLLM fails the request: the merged newlines hid a placeholder sequence.
            raise placeholder_count_error(len(items), len(images), "complete image sequences after newline merging")
        return items
