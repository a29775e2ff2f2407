"""The model's small files, read once: configs, tokenizer, chat templates.

``ModelFiles.load(source)`` accepts a local directory or a Hugging Face repo id
(resolved through ``huggingface_hub.snapshot_download`` with only the small text
files allowed, so it honours ``HF_HUB_OFFLINE`` and the HF cache). Every file may
also be stored as ``NAME.xz`` (the test fixtures and the embedded demo model do
this for large tokenizers); it is decompressed in memory.
"""

from __future__ import annotations

import json
import lzma
import os
from dataclasses import dataclass, field
from typing import Any, Union

from mmroute.config import ConfigError

# The only files the router needs (no weights); also the HF download allow-list.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
)

# A chat template is a string, or named templates ({"default": ..., "tool_use": ...}).
Template = Union[str, dict[str, str]]

# tokenizer_config "model_max_length" of 1e30 means "unset" (transformers' VERY_LARGE_INTEGER).
_SANE_MAX_LEN = 1 << 40


@dataclass(frozen=True)
class ChatTemplates:
    """The two template sources vLLM chooses between (ENGINES.md §4.2)."""

    processor: Template | None = None  # chat_template.jinja / chat_template.json
    tokenizer: Template | None = None  # tokenizer_config.json (chat_template.jinja overrides)


@dataclass
class ModelFiles:
    source: str
    path: str  # local directory the files were read from
    config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    preprocessor_config: dict[str, Any] = field(default_factory=dict)
    processor_config: dict[str, Any] = field(default_factory=dict)
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    special_tokens_map: dict[str, Any] = field(default_factory=dict)
    added_tokens: dict[str, int] = field(default_factory=dict)  # added_tokens.json
    tokenizer_json: str | None = None
    chat_templates: ChatTemplates = field(default_factory=ChatTemplates)
    max_model_len: int | None = None

    @classmethod
    def load(cls, source: str, *, tokenizer_source: str | None = None) -> "ModelFiles":
        """Read a model's small files. ``tokenizer_source`` (like vLLM ``--tokenizer``)
        takes the tokenizer files from another directory or repo id."""
        path = resolve_source(source)
        tok_path = resolve_source(tokenizer_source) if tokenizer_source else path

        config = _read_json(path, "config.json")
        tokenizer_config = _read_json(tok_path, "tokenizer_config.json")
        jinja = _read_text(path, "chat_template.jinja")
        ct_json = _read_json(path, "chat_template.json")
        processor_tpl = jinja if jinja is not None else _template_value(ct_json.get("chat_template"))
        # transformers' tokenizer also prefers a saved chat_template.jinja over
        # the tokenizer_config entry (tokenization_utils_base.from_pretrained).
        tok_jinja = _read_text(tok_path, "chat_template.jinja") if tok_path != path else jinja
        tokenizer_tpl = (
            tok_jinja if tok_jinja is not None else _template_value(tokenizer_config.get("chat_template"))
        )
        files = cls(
            source=source,
            path=path,
            config=config,
            generation_config=_read_json(path, "generation_config.json"),
            preprocessor_config=_read_json(path, "preprocessor_config.json"),
            processor_config=_read_json(path, "processor_config.json"),
            tokenizer_config=tokenizer_config,
            special_tokens_map=_read_json(tok_path, "special_tokens_map.json"),
            added_tokens=_read_json(tok_path, "added_tokens.json"),
            tokenizer_json=_read_text(tok_path, "tokenizer.json"),
            chat_templates=ChatTemplates(processor=processor_tpl, tokenizer=tokenizer_tpl),
        )
        files.max_model_len = derive_max_model_len(config, tokenizer_config)
        return files

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config (multimodal configs nest it)."""
        for key in ("text_config", "llm_config", "language_config"):
            sub = self.config.get(key)
            if isinstance(sub, dict) and sub:
                return sub
        return self.config


def resolve_source(source: str) -> str:
    """A local directory, or a HF repo id downloaded (small files only) to the cache."""
    if not source or not isinstance(source, str):
        raise ConfigError("model source is empty")
    expanded = os.path.expanduser(source)
    if os.path.isdir(expanded):
        return expanded
    looks_local = expanded.startswith(("/", "./", "../", "~")) or os.sep in expanded.strip("/").replace("/", "", 1)
    if os.path.exists(expanded) or looks_local:
        raise ConfigError(f"model path {source!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - dependency always installed
        raise ConfigError(f"cannot resolve {source!r}: huggingface_hub is not installed") from exc
    try:
        return snapshot_download(repo_id=source, allow_patterns=list(SMALL_FILES))
    except Exception as exc:  # any hub/offline/cache failure is a startup config problem
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        hint = " (HF_HUB_OFFLINE is set and the model is not in the HF cache)" if offline else ""
        raise ConfigError(f"cannot load model files for {source!r}{hint}: {type(exc).__name__}: {exc}") from exc


def _read_bytes(path: str, name: str) -> bytes | None:
    plain = os.path.join(path, name)
    try:
        with open(plain, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot read {plain}: {exc}") from exc
    packed = plain + ".xz"
    try:
        with lzma.open(packed, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None
    except (OSError, lzma.LZMAError) as exc:
        raise ConfigError(f"cannot read {packed}: {exc}") from exc


def _read_text(path: str, name: str) -> str | None:
    data = _read_bytes(path, name)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{os.path.join(path, name)} is not UTF-8: {exc}") from exc


def _read_json(path: str, name: str) -> dict[str, Any]:
    text = _read_text(path, name)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{os.path.join(path, name)} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{os.path.join(path, name)} must hold a JSON object")
    return value


def _template_value(value: Any) -> Template | None:
    """Normalise a stored template: a string, or a list of {name, template} → dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, list):
        out: dict[str, str] = {}
        for item in value:
            if isinstance(item, dict) and "name" in item and "template" in item:
                out[str(item["name"])] = str(item["template"])
        return out or None
    return None


_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def derive_max_model_len(config: dict[str, Any], tokenizer_config: dict[str, Any]) -> int | None:
    """The context length vLLM derives by default (``_get_and_verify_max_len``):
    the smallest length key of the text config, scaled by a RoPE factor (not for
    mrope/su/longrope/llama3), capped by a sane tokenizer ``model_max_length``."""
    text = config
    for key in ("text_config", "llm_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and sub:
            text = sub
            break
    lengths = [int(v) for k in _LEN_KEYS if isinstance(v := text.get(k), (int, float)) and v > 0]
    derived: int | None = min(lengths) if lengths else None
    rope = text.get("rope_scaling")
    if derived is not None and isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in ("su", "longrope", "llama3", "mrope", "default", None):
            factor = rope.get("factor", 1.0)
            if rope_type == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
                derived = rope["original_max_position_embeddings"]
            if isinstance(factor, (int, float)) and factor > 0:
                derived = int(derived * factor)
    tok_len = tokenizer_config.get("model_max_length")
    if isinstance(tok_len, (int, float)) and 0 < tok_len < _SANE_MAX_LEN:
        derived = int(tok_len) if derived is None else min(derived, int(tok_len))
    return derived
