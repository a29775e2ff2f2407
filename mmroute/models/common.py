"""Pieces every family module shares: image-token resolution and single-token expansion.

Pure functions of config dicts and token ids; nothing here knows a model family.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

from mmroute.models.base import ExpansionError, ImageInput, MMItem


class TokenLookup(Protocol):
    """What the families need from the tokenizer at construction time."""

    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


# ENGINES.md §4.7: the config keys naming the id that fills image spans, in the
# order vLLM's model classes read them. ``vision_token_id`` (Qwen's <|vision_pad|>)
# is deliberately absent: it never appears in image prompts.
_IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "media_placeholder_token_id")


def resolve_image_token_id(config: Mapping[str, Any], vocab: TokenLookup | None, token: str) -> int | None:
    """config ``image_token_id`` → ``image_token_index`` → ``media_placeholder_token_id``
    → the tokenizer's id for ``token``."""
    for key in _IMAGE_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    if vocab is not None:
        tid = vocab.token_to_id(token)
        if tid is not None:
            return tid
    return None


def require_image_token_id(config: Mapping[str, Any], vocab: TokenLookup | None, token: str, family: str) -> int:
    """``resolve_image_token_id``, or a ValueError naming ``family`` when nothing resolves."""
    tid = resolve_image_token_id(config, vocab, token)
    if tid is None:
        raise ValueError(f"{family}: cannot resolve the image token id ({token} not in the vocabulary)")
    return tid


def check_size(width: int, height: int) -> None:
    if not (isinstance(width, int) and isinstance(height, int)) or width <= 0 or height <= 0:
        raise ExpansionError("image_size", f"invalid image size {width}x{height}")


def placeholder_count_error(found: int, images: int, what: str) -> ExpansionError:
    return ExpansionError(
        "placeholder_count",
        f"the prompt has {found} image placeholder(s) ({what}) but the request has {images} image(s)",
    )


def find_all(token_ids: Sequence[int], token_id: int) -> list[int]:
    """Positions of ``token_id`` (list.index scans in C: ~10x a Python loop on 2k ids)."""
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    out: list[int] = []
    i = -1
    try:
        while True:
            i = ids.index(token_id, i + 1)
            out.append(i)
    except ValueError:
        return out


def expand_repeated(
    token_ids: Sequence[int],
    images: Sequence[ImageInput],
    token_id: int,
    count: Callable[[int, int], int],
) -> tuple[list[int], list[MMItem]]:
    """Replace the i-th occurrence of ``token_id`` with ``count(w, h)`` copies of itself
    for image i; each image's span is exactly those copies (vLLM PromptReplacement of a
    single token by ``[token] * N``: the PlaceholderRange starts at the first copy)."""
    positions = find_all(token_ids, token_id)
    if len(positions) != len(images):
        raise placeholder_count_error(len(positions), len(images), f"token {token_id}")
    out: list[int] = []
    items: list[MMItem] = []
    prev = 0
    for pos, image in zip(positions, images):
        n = count(image.width, image.height)
        out.extend(token_ids[prev:pos])
        items.append(MMItem(image.identifier, len(out), n))
        out.extend([token_id] * n)
        prev = pos + 1
    out.extend(token_ids[prev:])
    return out, items


def as_int(value: Any, default: int) -> int:
    """A positive int from a config value, else ``default`` (configs sometimes hold null)."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, float) and value > 0 and value.is_integer():
        return int(value)
    return default
