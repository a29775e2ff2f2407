"""ModelFiles: reading the small files once, .xz variants, templates, context length."""

from __future__ import annotations

import json
import lzma
import os
import shutil

import pytest

from mmroute.config import ConfigError
from mmroute.models.files import ModelFiles, derive_max_model_len
from fixture_models import (
    GEMMA3,
    LLAVA15,
    LLAVA_NEXT,
    PHI3V,
    QWEN2_VL,
    QWEN25_TEXT,
    QWEN25_VL,
    QWEN3_EMBED,
    QWEN3_TOK,
    QWEN3_VL,
    model_dir,
)
from render_helpers import files

DEMO = os.path.join(os.path.dirname(__file__), "..", "mmroute", "demo_model")


def test_qwen25_vl_files_and_xz_tokenizer():
    f = files(QWEN25_VL)
    assert f.config["model_type"] == "qwen2_5_vl"
    assert f.config["image_token_id"] == 151655
    assert f.preprocessor_config["max_pixels"] == 12845056
    assert f.generation_config  # present
    assert f.processor_config == {}  # absent file -> {}
    assert f.tokenizer_config["eos_token"] == "<|im_end|>"
    # tokenizer.json is only stored as tokenizer.json.xz: decompressed in memory.
    assert not os.path.exists(os.path.join(model_dir(QWEN25_VL), "tokenizer.json"))
    assert json.loads(f.tokenizer_json)["model"]["type"] == "BPE"
    assert f.max_model_len == 128000  # min(max_position_embeddings 128000, model_max_length 131072)


def test_chat_template_sources():
    # processor template (chat_template.json) and tokenizer_config template both present
    f = files(LLAVA_NEXT)
    assert f.chat_templates.processor.startswith("{% for message in messages %}{% if message['role'] == 'user' %}")
    assert f.chat_templates.tokenizer.startswith("{{ bos_token }}")
    # chat_template.jinja wins over chat_template.json; the tokenizer also reads it
    f = files(LLAVA15)
    with open(os.path.join(model_dir(LLAVA15), "chat_template.jinja"), encoding="utf-8") as fh:
        jinja = fh.read()
    assert f.chat_templates.processor == jinja
    assert f.chat_templates.tokenizer == jinja
    # text-only model: tokenizer template only
    f = files(QWEN25_TEXT)
    assert f.chat_templates.processor is None
    assert "You are Qwen, created by Alibaba Cloud" in f.chat_templates.tokenizer
    # Phi-3-V: no processor template
    assert files(PHI3V).chat_templates.processor is None
    assert files(PHI3V).chat_templates.tokenizer.startswith("{% for message in messages %}{{'<|' + message['role']")


def test_xz_tokenizer_config_gemma():
    f = files(GEMMA3)
    assert f.tokenizer_config["bos_token"] == "<bos>"  # tokenizer_config.json.xz
    assert len(f.tokenizer_config["added_tokens_decoder"]) == 6415
    assert f.max_model_len is None  # no config.json; model_max_length is the 1e30 "unset"


def test_tokenizer_source_override():
    f = files(QWEN3_EMBED)
    assert f.config["model_type"] == "qwen3_vl"
    assert f.tokenizer_json is not None  # from Qwen3-tokenizer
    own = ModelFiles.load(model_dir(QWEN3_EMBED))
    assert own.tokenizer_json is None
    assert f.chat_templates.processor.startswith("{%- set default_system_message = 'Represent the user\\'s input.'")
    assert f.max_model_len == 131072  # text_config 262144 capped by Qwen3 tokenizer model_max_length


def test_max_model_len_rules():
    assert files(QWEN3_VL).max_model_len == 262144  # text_config.max_position_embeddings
    assert files(LLAVA15).max_model_len == 4096  # text_config, tokenizer 1e30 ignored
    assert files(QWEN2_VL).max_model_len == 32768
    assert files(QWEN3_TOK).max_model_len == 131072  # tokenizer_config only
    assert derive_max_model_len(
        {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, {}
    ) == 16384
    assert derive_max_model_len(
        {"max_position_embeddings": 32768,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, {}
    ) == 131072
    assert derive_max_model_len({"max_position_embeddings": 128000,
                                 "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, {}) == 128000
    assert derive_max_model_len({}, {}) is None


def test_demo_model_loads():
    f = ModelFiles.load(DEMO)
    assert f.config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert f.tokenizer_json and f.chat_templates.processor


def test_plain_and_xz_copies_are_equivalent(tmp_path):
    src = model_dir(PHI3V)
    shutil.copytree(src, tmp_path / "m")
    # decompress tokenizer.json and compress tokenizer_config.json: same content either way
    with lzma.open(tmp_path / "m" / "tokenizer.json.xz") as fh:
        (tmp_path / "m" / "tokenizer.json").write_bytes(fh.read())
    os.remove(tmp_path / "m" / "tokenizer.json.xz")
    raw = (tmp_path / "m" / "tokenizer_config.json").read_bytes()
    with lzma.open(tmp_path / "m" / "tokenizer_config.json.xz", "wb") as fh:
        fh.write(raw)
    os.remove(tmp_path / "m" / "tokenizer_config.json")
    a, b = files(PHI3V), ModelFiles.load(str(tmp_path / "m"))
    assert a.tokenizer_json == b.tokenizer_json
    assert a.tokenizer_config == b.tokenizer_config


def test_errors_are_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not a directory"):
        ModelFiles.load(str(tmp_path / "missing" / "dir"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        ModelFiles.load(str(bad))
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        ModelFiles.load(str(bad))
    (bad / "config.json").write_text("{}")
    (bad / "tokenizer.json.xz").write_bytes(b"not xz at all")
    with pytest.raises(ConfigError, match="tokenizer.json.xz"):
        ModelFiles.load(str(bad))
    # An HF id that is not cached, offline: a clear ConfigError, no network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        ModelFiles.load("mmroute-test/not-a-real-model")


def test_defaults_of_a_bare_instance():
    # Missing files read as empty (the tokenizer says when tokenizer.json is missing).
    f = ModelFiles(source="x", path="x")
    assert f.config == {} and f.tokenizer_json is None and f.max_model_len is None
