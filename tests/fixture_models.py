"""The vendored fixtures: model directories (``tests/fixtures/models/<name>/``, large
files as ``NAME.xz``) and the reference JSON files, named in one place."""

from __future__ import annotations

import functools
import json
import lzma
import os
from typing import Any

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MODELS = os.path.join(FIXTURES, "models")

QWEN2_VL = "Qwen__Qwen2-VL-2B"
QWEN25_VL = "Qwen__Qwen2.5-VL-7B-Instruct"
QWEN25_TEXT = "Qwen__Qwen2.5-0.5B-Instruct"
QWEN3_VL = "Qwen__Qwen3-VL-8B-Instruct"
QWEN3_EMBED = "Qwen__Qwen3-VL-Embedding-8B"  # no tokenizer.json: borrows QWEN3_TOK's
QWEN3_TOK = "Qwen__Qwen3-tokenizer"
GEMMA3 = "google__gemma-3-4b-it"
LLAVA15 = "llava-hf__llava-1.5-7b-hf"
LLAVA_NEXT = "llava-hf__llava-v1.6-mistral-7b-hf"
PHI3V = "microsoft__Phi-3-vision-128k-instruct"
PHI3_MINI = "ortx-testdata__phi-3-mini"

# Every fixture with its own tokenizer.json (the embedding model borrows Qwen3's).
TOKENIZER_MODELS = [QWEN2_VL, QWEN25_TEXT, QWEN25_VL, QWEN3_VL, QWEN3_TOK, GEMMA3, LLAVA15, LLAVA_NEXT,
                    PHI3V, PHI3_MINI]


def model_dir(name: str) -> str:
    return os.path.join(MODELS, name)


def read_model_json(name: str, filename: str) -> dict[str, Any]:
    """``filename`` of fixture model ``name`` (or its ``.xz``), read directly (not through
    ``ModelFiles``); ``{}`` when the model has neither."""
    path = os.path.join(model_dir(name), filename)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    if os.path.exists(path + ".xz"):
        with lzma.open(path + ".xz") as fh:
            return json.loads(fh.read().decode("utf-8"))
    return {}


@functools.lru_cache(maxsize=None)
def reference(filename: str) -> dict[str, Any]:
    """A reference file of ``tests/fixtures`` (``expected_prompts.json``, ``expected_image_tokens.json``)."""
    with open(os.path.join(FIXTURES, filename), encoding="utf-8") as fh:
        return json.load(fh)


def expand_compact(items: list[Any]) -> list[int]:
    """The reference files' compact id lists: ``[1, "32000 x 576", 2]`` → the full id list."""
    out: list[int] = []
    for it in items:
        if isinstance(it, str):
            tok, n = it.split(" x ")
            out.extend([int(tok)] * int(n))
        else:
            out.append(int(it))
    return out
