"""Shared loaders for the render tests: each fixture model is loaded once per session."""

from __future__ import annotations

import functools
from typing import Any

from mmroute.models.files import ModelFiles
from mmroute.render.renderer import Renderer

from fixture_models import QWEN3_EMBED, QWEN3_TOK, model_dir, reference

QUESTION = "What is in this image?"


@functools.lru_cache(maxsize=None)
def files(name: str) -> ModelFiles:
    if name == QWEN3_EMBED:
        return ModelFiles.load(model_dir(name), tokenizer_source=model_dir(QWEN3_TOK))
    return ModelFiles.load(model_dir(name))


@functools.lru_cache(maxsize=None)
def renderer(name: str) -> Renderer:
    return Renderer.from_files(files(name))


def expected_prompts() -> dict[str, Any]:
    return reference("expected_prompts.json")


def image_message(text: str = QUESTION, url: str = "data:image/png;base64,AAAA") -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}
