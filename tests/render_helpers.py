"""Shared loaders for the render tests: each fixture model is loaded once per session."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from mmroute.models.files import ModelFiles
from mmroute.render.renderer import Renderer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MODELS = os.path.join(FIXTURES, "models")

QWEN25_VL = "Qwen__Qwen2.5-VL-7B-Instruct"
QWEN2_VL_BASE = "Qwen__Qwen2-VL-2B"
QWEN25_TEXT = "Qwen__Qwen2.5-0.5B-Instruct"
QWEN3_VL = "Qwen__Qwen3-VL-8B-Instruct"
QWEN3_EMBED = "Qwen__Qwen3-VL-Embedding-8B"
QWEN3_TOK = "Qwen__Qwen3-tokenizer"
GEMMA3 = "google__gemma-3-4b-it"
LLAVA15 = "llava-hf__llava-1.5-7b-hf"
LLAVA_NEXT = "llava-hf__llava-v1.6-mistral-7b-hf"
PHI3V = "microsoft__Phi-3-vision-128k-instruct"
PHI3_MINI = "ortx-testdata__phi-3-mini"

# Every fixture with its own tokenizer.json (the embedding model borrows Qwen3's).
TOKENIZER_MODELS = [QWEN2_VL_BASE, QWEN25_TEXT, QWEN25_VL, QWEN3_VL, QWEN3_TOK, GEMMA3, LLAVA15, LLAVA_NEXT,
                    PHI3V, PHI3_MINI]

QUESTION = "What is in this image?"


def model_dir(name: str) -> str:
    return os.path.join(MODELS, name)


@functools.lru_cache(maxsize=None)
def files(name: str) -> ModelFiles:
    if name == QWEN3_EMBED:
        return ModelFiles.load(model_dir(name), tokenizer_source=model_dir(QWEN3_TOK))
    return ModelFiles.load(model_dir(name))


@functools.lru_cache(maxsize=None)
def renderer(name: str) -> Renderer:
    return Renderer.from_files(files(name))


@functools.lru_cache(maxsize=None)
def expected_prompts() -> dict[str, Any]:
    with open(os.path.join(FIXTURES, "expected_prompts.json"), encoding="utf-8") as fh:
        return json.load(fh)


def expand_compact(items: list[Any]) -> list[int]:
    """``[1, "32000 x 576", 2]`` → the full id list."""
    out: list[int] = []
    for it in items:
        if isinstance(it, str):
            tok, n = it.split(" x ")
            out.extend([int(tok)] * int(n))
        else:
            out.append(int(it))
    return out


def image_message(text: str = QUESTION, url: str = "data:image/png;base64,AAAA") -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}
