"""Fixture access for the model-family tests: config dicts and the real tokenizers."""

from __future__ import annotations

import functools
import json
import lzma
import os
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MODELS = os.path.join(FIXTURES, "models")

QWEN2 = "Qwen__Qwen2-VL-2B"
QWEN25 = "Qwen__Qwen2.5-VL-7B-Instruct"
QWEN3 = "Qwen__Qwen3-VL-8B-Instruct"
QWEN3_EMB = "Qwen__Qwen3-VL-Embedding-8B"
LLAVA = "llava-hf__llava-1.5-7b-hf"
LLAVA_NEXT = "llava-hf__llava-v1.6-mistral-7b-hf"
PHI3V = "microsoft__Phi-3-vision-128k-instruct"
GEMMA3 = "google__gemma-3-4b-it"


def _read_json(model: str, name: str) -> dict[str, Any]:
    path = os.path.join(MODELS, model, name)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    if os.path.exists(path + ".xz"):
        with lzma.open(path + ".xz") as fh:
            return json.loads(fh.read().decode("utf-8"))
    return {}


@dataclass
class Files:
    """The three dicts detect_family reads (what models.files.ModelFiles carries)."""

    config: dict[str, Any] = field(default_factory=dict)
    preprocessor_config: dict[str, Any] = field(default_factory=dict)
    tokenizer_config: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=None)
def files(model: str) -> Files:
    return Files(
        _read_json(model, "config.json"),
        _read_json(model, "preprocessor_config.json"),
        _read_json(model, "tokenizer_config.json"),
    )


class RawTokenizer:
    """The fixture's tokenizer.json through HF ``tokenizers`` (no tokenizer_config merge):
    ``token_to_id`` and ``encode(text, add_special_tokens) -> list[int]``."""

    def __init__(self, model: str):
        with lzma.open(os.path.join(MODELS, model, "tokenizer.json.xz")) as fh:
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
    if not os.path.exists(os.path.join(MODELS, model, "tokenizer.json.xz")):
        return None
    return RawTokenizer(model)


@functools.lru_cache(maxsize=None)
def expected_image_tokens() -> dict[str, Any]:
    with open(os.path.join(FIXTURES, "expected_image_tokens.json"), encoding="utf-8") as fh:
        return json.load(fh)["models"]


@functools.lru_cache(maxsize=None)
def expected_prompts() -> dict[str, Any]:
    with open(os.path.join(FIXTURES, "expected_prompts.json"), encoding="utf-8") as fh:
        return json.load(fh)["cases"]


def expand_compact(compact: list[Any]) -> list[int]:
    """``[1, "32044 x 3", 2]`` -> ``[1, 32044, 32044, 32044, 2]``."""
    out: list[int] = []
    for item in compact:
        if isinstance(item, str):
            tid, n = item.split(" x ")
            out.extend([int(tid)] * int(n))
        else:
            out.append(item)
    return out


def parse_size(key: str) -> tuple[int, int]:
    w, h = key.split("x")
    return int(w), int(h)
