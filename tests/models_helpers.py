"""Fixture access for the model-family tests: config dicts and the real tokenizers."""

from __future__ import annotations

import functools
import lzma
import os
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from fixture_models import model_dir, read_model_json, reference


@dataclass
class Files:
    """The three dicts detect_family reads (what models.files.ModelFiles carries)."""

    config: dict[str, Any] = field(default_factory=dict)
    preprocessor_config: dict[str, Any] = field(default_factory=dict)
    tokenizer_config: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=None)
def files(model: str) -> Files:
    return Files(
        read_model_json(model, "config.json"),
        read_model_json(model, "preprocessor_config.json"),
        read_model_json(model, "tokenizer_config.json"),
    )


class RawTokenizer:
    """The fixture's tokenizer.json through HF ``tokenizers`` (no tokenizer_config merge):
    ``token_to_id`` and ``encode(text, add_special_tokens) -> list[int]``."""

    def __init__(self, model: str):
        with lzma.open(os.path.join(model_dir(model), "tokenizer.json.xz")) as fh:
            self.tok = Tokenizer.from_str(fh.read().decode("utf-8"))

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=None)
def tokenizer(model: str) -> RawTokenizer | None:
    """None for fixtures without a tokenizer.json (Qwen3-VL-Embedding)."""
    if not os.path.exists(os.path.join(model_dir(model), "tokenizer.json.xz")):
        return None
    return RawTokenizer(model)


def expected_image_tokens() -> dict[str, Any]:
    return reference("expected_image_tokens.json")["models"]


def expected_prompts() -> dict[str, Any]:
    return reference("expected_prompts.json")["cases"]


def parse_size(key: str) -> tuple[int, int]:
    w, h = key.split("x")
    return int(w), int(h)
